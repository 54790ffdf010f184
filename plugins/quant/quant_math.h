// plugins/quant/quant_math.h — the per-element arithmetic of the quantized formats (docs/quant.md),
// shared by the CPU loops (blockwise.cpp) and CUDA kernels: one definition of each rounding, so the
// CPU tests against bitsandbytes vouch for the GPU path. Plain C++: no LibTorch (nvcc compiles it).
//
// Every fp32 operation here is written out as bitsandbytes performs it; the file that compiles
// these must not contract a multiply and an add into one fused operation (-ffp-contract=off on
// the host, the _rn intrinsics under nvcc), or a code near a rounding boundary would change.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

// A block's scale under double quantization: the signed dynamic map's value of its 8-bit code times
// its group's nested absmax, plus the offset (bitsandbytes' dequantize_blockwise(...) + offset: two
// fp32 roundings).
MEMRT_HOST_DEVICE inline float nested_scale(const float* map256, uint8_t code, float nested_absmax, float offset) {
  return add_rn(mul_rn(map256[code], nested_absmax), offset);
}

// ---- bitsandbytes' Adam/AdamW (8-bit blockwise and 32-bit), as its CPU backend computes them ----
constexpr int64_t kBnbBlock = 256;  // bitsandbytes' optimizer block

// Scalars of one update, computed in double from the hyper-parameters and rounded to fp32 once, as
// torch does with the Python floats bitsandbytes passes to its tensor operations.
struct BnbAdamScalars {
  float beta1 = 0.9f, beta2 = 0.999f;
  float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  float eps = 1e-8f;          // 8-bit: added after dividing by correction2
  float correction2 = 1.f;    // sqrt(1 - beta2^t)
  float step_size = 0.f;      // 8-bit: -lr / (1 - beta1^t)
  float eps_c2 = 1e-8f;       // 32-bit: eps * correction2
  float step_size32 = 0.f;    // 32-bit: -lr * correction2 / (1 - beta1^t)
  float decay = 1.f;          // 1 - lr * weight_decay, applied when decays
  bool decays = false;        // weight_decay > 0
};

// The moments of one element. torch's fused kernels: m.mul_(b1).add_(g, alpha=1-b1) is one fused
// multiply-add onto m*b1; v.mul_(b2).addcmul_(g, g, value=1-b2) one onto v*b2 of g times (1-b2)*g.
MEMRT_HOST_DEVICE inline void bnb_adam_moments(float g, float& m, float& v, const BnbAdamScalars& s) {
  m = fmaf(g, s.one_minus_beta1, mul_rn(m, s.beta1));
  v = fmaf(g, mul_rn(s.one_minus_beta2, g), mul_rn(v, s.beta2));
}

// The 8-bit update of p: denom = sqrt(v) / correction2 + eps; p *= 1 - lr*wd; p += (step_size * m) / denom.
MEMRT_HOST_DEVICE inline float bnb_adam8_param(float p, float m, float v, const BnbAdamScalars& s) {
  const float denom = add_rn(sqrtf(v) / s.correction2, s.eps);
  if (s.decays) p = mul_rn(p, s.decay);
  return add_rn(p, mul_rn(s.step_size, m) / denom);
}

// The 32-bit update (tensors under min_8bit_size): update = m / (sqrt(v) + eps * correction2);
// p *= 1 - lr*wd; p += step_size32 * update (torch's add_ with alpha: one fused multiply-add).
MEMRT_HOST_DEVICE inline float bnb_adam32_param(float p, float m, float v, const BnbAdamScalars& s) {
  const float update = m / add_rn(sqrtf(v), s.eps_c2);
  if (s.decays) p = mul_rn(p, s.decay);
  return fmaf(update, s.step_size32, p);
}

// ---- torchao's low-bit AdamW (AdamW8bit, AdamW4bit), as its single_param_adam computes it -------
// torchao's rounding to a code of an ascending map of `size` entries (a power of 2): the largest
// code whose value is <= x (code 0 below the map) by its branch-free binary search, then one up
// when x - map[c] >= (map[c+1] - map[c]) * 0.5: nearest, ties up.
// The rounding step alone: whether x, at or above map value lo, goes up to the next value hi.
MEMRT_HOST_DEVICE inline bool ao_rounds_up(float x, float lo, float hi) {
  return add_rn(x, -lo) >= mul_rn(add_rn(hi, -lo), 0.5f);
}

MEMRT_HOST_DEVICE inline uint8_t ao_code(const float* map, int size, float x) {
  int c = 0;
  for (int step = size / 2; step >= 1; step /= 2) c += x >= map[c + step] ? step : 0;
  const int up = c + 1 < size ? c + 1 : size - 1;
  return static_cast<uint8_t>(ao_rounds_up(x, map[c], map[up]) ? up : c);
}

// |x|'s bits: for numbers they order as the values do, so the largest gives a block's absmax with
// an integer max (which vectorises, where a float max would not without fast-math).
MEMRT_HOST_DEVICE inline uint32_t abs_bits(float x) {
  uint32_t b = 0;
  memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}
MEMRT_HOST_DEVICE inline float from_bits(uint32_t b) {
  float x = 0.f;
  memcpy(&x, &b, sizeof x);
  return x;
}

// torch.lerp(start, end, weight) for a scalar weight, as ATen computes it.
MEMRT_HOST_DEVICE inline float torch_lerp(float start, float end, float weight) {
  const float diff = add_rn(end, -start);
  return (weight < 0.5f && weight > -0.5f) ? add_rn(start, mul_rn(weight, diff))
                                           : add_rn(end, -mul_rn(diff, add_rn(1.f, -weight)));
}

// Scalars of one update, rounded to fp32 as torchao's tensors hold them: lr is an fp32 tensor,
// the step an fp32 count, beta^step computed from fp32 beta in double and rounded once.
struct AoAdamScalars {
  float lr = 0.f;
  float lr_wd = 0.f;         // AdamW: lr * weight_decay (fp32 product)
  float l2 = 0.f;            // Adam: weight_decay, added to the gradient times p
  float weight1 = 0.1f;      // 1 - beta1, lerp's weight
  float weight2 = 0.001f;    // 1 - beta2
  float bc1 = 1.f;           // 1 - beta1^t
  float sqrt_bc2 = 1.f;      // sqrt(1 - beta2^t)
  float eps = 1e-8f;
  bool decoupled = true;
};

// The update of one element before its moments are stored: p decays (AdamW) or the gradient takes
// the L2 term (Adam); m and v move towards g and g^2 (lerp).
MEMRT_HOST_DEVICE inline void ao_adam_moments(float& p, float g, float& m, float& v, const AoAdamScalars& s) {
  if (s.decoupled) {
    p = add_rn(p, -mul_rn(s.lr_wd, p));
  } else {
    g = add_rn(g, mul_rn(s.l2, p));
  }
  m = torch_lerp(m, g, s.weight1);
  v = torch_lerp(v, mul_rn(g, g), s.weight2);
}

// p - lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), from the moments before they are quantized.
MEMRT_HOST_DEVICE inline float ao_adam_param(float p, float m, float v, const AoAdamScalars& s) {
  const float denom = add_rn(sqrtf(v) / s.sqrt_bc2, s.eps);
  return add_rn(p, -(mul_rn(s.lr, m / s.bc1) / denom));
}

}  // namespace memrt::quant
