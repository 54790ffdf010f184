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

#pragma GCC pop_options
#endif

}  // namespace

TableCodesFn table_codes_kernel(ops::CpuKernels kernels) {
  if (!ops::cpu_supports(kernels))
    throw Error(std::string("8-bit quantization: this processor cannot run the ") + ops::to_string(kernels) + " kernels");
#if MEMRT_QUANT_X86
  if (kernels == ops::CpuKernels::kAvx512 || (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx512)))
    return &codes_avx512;
  if (kernels == ops::CpuKernels::kAvx2 || (kernels == ops::CpuKernels::kBest && ops::cpu_supports(ops::CpuKernels::kAvx2)))
    return &codes_avx2;
#endif
  return &codes_portable;
}

}  // namespace memrt::quant
