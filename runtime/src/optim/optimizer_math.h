// Per-element optimizer math, shared by the CPU loops (optimizers_cpu.cpp) and the CUDA kernels
// (optimizers_cuda.cu): one definition of each update, so the CPU tests vouch for the GPU path.
// Plain C++: no LibTorch here (nvcc compiles this header).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "memrt/host_device.h"

namespace memrt {

// Scalars of one Adam update of one tensor, computed on the host in double and rounded once.
struct AdamScalars {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float l2 = 0.f;            // classic Adam: weight_decay added to the gradient (g += l2 * p)
  float decay = 0.f;         // AdamW: lr * weight_decay, applied to p before the update
  float step_size = 0.f;     // lr / (1 - beta1^t), or lr without bias correction
  float bc2_rsqrt = 1.f;     // 1 / sqrt(1 - beta2^t), or 1 without bias correction
};

// The scalars of update `step` (1-based), as DeepSpeed's CPU Adam computes them: weight decay only
// when positive (`if (_weight_decay > 0)`), on the gradient (L2) or decoupled (AdamW).
inline AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                bool decoupled, bool bias_correction, int64_t step) {
  AdamScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  const double wd = weight_decay > 0 ? weight_decay : 0.0;
  s.l2 = decoupled ? 0.f : static_cast<float>(wd);
  s.decay = decoupled ? static_cast<float>(lr * wd) : 0.f;
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  s.step_size = static_cast<float>(lr / bc1);
  s.bc2_rsqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return s;
}

// DeepSpeed's CPU Adam per element (csrc/adam/cpu_adam_impl.cpp, Adam_Optimizer::Step_1):
//   g += wd*p (Adam only); m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
//   denom = sqrt(v) * bc2_rsqrt + eps  (eps after bias correction);
//   p -= lr*wd*p (AdamW only, before the update); p -= step_size * m / denom.
MEMRT_HOST_DEVICE inline void adam_update(float& p, float g, float& m, float& v,
                                          const AdamScalars& s) {
  g = g + s.l2 * p;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * (g * g);
  float denom = sqrtf(v) * s.bc2_rsqrt + s.eps;
  p = p - s.decay * p;
  p = p - s.step_size * (m / denom);
}

// fp16 bits to fp32, exactly (a NaN keeps its payload and comes out quiet, as from c10::Half's
// conversion), without branches.
MEMRT_HOST_DEVICE inline float float_from_fp16_bits(uint16_t bits) {
  const uint32_t h = bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Normal: the exponent re-biased (15 -> 127); infinity and NaN once more, to exponent 255.
  const uint32_t is_inf_nan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(em > 0x7c00u);
  const uint32_t normal =
      ((em << 13) + 0x38000000u + (0x38000000u & is_inf_nan)) | (0x00400000u & is_nan);
  // Subnormal (and zero): em units of 2^-24, exact in fp32.
  const float sub_f = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;
  uint32_t subnormal = 0;
  std::memcpy(&subnormal, &sub_f, sizeof subnormal);
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(em < 0x400u);
  const uint32_t x = sign | (subnormal & is_subnormal) | (normal & ~is_subnormal);
  float f = 0.f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// fp32 to fp16 bits, rounded to nearest-even as an IEEE conversion does (a NaN becomes sign |
// 0x7e00, as c10::Half makes it). Written without branches, so that a loop of it vectorises:
// c10::Half's own conversion keeps the fused step's fp16 loops scalar.
MEMRT_HOST_DEVICE inline uint16_t fp16_bits_from_float(float f) {
  uint32_t x = 0;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // Normal halves: the exponent re-biased (127 -> 15), the 13 dropped bits rounded to nearest-even
  // (a carry into the exponent is the right result, up to infinity).
  const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14 (subnormal halves): adding 0.5f rounds |f| to a multiple of 2^-24, the subnormal
  // spacing, in fp32 arithmetic; what remains above 0.5f's bits is the half's bits.
  float abs_f = 0.f;
  std::memcpy(&abs_f, &a, sizeof a);
  const float shifted = abs_f + 0.5f;
  uint32_t subnormal = 0;
  std::memcpy(&subnormal, &shifted, sizeof subnormal);
  subnormal -= 0x3f000000u;
  // The cases by masks rather than branches (GCC leaves a loop with selects here scalar).
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < 0x38800000u);
  const uint32_t is_inf = 0u - static_cast<uint32_t>(a >= 0x47800000u);  // 65536 and above
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > 0x7f800000u);
  uint32_t h = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  h = (0x7c00u & is_inf) | (h & ~is_inf);
  h = (0x7e00u & is_nan) | (h & ~is_nan);
  return static_cast<uint16_t>(sign | h);
}

// bf16 bits to fp32 (exact) and fp32 to bf16 bits rounded to nearest-even, a NaN becoming the
// quiet 0x7fc0: the conversions of c10::BFloat16, written for nvcc too.
MEMRT_HOST_DEVICE inline float float_from_bf16_bits(uint16_t bits) {
  const uint32_t x = static_cast<uint32_t>(bits) << 16;
  float f = 0.f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

MEMRT_HOST_DEVICE inline uint16_t bf16_bits_from_float(float f) {
  if (f != f) return 0x7fc0u;
  uint32_t x = 0;
  std::memcpy(&x, &f, sizeof x);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// 16 random bits for element `i` of one step's stochastic rounding: a counter-based hash
// (SplitMix64's finaliser) of the seed and the element's index, so the draws do not depend on the
// number of threads or on how the range is split, and a resumed run draws what the straight one did.
MEMRT_HOST_DEVICE inline uint32_t random_bits16(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z = z ^ (z >> 31);
  return static_cast<uint32_t>(z >> 48);
}

// fp32 to bf16 bits rounded stochastically, as torchao's bf16_stochastic_round: truncated towards
// zero, then one bf16 ulp further from zero when the 16 random bits are below the 16 bits dropped
// (so with probability dropped / 2^16: the expected value is x). Infinities stay; a NaN becomes the
// quiet 0x7fc0 (truncating its payload could make it an infinity).
MEMRT_HOST_DEVICE inline uint16_t bf16_bits_stochastic(float f, uint32_t random16) {
  if (f != f) return 0x7fc0u;
  uint32_t x = 0;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7f800000u) == 0x7f800000u) return static_cast<uint16_t>(x >> 16);
  const uint32_t up = random16 < (x & 0xffffu) ? 0x10000u : 0u;
  return static_cast<uint16_t>(((x & 0xffff0000u) + up) >> 16);
}

struct SgdScalars {
  float lr = 0.f, momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false;
  bool first_step = true;  // the momentum buffer starts as the gradient itself (torch.optim.SGD)
};

// torch.optim.SGD per element (_single_tensor_sgd): g += wd*p; buf = g on the first step, else
// buf = momentum*buf + (1-dampening)*g; g = nesterov ? g + momentum*buf : buf; p -= lr*g.
// `buf` is untouched when momentum is 0.
MEMRT_HOST_DEVICE inline void sgd_update(float& p, float g, float& buf, const SgdScalars& s) {
  g = g + s.weight_decay * p;
  if (s.momentum != 0.f) {
    buf = s.first_step ? g : s.momentum * buf + (1.f - s.dampening) * g;
    g = s.nesterov ? g + s.momentum * buf : buf;
  }
  p = p - s.lr * g;
}

// The loops over n contiguous fp32 elements. CPU: at::parallel_for over chunks, each a
// vectorisable loop. CUDA (only in builds with MEMRT_BUILD_CUDA): one thread per element on the
// given stream (cudaStream_t passed as void*).
void sgd_update_cpu(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s);
void sgd_update_cuda(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s,
                     void* stream);

}  // namespace memrt
