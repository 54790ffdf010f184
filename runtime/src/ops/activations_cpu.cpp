// The CPU loops of activations_cpu.h. Built as optimizers_cpu.cpp is: -O3, -ffp-contract=off (no
// FMA contraction, so every SIMD variant computes the scalar function's bits) and GCC
// target_clones (the widest vectors the processor has, picked at load time).
#include "ops/activations_cpu.h"

#include <ATen/Parallel.h>

#include "ops/activation_math.h"
#include "optim/cpu_loops.h"

namespace memrt::ops {
namespace {

MEMRT_SIMD_CLONES void gelu_tanh_forward_chunk(const float* __restrict__ x, float* __restrict__ y,
                                               int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = GeluTanh::forward(x[i]);
}

MEMRT_SIMD_CLONES void gelu_tanh_backward_chunk(const float* __restrict__ x,
                                                const float* __restrict__ dy,
                                                float* __restrict__ dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = GeluTanh::backward(x[i], dy[i]);
}

}  // namespace

void gelu_tanh_forward_cpu(const float* x, float* y, int64_t n) {
  at::parallel_for(0, n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
    gelu_tanh_forward_chunk(x + begin, y + begin, end - begin);
  });
}

void gelu_tanh_backward_cpu(const float* x, const float* dy, float* dx, int64_t n) {
  at::parallel_for(0, n, kCpuLoopGrain, [&](int64_t begin, int64_t end) {
    gelu_tanh_backward_chunk(x + begin, dy + begin, dx + begin, end - begin);
  });
}

}  // namespace memrt::ops
