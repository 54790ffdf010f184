// plugins/quant — low-bit optimizer state and 4-bit frozen weights (docs/quant.md).
//
// Built: low-bit AdamW state. train.yaml `optim: adamw_8bit | adamw_bnb_8bit | paged_adamw_8bit`
// (axolotl's `optimizer:` too) is bitsandbytes' AdamW8bit; `adamw_torch_8bit | adamw_torch_4bit`
// torchao's AdamW8bit / AdamW4bit. In plan_store the library's small tensors move to 32-bit groups
// and the rest get its blockwise format; in build_optimizer the formats' kernels join the host's
// step. Not yet: 4-bit frozen weights (load_in_4bit and the bnb_4bit_* keys are refused, saying so).
#include <algorithm>
#include <cctype>
#include <string>

#include <memrt/plugin.h>

#include "ao_adam.h"
#include "bnb_adam.h"

namespace {

enum class LowBit { kNone, kBnb8, kAo8, kAo4 };

class QuantPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kQuant; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader top(options, diag);
    if (const memrt::ConfigNode* optim = top.child("optim")) {
      std::string name = optim->as_string();
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      if (name == "adamw_8bit" || name == "adamw_bnb_8bit" || name == "paged_adamw_8bit") {
        state_ = LowBit::kBnb8;
      } else if (name == "adamw_torch_8bit") {
        state_ = LowBit::kAo8;
      } else if (name == "adamw_torch_4bit") {
        state_ = LowBit::kAo4;
      } else {
        throw optim->error("is \"" + optim->as_string() + "\", which plugins/quant does not know; it steps "
                           "adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit (bitsandbytes' AdamW8bit), "
                           "adamw_torch_8bit and adamw_torch_4bit (torchao's AdamW8bit, AdamW4bit)");
      }
      if (name == "paged_adamw_8bit")
        diag.note(*optim, "is \"paged_adamw_8bit\": trained as adamw_8bit (paging moves state between GPU and "
                          "host memory under pressure; zero_optimization.offload_optimizer keeps it on the host)");
    }
    for (const char* key : {"load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"}) {
      if (const memrt::ConfigNode* n = top.child(key))
        throw n->error("asks for 4-bit base weights, which are not implemented yet in this memrt version "
                       "(plugins/quant has their format, not yet the 4-bit linear); train without load_in_4bit");
    }
    top.finish();
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    switch (state_) {
      case LowBit::kNone: return;
      case LowBit::kBnb8: return memrt::quant::plan_bnb_adam8(ctx.plan);
      case LowBit::kAo8: return memrt::quant::plan_ao_adam(ctx.plan, 8);
      case LowBit::kAo4: return memrt::quant::plan_ao_adam(ctx.plan, 4);
    }
  }

  void build_optimizer(memrt::OptimizerContext& ctx) override {
    using namespace memrt::quant;
    if (state_ == LowBit::kBnb8) {
      ctx.step_kernels.set(kBnb8Format, bnb_adam_kernel(true));
      ctx.step_kernels.set(kBnb32Format, bnb_adam_kernel(false));
    } else if (state_ != LowBit::kNone) {
      const int bits = state_ == LowBit::kAo8 ? 8 : 4;
      ctx.step_kernels.set(ao_format(bits).name, ao_adam_kernel(bits));
      ctx.step_kernels.set(kAo32Format, ao_adam_kernel(32));
    }
  }

 private:
  LowBit state_ = LowBit::kNone;
};

}  // namespace

MEMRT_PLUGIN(QuantPlugin, "quant", "0.2.0", "low-bit optimizer state (bitsandbytes' and torchao's) and 4-bit weights (planned)")
