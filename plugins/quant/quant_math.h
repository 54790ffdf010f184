// plugins/quant/quant_math.h — the per-element arithmetic of the quantized formats (docs/quant.md),
// shared by the CPU loops (blockwise.cpp) and CUDA kernels: one definition of each rounding, so the
// CPU tests against bitsandbytes vouch for the GPU path. Plain C++: no LibTorch (nvcc compiles it).
//
// Every fp32 operation here is written out as bitsandbytes performs it; the file that compiles
// these must not contract a multiply and an add into one fused operation (-ffp-contract=off on
// the host, the _rn intrinsics under nvcc), or a code near a rounding boundary would change.
#pragma once

#include <cstdint>

#include "memrt/host_device.h"

namespace memrt::quant {

// ---- 8-bit: bitsandbytes' quantization table -------------------------------------------------
// A value normalised to [-1, 1] maps to one of kTableSize grid points; the table (built once per
// map: QuantizeTable in blockwise.h) holds each point's code.
constexpr int kTableSize = 65536;

MEMRT_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MEMRT_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The grid point of `normalized` (x / absmax): clamped to [-1, 1], then
// trunc((v + 1) * 0.5 * 65535 + 0.5) in fp32. (A NaN, which bitsandbytes leaves undefined, takes
// point 0.)
MEMRT_HOST_DEVICE inline uint32_t table_index(float normalized) {
  float v = normalized >= -1.f ? normalized : -1.f;
  v = v > 1.f ? 1.f : v;
  const float t = mul_rn(add_rn(v, 1.f), 0.5f);
  return static_cast<uint32_t>(add_rn(mul_rn(t, static_cast<float>(kTableSize - 1)), 0.5f));
}

// The normalised value grid point i stands for: -1 + 2i / 65535 in fp32.
MEMRT_HOST_DEVICE inline float table_point(uint32_t i) {
  return add_rn(-1.f, (2.f * static_cast<float>(i)) / static_cast<float>(kTableSize - 1));
}

// ---- 4-bit: NF4 and FP4 ----------------------------------------------------------------------
enum class Map4 : uint8_t { kNf4, kFp4 };

// The 16 values of each 4-bit map, by code (QLoRA's NF4; bitsandbytes' FP4, whose codes are
// sign | 3 bits and so not in ascending order).
MEMRT_HOST_DEVICE inline float map4_value(Map4 type, uint32_t code) {
  constexpr float kNf4[16] = {-1.0f,
                              -0.6961928009986877f,
                              -0.5250730514526367f,
                              -0.39491748809814453f,
                              -0.28444138169288635f,
                              -0.18477343022823334f,
                              -0.09105003625154495f,
                              0.0f,
                              0.07958029955625534f,
                              0.16093020141124725f,
                              0.24611230194568634f,
                              0.33791524171829224f,
                              0.44070982933044434f,
                              0.5626170039176941f,
                              0.7229568362236023f,
                              1.0f};
  constexpr float kFp4[16] = {0.0f,  0.0052083334885537624f,  0.6666666865348816f,  1.0f,
                              0.3333333432674408f,  0.5f,  0.1666666716337204f,  0.25f,
                              0.0f, -0.0052083334885537624f, -0.6666666865348816f, -1.0f,
                              -0.3333333432674408f, -0.5f, -0.1666666716337204f, -0.25f};
  return type == Map4::kNf4 ? kNf4[code & 15u] : kFp4[code & 15u];
}

// What quantizing with a 4-bit map needs: its values in ascending order, the 15 midpoints between
// neighbours ((a + b) / 2 in fp32) and, for each ascending position, the code.
struct Map4Bounds {
  float midpoint[15];
  uint8_t code[16];
};

MEMRT_HOST_DEVICE inline Map4Bounds map4_bounds(Map4 type) {
  Map4Bounds b{};
  // Codes by ascending value: a stable insertion sort of 16 (FP4's +0 and -0 compare equal and
  // keep their code order, as torch.argsort of that map does).
  for (uint32_t c = 0; c < 16; ++c) {
    uint32_t at = c;
    while (at > 0 && map4_value(type, b.code[at - 1]) > map4_value(type, c)) {
      b.code[at] = b.code[at - 1];
      --at;
    }
    b.code[at] = static_cast<uint8_t>(c);
  }
  for (int i = 0; i < 15; ++i)
    b.midpoint[i] = mul_rn(add_rn(map4_value(type, b.code[i]), map4_value(type, b.code[i + 1])), 0.5f);
  return b;
}

// The code of a scaled value (clamped to [-1, 1] by the caller): its ascending position is the
// number of midpoints strictly below it (torch.bucketize: a value on a midpoint takes the lower).
MEMRT_HOST_DEVICE inline uint8_t map4_code(const Map4Bounds& b, float scaled) {
  uint32_t pos = 0;
  for (int i = 0; i < 15; ++i) pos += b.midpoint[i] < scaled ? 1u : 0u;
  return b.code[pos];
}

// Two codes per byte: element 2j in the high nibble, 2j + 1 in the low one.
MEMRT_HOST_DEVICE inline uint8_t pack4(uint8_t first, uint8_t second) {
  return static_cast<uint8_t>((first << 4) | (second & 15u));
}
MEMRT_HOST_DEVICE inline uint32_t unpack4(const uint8_t* packed, int64_t i) {
  const uint8_t byte = packed[i >> 1];
  return (i & 1) ? byte & 15u : byte >> 4;
}

}  // namespace memrt::quant
