// plugins/quant/table_codes.h — the 8-bit maps' inner loops per instruction set. Quantizing (bitsandbytes'):
// codes[i] = table[table_index(x[i] * inv)] (quant_math.h's grid point, a QuantizeTable's code).
// The compiler leaves this loop scalar (the clamps are branches without fast-math, and there is no
// byte gather): hand-written, AVX-512 takes 16 values a step and AVX2 8 — max/min for the clamps
// (they give the scalar rule's results, a NaN included), the grid point in the scalar code's fp32
// operations, and a 32-bit gather into the table (QuantizeTable pads it by 3 bytes). Every kernel
// gives the portable loop's codes (tests/plugins/test_quant_formats.cpp holds each to it).
// Dequantizing (any 256-entry map): out[i] = map[codes[i]] * scale in fp32, which GCC compiles to
// one scalar load per value; hand-written, the codes are widened and the values gathered, 16
// (AVX-512) or 8 (AVX2) a step — the same loads and product, so the same bits.
#pragma once

#include <cstdint>

#include <memrt/ops.h>

namespace memrt::quant {

using TableCodesFn = void (*)(const float* x, int64_t len, float inv, const uint8_t* table, uint8_t* codes);
using TableValuesFn = void (*)(const uint8_t* codes, int64_t len, const float* map256, float scale, float* out);

// The loop of `kernels` (kBest: the widest this processor runs); throws memrt::Error for kernels
// this processor cannot run.
TableCodesFn table_codes_kernel(ops::CpuKernels kernels = ops::CpuKernels::kBest);
TableValuesFn table_values_kernel(ops::CpuKernels kernels = ops::CpuKernels::kBest);

}  // namespace memrt::quant
