// The buffers of one fused Adam step on n elements, shared by the CPU kernel tests
// (test_fused_adam.cpp) and the CUDA ones (tests/cuda): an fp32 master where the compute dtype is
// 16-bit, a gradient as if scaled by a loss scale, zero moments.
#pragma once

#include <ATen/ATen.h>

#include "optim/fused_adam.h"

namespace memrt::test {

struct Buffers {
  at::Tensor master, compute, grad, m, v;  // master undefined without one
  AdamRange range() { return adam_range(master, compute, grad, m, v); }
  // The same values on `device`.
  Buffers to(at::Device device) const {
    return {master.defined() ? master.to(device) : master, compute.to(device), grad.to(device), m.to(device),
            v.to(device)};
  }
};

inline Buffers make_buffers(at::ScalarType compute, at::ScalarType grad, int64_t n) {
  Buffers b;
  const at::Tensor p = at::randn({n});
  if (compute != at::kFloat) b.master = p.clone();
  b.compute = p.to(compute);
  b.grad = (at::randn({n}) * 100).to(grad);
  b.m = at::zeros({n});
  b.v = at::zeros({n});
  return b;
}

}  // namespace memrt::test
