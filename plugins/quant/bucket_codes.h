// plugins/quant/bucket_codes.h — torchao's 8-bit quantizer as one table lookup per value.
//
// torchao's rounding to an ascending 256-entry map (quant_math.h: ao_code) is a non-decreasing
// function code(y) of the normalised value y, clamped to [-1, 1] first (the rule gives a value
// outside the code of -1 or 1, and a NaN the code of -1: the vector loops clamp with max/min).
// Tabulated by y's top 16 bits (sign, exponent, 7 mantissa bits) — a bucket — each entry holds the
// two codes the bucket can have and the point between them:
//
//   entry = lo | hi << 8 | split << 16     key = y's low 16 bits, flipped for a negative y (so
//   code(y) = key >= split ? hi : lo             that it grows with the value)
//
// (lo = hi, split 0, where the bucket has one code.) Buckets of magnitude below `base` all have
// one code per sign (|y| under the map's smallest rounding boundary) and share one entry, index 0
// of their sign's half; bucket base + i is entry i + 1; the negative half follows the positive.
// For torchao's maps that is 22,392 and 23,200 bytes, so the one gather a value costs stays in L1
// (a table by all 65536 buckets would be 64 KiB or more). A map where a bucket holds three codes
// or more has no table (build() returns false). bitsandbytes' quantizer keeps its grid table
// (table_codes.h): built from its rule, this table measured no faster than that one's gather.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "quant_math.h"
#include "x86_simd.h"

namespace memrt::quant {

struct BucketCodes {
  uint32_t base = 0;  // the smallest tabulated magnitude bucket (top 16 bits of |y|)
  uint32_t half = 0;  // entries per sign: the shared one, then buckets base .. 0x3f80 (1.0)
  std::vector<uint32_t> entries;

  // Tabulates `code`, which must be non-decreasing on [-1, 1] (checked at every bucket's ends).
  // False, the table left empty, where a bucket holds three codes or more.
  bool build(const std::function<uint8_t(float)>& code);
  bool empty() const { return entries.empty(); }
};

#if MEMRT_QUANT_X86
// The codes of 16 and of 8 lanes of a y already clamped to [-1, 1].
__attribute__((target("avx512f"))) inline __m512i bucket_codes16(__m512 y, const BucketCodes& t) {
  const __m512i bits = _mm512_castps_si512(y), low = _mm512_set1_epi32(0xffff);
  const __mmask16 negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
  const __m512i magnitude = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x7fff));
  __m512i index = _mm512_max_epi32(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(static_cast<int>(t.base) - 1)),
                                   _mm512_setzero_si512());
  index = _mm512_mask_add_epi32(index, negative, index, _mm512_set1_epi32(static_cast<int>(t.half)));
  const __m512i e = _mm512_i32gather_epi32(index, t.entries.data(), 4);
  const __m512i key = _mm512_mask_xor_epi32(_mm512_and_si512(bits, low), negative, _mm512_and_si512(bits, low), low);
  const __mmask16 up = _mm512_cmpge_epi32_mask(key, _mm512_srli_epi32(e, 16));
  const __m512i byte = _mm512_set1_epi32(0xff);
  return _mm512_mask_and_epi32(_mm512_and_si512(e, byte), up, _mm512_srli_epi32(e, 8), byte);
}

__attribute__((target("avx2"))) inline __m256i bucket_codes8(__m256 y, const BucketCodes& t) {
  const __m256i bits = _mm256_castps_si256(y), low = _mm256_set1_epi32(0xffff);
  const __m256i negative = _mm256_srai_epi32(bits, 31);  // all ones where the sign is set
  const __m256i magnitude = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x7fff));
  __m256i index = _mm256_max_epi32(_mm256_sub_epi32(magnitude, _mm256_set1_epi32(static_cast<int>(t.base) - 1)),
                                   _mm256_setzero_si256());
  index = _mm256_add_epi32(index, _mm256_and_si256(negative, _mm256_set1_epi32(static_cast<int>(t.half))));
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.entries.data()), index, 4);
  const __m256i key = _mm256_xor_si256(_mm256_and_si256(bits, low), _mm256_and_si256(negative, low));
  // key >= split as NOT (split > key); both below 2^16, so the signed compare is exact.
  const __m256i below = _mm256_cmpgt_epi32(_mm256_srli_epi32(e, 16), key);
  const __m256i byte = _mm256_set1_epi32(0xff);
  return _mm256_blendv_epi8(_mm256_and_si256(_mm256_srli_epi32(e, 8), byte), _mm256_and_si256(e, byte), below);
}
#endif

}  // namespace memrt::quant
