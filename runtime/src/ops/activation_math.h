// Per-element activation math, shared by the CPU loops (activations_cpu.cpp) and any CUDA kernel:
// one definition of each function, written so a compiler vectorises it (no branches, no library
// calls) and every SIMD width computes the same bits (built without FMA contraction).
// Plain C++: no LibTorch here.
#pragma once

#include <cstdint>
#include <cstring>

#include "memrt/host_device.h"

namespace memrt {

// e^x in float, within 2 ulp of the exact value on [-87.3, 88] (Cody-Waite reduction by ln 2 in
// two parts, Cephes' degree-6 polynomial on |r| <= ln 2 / 2). Arguments are clamped to that range
// (e^x underflows to 2^-126 at the bottom, stays finite at the top); NaN stays NaN.
MEMRT_HOST_DEVICE inline float exp_clamped(float x) {
  x = x < -87.3365448f ? -87.3365448f : x;  // comparisons, not fminf: a NaN argument propagates
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln 2): adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits.
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln 2's leading bits: n * this is exact
  r = r - n * -2.12194440e-4f;     // the rest of ln 2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// GPT-2's GELU, the tanh approximation (HF "gelu_new", torch approximate="tanh"):
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
// computed as x * sigmoid(2u) = x / (1 + e^(-2u)), the same function without 1 + tanh's
// cancellation for negative x. With z = 2u = x (a + b x^2):
//   gelu'(x) = s + x s (1 - s) z'(x) = s (1 + x e s (a + 3 b x^2)),  s = 1 / (1 + e), e = e^(-z)
// (1 - s = e s). Where e^(-z) leaves float's range (z < -88, x below about -10) gelu(x), under
// 1e-37 in size, is returned as a signed zero. Beyond |x| = 20 the derivative is 0 or 1 to float
// precision and is taken at +-20, so a huge |x| cannot turn the vanishing term into inf * 0.
struct GeluTanh {
  static constexpr float a = 1.59576912f;    // 2 sqrt(2/pi)
  static constexpr float b = 0.0713548162f;  // 2 sqrt(2/pi) 0.044715

  MEMRT_HOST_DEVICE static float forward(float x) {
    const float z = x * (a + b * (x * x));
    const float y = x / (1.0f + exp_clamped(-z));
    return z < -88.0f ? 0.0f * x : y;  // e^(-z) past float's range: |y| < 1e-37, a signed zero
  }

  MEMRT_HOST_DEVICE static float backward(float x, float dy) {
    x = x < -20.0f ? -20.0f : x;
    x = x > 20.0f ? 20.0f : x;
    const float x2 = x * x;
    const float e = exp_clamped(-(x * (a + b * x2)));
    const float s = 1.0f / (1.0f + e);
    return dy * (s * (1.0f + x * (e * s) * (a + 3.0f * b * x2)));
  }
};

}  // namespace memrt
