#include "dequant4.h"

#include <string>

#include <memrt/error.h>

#include "quant_math.h"

#include "x86_simd.h"

namespace memrt::quant {

namespace {

template <typename T>
inline T from_fp32(float v) {
  return static_cast<T>(v);  // c10::BFloat16 and c10::Half round to nearest-even
}

template <typename T>
void pairs_portable(const uint8_t* __restrict p, int64_t pairs, const float* __restrict map, float s,
                    T* __restrict out) {
  for (int64_t j = 0; j < pairs; ++j) {
    const uint8_t byte = p[j];
    out[2 * j] = from_fp32<T>(mul_rn(map[byte >> 4], s));
    out[2 * j + 1] = from_fp32<T>(mul_rn(map[byte & 15u], s));
  }
}

#if MEMRT_QUANT_X86
// ---- AVX-512F: 16 codes (8 bytes) a register; the map is one register, indexed by a permute ----
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own AVX-512 headers (PR 105593)

// Bytes b0..b7 -> their 16 codes in element order (b0 >> 4, b0 & 15, b1 >> 4, ...) as 32-bit lanes.
inline __m512i codes16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4), lo = _mm_and_si128(b, low4);
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
}

inline void store(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
// c10::BFloat16's rounding on the bits (a NaN becomes 0x7fc0).
inline void store(c10::BFloat16* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(h));
}
inline void store(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
void pairs(const uint8_t* p, int64_t n, const float* map, float s, T* out) {
  const __m512 lut = _mm512_loadu_ps(map), scale = _mm512_set1_ps(s);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store(out + 2 * j, _mm512_mul_ps(_mm512_permutexvar_ps(codes16(p + j), lut), scale));
  pairs_portable(p + j, n - j, map, s, out + 2 * j);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options
}  // namespace avx512

// ---- AVX2 + F16C: 8 codes (4 bytes) a register; the map is two registers, a blend on bit 3 ----
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

inline __m256i codes8(const uint8_t* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  const __m128i b = _mm_cvtsi32_si128(word);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4), lo = _mm_and_si128(b, low4);
  return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
}

inline void store(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store(c10::BFloat16* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Each 128-bit half packs its four values into its low quadword; the two quadwords are the eight.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}
inline void store(c10::Half* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
void pairs(const uint8_t* p, int64_t n, const float* map, float s, T* out) {
  const __m256 lut_lo = _mm256_loadu_ps(map), lut_hi = _mm256_loadu_ps(map + 8), scale = _mm256_set1_ps(s);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const __m256i idx = codes8(p + j);
    const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // code >= 8: the sign bit
    const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, idx), _mm256_permutevar8x32_ps(lut_hi, idx), high);
    store(out + 2 * j, _mm256_mul_ps(v, scale));
  }
  pairs_portable(p + j, n - j, map, s, out + 2 * j);
}

#pragma GCC pop_options
}  // namespace avx2
#endif

ops::CpuKernels resolve(ops::CpuKernels k) {
  if (!ops::cpu_supports(k))
    throw Error(std::string("4-bit dequantization: this processor cannot run the ") + ops::to_string(k) + " kernels");
  if (k != ops::CpuKernels::kBest) return k;
  if (ops::cpu_supports(ops::CpuKernels::kAvx512)) return ops::CpuKernels::kAvx512;
  if (ops::cpu_supports(ops::CpuKernels::kAvx2)) return ops::CpuKernels::kAvx2;
  return ops::CpuKernels::kPortable;
}

}  // namespace

template <typename T>
Dequant4Fn<T> dequant4_kernel(ops::CpuKernels kernels) {
  switch (resolve(kernels)) {
#if MEMRT_QUANT_X86
    case ops::CpuKernels::kAvx512: return &avx512::pairs<T>;
    case ops::CpuKernels::kAvx2: return &avx2::pairs<T>;
#endif
    default: return &pairs_portable<T>;
  }
}

template Dequant4Fn<float> dequant4_kernel<float>(ops::CpuKernels);
template Dequant4Fn<c10::BFloat16> dequant4_kernel<c10::BFloat16>(ops::CpuKernels);
template Dequant4Fn<c10::Half> dequant4_kernel<c10::Half>(ops::CpuKernels);

}  // namespace memrt::quant
