// memrt/dense_weight.h — a projection's weight read without knowing how the projection stores it.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace memrt {

// A projection that keeps its weight in a format of its own (plugins/quant's 4-bit base) implements
// this beside torch::nn::Module, so a plugin wrapping it reads W without knowing the format (DoRA
// needs the norm of each row of W): `dynamic_cast<const memrt::DenseWeight*>(any_module.ptr().get())`.
// A projection whose "weight" is a floating (out, in) tensor needs nothing more.
class DenseWeight {
 public:
  virtual ~DenseWeight() = default;
  // Rows [r0, r1) of W (out, in) in `dtype`, the values the module's forward multiplies by; a fresh
  // tensor without gradient (a caller that wants all of W in bounded memory asks a few rows at a time).
  virtual at::Tensor dense_rows(int64_t r0, int64_t r1, at::ScalarType dtype) const = 0;
};

}  // namespace memrt
