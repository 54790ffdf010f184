// The CPU loops of the models' element-wise activations (activations_cpu.cpp): contiguous float
// arrays, split over ATen's threads, each chunk compiled for AVX-512, AVX2 and baseline x86-64.
#pragma once

#include <cstdint>

namespace memrt::ops {

// y[i] = GeluTanh::forward(x[i])  (activation_math.h)
void gelu_tanh_forward_cpu(const float* x, float* y, int64_t n);
// dx[i] = GeluTanh::backward(x[i], dy[i])
void gelu_tanh_backward_cpu(const float* x, const float* dy, float* dx, int64_t n);

}  // namespace memrt::ops
