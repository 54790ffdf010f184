// The CUDA kernels of the optimizers: one thread per element, the math of optimizer_math.h (the
// fused Adam step of fused_adam.h and SGD).
// Built only when MEMRT_BUILD_CUDA is ON; nothing on the development machines runs it.
#include <cuda_runtime.h>

#include <string>

#include "memrt/error.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"

namespace memrt {

namespace {

constexpr int kThreads = 256;

// Storage of a fused-step buffer: fp32 as is, 16-bit types as their bits.
struct F32 {
  using T = float;
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  __device__ static float load(uint16_t x) { return float_from_bf16_bits(x); }
  __device__ static uint16_t store(float x) { return bf16_bits_from_float(x); }
};
struct FP16 {
  using T = uint16_t;
  __device__ static float load(uint16_t x) { return float_from_fp16_bits(x); }
  __device__ static uint16_t store(float x) { return fp16_bits_from_float(x); }
};

// The CPU's fused_adam_element (optimizers_cpu.cpp), element for element.
template <class C, class G, bool kMaster>
__global__ void fused_adam_kernel(float* __restrict__ master, typename C::T* __restrict__ compute,
                                  const typename G::T* __restrict__ grad, float* __restrict__ m,
                                  float* __restrict__ v, int64_t n, AdamScalars s, float factor) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    float p = kMaster ? master[i] : C::load(compute[i]);
    adam_update(p, G::load(grad[i]) * factor, m[i], v[i], s);
    if (kMaster) master[i] = p;
    compute[i] = C::store(p);
  }
}

__global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                           float* __restrict__ buf, int64_t n, SgdScalars s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    float unused = 0.f;
    sgd_update(p[i], g[i], buf ? buf[i] : unused, s);
  }
}

unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b > 0 ? b : 1) : 65535);  // grid-stride beyond
}

void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(std::string(what) + ": CUDA kernel launch failed: " + cudaGetErrorString(err));
}

}  // namespace

void fused_adam_cuda(const AdamRange& r, const AdamScalars& s, float factor, void* stream) {
  if (r.n == 0) return;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool master = r.master != nullptr;
  const at::ScalarType c = r.compute_type, g = r.grad_type;
  if (r.state_type != at::kFloat || r.stochastic_round)
    throw Error("fused Adam step (CUDA): bf16 optimizer state and stochastic rounding run on the CPU "
                "step only so far (offload_optimizer puts the step there)");
  auto launch = [&](auto kernel, auto* compute, const auto* grad) {
    kernel<<<blocks_for(r.n), kThreads, 0, st>>>(r.master, compute, grad, static_cast<float*>(r.exp_avg),
                                                 static_cast<float*>(r.exp_avg_sq), r.n, s, factor);
  };
  using U16 = uint16_t;
  if (!master && c == at::kFloat && g == at::kFloat) {
    launch(fused_adam_kernel<F32, F32, false>, static_cast<float*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kBFloat16) {
    launch(fused_adam_kernel<BF16, BF16, true>, static_cast<U16*>(r.compute), static_cast<const U16*>(r.grad));
  } else if (master && c == at::kBFloat16 && g == at::kFloat) {
    launch(fused_adam_kernel<BF16, F32, true>, static_cast<U16*>(r.compute), static_cast<const float*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kHalf) {
    launch(fused_adam_kernel<FP16, FP16, true>, static_cast<U16*>(r.compute), static_cast<const U16*>(r.grad));
  } else if (master && c == at::kHalf && g == at::kFloat) {
    launch(fused_adam_kernel<FP16, F32, true>, static_cast<U16*>(r.compute), static_cast<const float*>(r.grad));
  } else {
    throw Error("fused Adam step (CUDA): no kernel for this combination of compute and gradient "
                "dtypes (the CPU step's combinations: fused_adam.h)");
  }
  check_launch("fused Adam step");
}

void sgd_update_cuda(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s,
                     void* stream) {
  if (n == 0) return;
  sgd_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, g, buf, n, s);
  check_launch("SGD step");
}

}  // namespace memrt
