// plugins/quant/adam_state.h — what the low-bit Adam kernels share: the store layout of a library's
// rule "small tensors keep 32-bit state" and a range's fp32 view (docs/quant.md, "The step").
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/ATen.h>

#include <memrt/optimizer.h>
#include <memrt/param_store.h>

#include "quant_math.h"

namespace memrt::quant {

// Lays out a low-bit optimizer's state on the plan: the tensors `keeps_32bit` accepts (by element
// count) leave each group for a "<group>_32bit" group with its weight decay and lr_scale (a group
// left empty disappears) in `plain` (a plain fp32 format of the library's name); every other group
// gets `quantized`.
void plan_low_bit_state(StorePlan& plan, const std::function<bool(int64_t numel)>& keeps_32bit,
                        const StateFormat& plain, const StateFormat& quantized);

// A range's gradient as the kernels read it, a block at a time into fp32 (no copy of the range):
// each element widened exactly, then times `factor` (one fp32 product, as grad.float() * scale).
struct GradIn {
  const void* data = nullptr;
  at::ScalarType type = at::kFloat;  // Float, BFloat16 or Half
  float factor = 1.f;

  // Elements [begin, begin + len) into out. Inline: compiled into each caller's ISA clones.
  void load(int64_t begin, int64_t len, float* __restrict out) const {
    if (type == at::kFloat) {
      const float* g = static_cast<const float*>(data) + begin;
      for (int64_t i = 0; i < len; ++i) out[i] = g[i] * factor;
    } else if (type == at::kBFloat16) {
      const uint16_t* g = static_cast<const uint16_t*>(data) + begin;
      for (int64_t i = 0; i < len; ++i) out[i] = from_bits(static_cast<uint32_t>(g[i]) << 16) * factor;
    } else {
      const c10::Half* g = static_cast<const c10::Half*>(data) + begin;
      for (int64_t i = 0; i < len; ++i) out[i] = static_cast<float>(g[i]) * factor;
    }
  }
};

// A range's value in fp32 on the CPU and its gradient, as the kernels take them: p is the fp32
// master, the fp32 compute copy itself, or a widened copy of a 16-bit one (no master: rare), which
// finish() writes back (nearest-even). Throws for a range that is not on the CPU or a gradient
// the kernels do not read, naming the parameter and `who`.
struct Fp32Range {
  Fp32Range(const StepRange& r, const char* who);
  void finish(const StepRange& r) const;
  at::Tensor p;
  GradIn grad;
};

}  // namespace memrt::quant
