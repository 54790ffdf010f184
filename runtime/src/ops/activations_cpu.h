// The CPU loops of the models' element-wise activations (activations_cpu.cpp): contiguous float
// arrays, split over ATen's threads, each chunk compiled for AVX-512, AVX2 and baseline x86-64.
#pragma once

#include <cstdint>

namespace memrt::ops {

// y[i] = GeluTanh::forward(x[i])  (activation_math.h)
void gelu_tanh_forward_cpu(const float* x, float* y, int64_t n);
// dx[i] = GeluTanh::backward(x[i], dy[i])
void gelu_tanh_backward_cpu(const float* x, const float* dy, float* dx, int64_t n);

// The cross-entropy of each row of `logits` (rows, V), contiguous: loss[r] = logsumexp(row) -
// row[targets[r]], and the row replaced by its gradient, softmax(row) - onehot(targets[r]). A row
// whose target is `ignore` gets loss 0 and a zero gradient. Targets are in [0, V) or `ignore`
// (the caller checks). Rows are split over ATen's threads.
void cross_entropy_rows_cpu(float* logits, const int64_t* targets, float* loss, int64_t rows, int64_t V,
                            int64_t ignore);

}  // namespace memrt::ops
