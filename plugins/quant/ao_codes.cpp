#include "ao_codes.h"

#include <string>

#include <memrt/error.h>

#include "bucket_codes.h"
#include "quant_math.h"

#include "x86_simd.h"

namespace memrt::quant {

// The map, and for 256 entries its table (bucket_codes.h).
struct AoQuantizer::Prepared {
  std::vector<float> map;
  int size = 0;
  BucketCodes table;  // empty: no table
};

namespace {

using Prepared = AoQuantizer::Prepared;

void search_portable(const float* __restrict x, int64_t len, float scale, const Prepared& p, uint8_t* __restrict codes) {
  const float* map = p.map.data();
  for (int64_t i = 0; i < len; ++i) codes[i] = ao_code(map, p.size, x[i] / scale);
}

#if MEMRT_QUANT_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own AVX-512 headers (PR 105593)

// map[index] for 16 lanes: one permute of the register-resident 16-entry map, or a gather.
template <int Size>
inline __m512 lookup512(__m512i index, __m512 map16, const float* map) {
  if constexpr (Size == 16) {
    return _mm512_permutexvar_ps(index, map16);
  } else {
    return _mm512_i32gather_ps(index, map, 4);
  }
}

// The scalar rule on 16 lanes: the binary search, then nearest with ties up.
template <int Size>
inline __m512i search512(__m512 y, __m512 map16, const float* map) {
  const __m512i one = _mm512_set1_epi32(1), last = _mm512_set1_epi32(Size - 1);
  __m512i c = _mm512_setzero_si512();
  for (int step = Size / 2; step >= 1; step /= 2) {
    const __m512i probe = _mm512_add_epi32(c, _mm512_set1_epi32(step));
    const __mmask16 ge = _mm512_cmp_ps_mask(y, lookup512<Size>(probe, map16, map), _CMP_GE_OQ);
    c = _mm512_mask_mov_epi32(c, ge, probe);
  }
  const __m512i up = _mm512_min_epi32(_mm512_add_epi32(c, one), last);
  const __m512 lo = lookup512<Size>(c, map16, map), hi = lookup512<Size>(up, map16, map);
  const __mmask16 rounds_up = _mm512_cmp_ps_mask(_mm512_sub_ps(y, lo),
                                                 _mm512_mul_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(0.5f)), _CMP_GE_OQ);
  return _mm512_mask_mov_epi32(c, rounds_up, up);
}

template <int Size>
void search_avx512(const float* x, int64_t len, float scale, const Prepared& p, uint8_t* codes) {
  const float* map = p.map.data();
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 map16 = Size == 16 ? _mm512_loadu_ps(map) : _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i c = search512<Size>(_mm512_div_ps(_mm512_loadu_ps(x + i), s), map16, map);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(c));
  }
  search_portable(x + i, len - i, scale, p, codes + i);
}

// y = x / scale clamped to [-1, 1] (max first, so a NaN becomes -1: the search gives both code 0),
// then the table's code.
void table_avx512(const float* x, int64_t len, float scale, const Prepared& p, uint8_t* codes) {
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-1.f), hi = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(bucket_codes16(y, p.table)));
  }
  search_portable(x + i, len - i, scale, p, codes + i);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")

// The 16-entry map as two 8-entry halves: permute each, blend on the index's bit 3.
template <int Size>
inline __m256 lookup256(__m256i index, __m256 low8, __m256 high8, const float* map) {
  if constexpr (Size == 16) {
    const __m256 from_high = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));  // bit 3 to the sign
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low8, index), _mm256_permutevar8x32_ps(high8, index), from_high);
  } else {
    return _mm256_i32gather_ps(map, index, 4);
  }
}

template <int Size>
inline __m256i search256(__m256 y, __m256 low8, __m256 high8, const float* map) {
  const __m256i one = _mm256_set1_epi32(1), last = _mm256_set1_epi32(Size - 1);
  __m256i c = _mm256_setzero_si256();
  for (int step = Size / 2; step >= 1; step /= 2) {
    const __m256i probe = _mm256_add_epi32(c, _mm256_set1_epi32(step));
    const __m256 ge = _mm256_cmp_ps(y, lookup256<Size>(probe, low8, high8, map), _CMP_GE_OQ);
    c = _mm256_blendv_epi8(c, probe, _mm256_castps_si256(ge));
  }
  const __m256i up = _mm256_min_epi32(_mm256_add_epi32(c, one), last);
  const __m256 lo = lookup256<Size>(c, low8, high8, map), hi = lookup256<Size>(up, low8, high8, map);
  const __m256 rounds_up =
      _mm256_cmp_ps(_mm256_sub_ps(y, lo), _mm256_mul_ps(_mm256_sub_ps(hi, lo), _mm256_set1_ps(0.5f)), _CMP_GE_OQ);
  return _mm256_blendv_epi8(c, up, _mm256_castps_si256(rounds_up));
}

template <int Size>
void search_avx2(const float* x, int64_t len, float scale, const Prepared& p, uint8_t* codes) {
  const float* map = p.map.data();
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 low8 = Size == 16 ? _mm256_loadu_ps(map) : _mm256_setzero_ps();
  const __m256 high8 = Size == 16 ? _mm256_loadu_ps(map + 8) : _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    store_low_bytes8(search256<Size>(_mm256_div_ps(_mm256_loadu_ps(x + i), s), low8, high8, map), codes + i);
  search_portable(x + i, len - i, scale, p, codes + i);
}

void table_avx2(const float* x, int64_t len, float scale, const Prepared& p, uint8_t* codes) {
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-1.f), hi = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s), lo), hi);
    store_low_bytes8(bucket_codes8(y, p.table), codes + i);
  }
  search_portable(x + i, len - i, scale, p, codes + i);
}

#pragma GCC pop_options
#endif

}  // namespace

AoQuantizer::AoQuantizer(const float* map, int size, ops::CpuKernels kernels) : prepared_(std::make_unique<Prepared>()) {
  if (size != 16 && size != 256)
    throw Error("torchao quantization: a map of " + std::to_string(size) + " entries (16 or 256 expected)");
  if (!ops::cpu_supports(kernels))
    throw Error(std::string("torchao quantization: this processor cannot run the ") + ops::to_string(kernels) +
                " kernels");
  Prepared& p = *prepared_;
  p.map.assign(map, map + size);
  p.size = size;
  loop_ = &search_portable;
#if MEMRT_QUANT_X86
  const bool avx512 = kernels == ops::CpuKernels::kAvx512 ||
                      (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx512));
  const bool avx2 = !avx512 && (kernels == ops::CpuKernels::kAvx2 ||
                                (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx2)));
  if (size == 256 && (avx512 || avx2)) p.table.build([&p](float y) { return ao_code(p.map.data(), 256, y); });
  if (avx512) loop_ = size == 16 ? &search_avx512<16> : p.table.empty() ? &search_avx512<256> : &table_avx512;
  if (avx2) loop_ = size == 16 ? &search_avx2<16> : p.table.empty() ? &search_avx2<256> : &table_avx2;
#endif
}

AoQuantizer::~AoQuantizer() = default;

void AoQuantizer::codes(const float* x, int64_t len, float scale, uint8_t* codes) const {
  loop_(x, len, scale, *prepared_, codes);
}

bool AoQuantizer::uses_table() const { return !prepared_->table.empty(); }

}  // namespace memrt::quant
