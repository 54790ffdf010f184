// plugins/quant/dequant4.h — the 4-bit dequantization's inner loop, per instruction set: `pairs`
// bytes of packed codes (two a byte, the high nibble first) into 2 * pairs values
// map16[code] * scale (fp32, rounded to the output's dtype to nearest-even). Every kernel gives the
// portable loop's bits (tests/plugins/test_quant_linear4bit.cpp holds each to it): the 16-entry map
// sits in registers (AVX-512: one permute; AVX2: two and a blend), the product is one IEEE
// multiply, bf16 rounds on the bits as c10::BFloat16 does and fp16 with the F16C conversion.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <memrt/ops.h>

namespace memrt::quant {

// out[2j], out[2j + 1] = map16[p[j] >> 4] * scale, map16[p[j] & 15] * scale for j < pairs.
template <typename T>
using Dequant4Fn = void (*)(const uint8_t* packed, int64_t pairs, const float* map16, float scale, T* out);

// The kernel of `kernels` (memrt/ops.h; kBest: the widest this processor runs) for T = float,
// c10::BFloat16, c10::Half; throws memrt::Error for kernels this processor cannot run.
template <typename T>
Dequant4Fn<T> dequant4_kernel(ops::CpuKernels kernels);

}  // namespace memrt::quant
