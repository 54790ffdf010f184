#include "bucket_codes.h"

#include <algorithm>

namespace memrt::quant {

namespace {

constexpr uint32_t kOne = 0x3f80u;  // the top 16 bits of 1.0f

// The value of sign s, magnitude bucket m and key k (the low bits, in value order).
float bucket_value(bool negative, uint32_t m, uint32_t key) {
  const uint32_t low = negative ? key ^ 0xffffu : key;
  return from_bits((negative ? 0x80000000u : 0u) | (m << 16) | low);
}

}  // namespace

bool BucketCodes::build(const std::function<uint8_t(float)>& code_of) {
  entries.clear();
  const auto code = [&](float v) { return static_cast<uint32_t>(code_of(v > 1.f ? 1.f : v < -1.f ? -1.f : v)); };
  // The buckets nearest 0 with their sign's code of 0 share the first entry.
  const uint32_t zero[2] = {code(0.f), code(-0.f)};
  uint32_t first = kOne;
  for (int s = 0; s < 2; ++s) {
    const bool negative = s == 1;
    uint32_t m = 0;
    // The value farthest from 0 in bucket m: the largest key for a positive sign, the smallest for a negative.
    while (m < first && code(bucket_value(negative, m, negative ? 0u : 0xffffu)) == zero[s]) ++m;
    first = std::min(first, m);
  }
  base = first;
  half = 1 + (kOne - base + 1);
  std::vector<uint32_t> table(2 * static_cast<size_t>(half));
  for (int s = 0; s < 2; ++s) {
    const bool negative = s == 1;
    uint32_t* out = table.data() + (negative ? half : 0);
    out[0] = zero[s] | zero[s] << 8;
    for (uint32_t m = base; m <= kOne; ++m) {
      const uint32_t c0 = code(bucket_value(negative, m, 0)), c1 = code(bucket_value(negative, m, 0xffff));
      if (c1 < c0) return false;
      uint32_t split = 0;
      if (c1 != c0) {  // the smallest key of code c1, by bisection: code(lo) = c0, code(hi) = c1
        uint32_t lo = 0, hi = 0xffff;
        while (hi - lo > 1) {
          const uint32_t mid = lo + (hi - lo) / 2;
          const uint32_t c = code(bucket_value(negative, m, mid));
          if (c != c0 && c != c1) return false;  // a third code in the bucket
          (c == c1 ? hi : lo) = mid;
        }
        split = hi;
      }
      out[1 + m - base] = c0 | c1 << 8 | split << 16;
    }
  }
  // Non-decreasing across buckets, in value order: each bucket's first code at least the code
  // below it (the negative half runs from -0 outwards, the positive from +0).
  for (int s = 0; s < 2; ++s) {
    const bool negative = s == 1;
    uint32_t prev_far = zero[s];  // the code at the far end of the previous bucket from 0
    for (uint32_t m = base; m <= kOne; ++m) {
      const uint32_t near = code(bucket_value(negative, m, negative ? 0xffffu : 0u));
      if (negative ? near > prev_far : near < prev_far) return false;
      prev_far = code(bucket_value(negative, m, negative ? 0u : 0xffffu));
    }
  }
  if (zero[1] > zero[0]) return false;
  entries = std::move(table);
  return true;
}

}  // namespace memrt::quant
