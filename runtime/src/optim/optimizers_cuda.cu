// The CUDA kernels of the optimizers: one thread per element, the math of optimizer_math.h.
// Built only when MEMRT_BUILD_CUDA is ON; nothing on the development machines runs it.
#include <cuda_runtime.h>

#include <string>

#include "memrt/error.h"
#include "optim/optimizer_math.h"

namespace memrt {

namespace {

constexpr int kThreads = 256;

__global__ void adam_kernel(float* __restrict__ p, const float* __restrict__ g,
                            float* __restrict__ m, float* __restrict__ v, int64_t n,
                            AdamScalars s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x)
    adam_update(p[i], g[i], m[i], v[i], s);
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

void adam_update_cuda(float* p, const float* g, float* m, float* v, int64_t n, const AdamScalars& s,
                      void* stream) {
  if (n == 0) return;
  adam_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, g, m, v, n, s);
  check_launch("Adam step");
}

void sgd_update_cuda(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s,
                     void* stream) {
  if (n == 0) return;
  sgd_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, g, buf, n, s);
  check_launch("SGD step");
}

}  // namespace memrt
