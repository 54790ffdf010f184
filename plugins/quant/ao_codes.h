// plugins/quant/ao_codes.h — torchao's low-bit quantizer per map and instruction set:
// codes[i] = ao_code(map, size, x[i] / scale) (quant_math.h: the branch-free binary search over an
// ascending map, then nearest with ties up). The compiler leaves the search's map lookups to
// emulated gathers; hand-written:
//   16-entry maps (4 bits)   the map in registers: AVX-512 one permute per lookup, AVX2 two and a
//                            blend; the search's 4 steps and the rounding as the scalar rule does them
//   256-entry maps (8 bits)  the code is a non-decreasing function of y = x / scale clamped to
//                            [-1, 1] (the search gives a value outside, or a NaN, the code of -1
//                            or 1), so it is one lookup in a BucketCodes table (bucket_codes.h) by
//                            y's top 16 bits and one compare with the low ones — one gather into
//                            24 KiB instead of the search's ten. Built once per map; the search
//                            with hardware gathers where a bucket would span three codes.
// Compares are ordered (a NaN never moves up, as in the scalar rule). Every kernel gives the
// portable loop's codes (tests/plugins/test_quant_formats.cpp holds each to it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <memrt/ops.h>

namespace memrt::quant {

class AoQuantizer {
 public:
  // `map`: `size` ascending fp32 values, 16 or 256 (copied). Throws memrt::Error for kernels this
  // processor cannot run.
  AoQuantizer(const float* map, int size, ops::CpuKernels kernels = ops::CpuKernels::kBest);
  ~AoQuantizer();
  AoQuantizer(const AoQuantizer&) = delete;
  AoQuantizer& operator=(const AoQuantizer&) = delete;

  // codes[i] = ao_code(map, size, x[i] / scale) for i < len.
  void codes(const float* x, int64_t len, float scale, uint8_t* codes) const;
  // Whether the 256-entry map's table is in use (false for 16 entries, or when the check failed).
  bool uses_table() const;

  struct Prepared;  // the map, and the table where there is one (ao_codes.cpp)

 private:
  std::unique_ptr<Prepared> prepared_;
  void (*loop_)(const float* x, int64_t len, float scale, const Prepared& p, uint8_t* codes);
};

}  // namespace memrt::quant
