// plugins/quant/x86_simd.h — what the hand-written loops (table_codes.cpp, ao_codes.cpp, dequant4.cpp)
// share: whether they are compiled (GCC on x86-64: MEMRT_QUANT_X86) and the AVX2 byte store.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEMRT_QUANT_X86 1
#include <immintrin.h>

namespace memrt::quant {

// Byte 0 of each of 8 32-bit lanes (codes below 256) to 8 bytes at `out`.
__attribute__((target("avx2"))) inline void store_low_bytes8(__m256i lanes, uint8_t* out) {
  const __m256i first_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(lanes, first_bytes);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                   _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
}

}  // namespace memrt::quant
#endif
