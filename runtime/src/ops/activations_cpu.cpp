// The CPU loops of activations_cpu.h. Built as optimizers_cpu.cpp is: -O3, -ffp-contract=off (no
// FMA contraction, so every SIMD variant computes the scalar function's bits) and GCC
// target_clones (the widest vectors the processor has, picked at load time).
#include "ops/activations_cpu.h"

#include <algorithm>
#include <cmath>

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

// One row's cross-entropy, in three passes: the maximum, the sum of e^(x - max), then the
// gradient in place. Sixteen running values per reduction, written out, so every clone sums in the
// same order and gives the portable loop's bits.
constexpr int64_t kLanes = 16;

MEMRT_SIMD_CLONES float row_max(const float* __restrict__ x, int64_t n) {
  float lane[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) lane[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  float m = -INFINITY;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (int64_t j = 0; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  return m;
}

MEMRT_SIMD_CLONES float row_sum_exp(const float* __restrict__ x, int64_t n, float shift) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += exp_clamped(x[i + j] - shift);
  float s = 0.0f;
  for (; i < n; ++i) s += exp_clamped(x[i] - shift);
  for (int64_t j = 0; j < kLanes; ++j) s += lane[j];
  return s;
}

MEMRT_SIMD_CLONES void row_softmax(float* __restrict__ x, int64_t n, float lse) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_clamped(x[i] - lse);
}

}  // namespace

void cross_entropy_rows_cpu(float* logits, const int64_t* targets, float* loss, int64_t rows, int64_t V,
                            int64_t ignore) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = logits + r * V;
      const int64_t t = targets[r];
      if (t == ignore) {
        std::fill(x, x + V, 0.0f);
        loss[r] = 0.0f;
        continue;
      }
      const float m = row_max(x, V);
      const float lse = m + std::log(row_sum_exp(x, V, m));
      loss[r] = lse - x[t];
      row_softmax(x, V, lse);
      x[t] -= 1.0f;
    }
  });
}

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
