#include "table_codes.h"

#include <string>

#include <memrt/error.h>

#include "quant_math.h"

#include "x86_simd.h"

namespace memrt::quant {

namespace {

void codes_portable(const float* __restrict x, int64_t len, float inv, const uint8_t* __restrict table,
                    uint8_t* __restrict codes) {
  for (int64_t i = 0; i < len; ++i) codes[i] = table[table_index(mul_rn(x[i], inv))];
}

void values_portable(const uint8_t* __restrict codes, int64_t len, const float* __restrict map, float scale,
                     float* __restrict out) {
  for (int64_t i = 0; i < len; ++i) out[i] = map[codes[i]] * scale;
}

#if MEMRT_QUANT_X86
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own AVX-512 headers (PR 105593)

// table_index(): max(v, -1) is the first clamp (maxps returns its second operand for a NaN, as the
// scalar rule gives -1), min(v, 1) the second; then ((v + 1) * 0.5) * 65535 + 0.5, truncated.
void codes_avx512(const float* x, int64_t len, float inv, const uint8_t* table, uint8_t* codes) {
  const __m512 scale = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-1.f), hi = _mm512_set1_ps(1.f),
               half = _mm512_set1_ps(0.5f), points = _mm512_set1_ps(static_cast<float>(kTableSize - 1));
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), scale);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512 t = _mm512_mul_ps(_mm512_add_ps(v, hi), half);
    const __m512i index = _mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(t, points), half));
    const __m512i code = _mm512_and_si512(_mm512_i32gather_epi32(index, table, 1), _mm512_set1_epi32(0xff));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
  codes_portable(x + i, len - i, inv, table, codes + i);
}

void values_avx512(const uint8_t* codes, int64_t len, const float* map, float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(index, map, 4), s));
  }
  values_portable(codes + i, len - i, map, scale, out + i);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")

void codes_avx2(const float* x, int64_t len, float inv, const uint8_t* table, uint8_t* codes) {
  const __m256 scale = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-1.f), hi = _mm256_set1_ps(1.f),
               half = _mm256_set1_ps(0.5f), points = _mm256_set1_ps(static_cast<float>(kTableSize - 1));
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256 t = _mm256_mul_ps(_mm256_add_ps(v, hi), half);
    const __m256i index = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(t, points), half));
    store_low_bytes8(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 1), codes + i);
  }
  codes_portable(x + i, len - i, inv, table, codes + i);
}

void values_avx2(const uint8_t* codes, int64_t len, const float* map, float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(map, index, 4), s));
  }
  values_portable(codes + i, len - i, map, scale, out + i);
}

#pragma GCC pop_options
#endif

// The loop of `kernels` among (AVX-512, AVX2, portable); kBest: the widest this processor runs.
template <typename Fn>
Fn pick_kernel(ops::CpuKernels kernels, Fn avx512, Fn avx2, Fn portable, const char* what) {
  if (!ops::cpu_supports(kernels))
    throw Error(std::string(what) + ": this processor cannot run the " + ops::to_string(kernels) + " kernels");
  if (avx512 && (kernels == ops::CpuKernels::kAvx512 ||
                 (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx512))))
    return avx512;
  if (avx2 && (kernels == ops::CpuKernels::kAvx2 ||
               (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx2))))
    return avx2;
  return portable;
}

#if MEMRT_QUANT_X86
constexpr TableCodesFn kCodesAvx512 = &codes_avx512, kCodesAvx2 = &codes_avx2;
constexpr TableValuesFn kValuesAvx512 = &values_avx512, kValuesAvx2 = &values_avx2;
#else
constexpr TableCodesFn kCodesAvx512 = nullptr, kCodesAvx2 = nullptr;
constexpr TableValuesFn kValuesAvx512 = nullptr, kValuesAvx2 = nullptr;
#endif

}  // namespace

TableCodesFn table_codes_kernel(ops::CpuKernels kernels) {
  return pick_kernel(kernels, kCodesAvx512, kCodesAvx2, &codes_portable, "8-bit quantization");
}

TableValuesFn table_values_kernel(ops::CpuKernels kernels) {
  return pick_kernel(kernels, kValuesAvx512, kValuesAvx2, &values_portable, "8-bit dequantization");
}

}  // namespace memrt::quant
