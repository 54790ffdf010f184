// Per-element optimizer math, shared by the CPU loops (optimizers_cpu.cpp) and the CUDA kernels
// (optimizers_cuda.cu): one definition of each update, so the CPU tests vouch for the GPU path.
// Plain C++: no LibTorch here (nvcc compiles this header).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MEMRT_HOST_DEVICE __host__ __device__
#else
#define MEMRT_HOST_DEVICE
#endif

namespace memrt {

// Scalars of one Adam update of one tensor, computed on the host in double and rounded once.
struct AdamScalars {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float l2 = 0.f;            // classic Adam: weight_decay added to the gradient (g += l2 * p)
  float decay = 0.f;         // AdamW: lr * weight_decay, applied to p before the update
  float step_size = 0.f;     // lr / (1 - beta1^t), or lr without bias correction
  float bc2_rsqrt = 1.f;     // 1 / sqrt(1 - beta2^t), or 1 without bias correction
};

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
void adam_update_cpu(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s);
void sgd_update_cpu(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s);
void adam_update_cuda(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s,
                      void* stream);
void sgd_update_cuda(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s,
                     void* stream);

}  // namespace memrt
