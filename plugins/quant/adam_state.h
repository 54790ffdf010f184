// plugins/quant/adam_state.h — what the low-bit Adam kernels share: the store layout of a library's
// rule "small tensors keep 32-bit state" and a range's fp32 view (docs/quant.md, "The step").
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/ATen.h>

#include <memrt/optimizer.h>
#include <memrt/param_store.h>

namespace memrt::quant {

// Lays out a low-bit optimizer's state on the plan: the tensors `keeps_32bit` accepts (by element
// count) leave each group for a "<group>_32bit" group with its weight decay and lr_scale (a group
// left empty disappears) in `plain` (a plain fp32 format of the library's name); every other group
// gets `quantized`.
void plan_low_bit_state(StorePlan& plan, const std::function<bool(int64_t numel)>& keeps_32bit,
                        const StateFormat& plain, const StateFormat& quantized);

// A range's value and gradient in fp32 on the CPU, as the libraries compute: p is the fp32 master,
// the fp32 compute copy itself, or a widened copy of a 16-bit one; g is the gradient widened and
// multiplied by the range's factor (one fp32 product, as grad.float() * scale). finish() writes p
// back to a 16-bit compute copy (nearest-even). Throws for a range that is not on the CPU, naming
// the parameter and `who`.
struct Fp32Range {
  Fp32Range(const StepRange& r, const char* who);
  void finish(const StepRange& r) const;
  at::Tensor p, g;
};

}  // namespace memrt::quant
