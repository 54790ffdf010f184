// plugins/quant — low-bit optimizer state and 4-bit frozen weights (docs/quant.md).
//
// Low-bit AdamW state: train.yaml `optim: adamw_8bit | adamw_bnb_8bit | paged_adamw_8bit` (axolotl's
// `optimizer:` too) is bitsandbytes' AdamW8bit; `adamw_torch_8bit | adamw_torch_4bit` torchao's
// AdamW8bit / AdamW4bit. In plan_store the library's small tensors move to 32-bit groups and the
// rest get its blockwise format; in build_optimizer the formats' kernels join the host's step.
//
// 4-bit frozen weights: `load_in_4bit: true` (axolotl, HF) or `quantization_bit: 4` (LLaMA-Factory)
// with bitsandbytes' `bnb_4bit_*` keys or LLaMA-Factory's `quantization_type` and
// `double_quantization`: the blocks' projections become NF4/FP4 Linear4bit layers (base4.h).
#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

#include <memrt/plugin.h>

#include "ao_adam.h"
#include "base4.h"
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
    configure_base(top, diag);
    top.finish();
  }

  void plan_params(memrt::ParamPlanContext& ctx) override {
    if (base_) base_->plan_params(ctx.params, ctx.reads_frozen);
  }

  void on_block_ready(memrt::BlockReady& ctx) override {
    if (base_) base_->quantize(ctx.block, ctx.checkpoint);
  }

  void estimate_memory(memrt::memory::MemoryEstimate& estimate) const override {
    if (base_) estimate.table.at(memrt::memory::Category::kOther) += base_->scratch_bytes();
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (base_) base_->plan_store(ctx.plan);
    switch (state_) {
      case LowBit::kNone: return;
      case LowBit::kBnb8: return memrt::quant::plan_bnb_adam8(ctx.plan);
      case LowBit::kAo8: return memrt::quant::plan_ao_adam(ctx.plan, 8);
      case LowBit::kAo4: return memrt::quant::plan_ao_adam(ctx.plan, 4);
    }
  }

  void export_model(memrt::ExportContext& ctx) override {
    if (base_) base_->export_model(ctx);
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
  // The 4-bit base's keys, as bitsandbytes (HF, axolotl) and LLaMA-Factory spell them. The defaults
  // are axolotl's and LLaMA-Factory's (NF4, double quantization, the run's compute dtype), not
  // BitsAndBytesConfig's (FP4, none, fp32), since a train.yaml is their file.
  void configure_base(memrt::ConfigReader& r, memrt::ConfigDiagnostics& diag) {
    using memrt::ConfigNode;
    if (const ConfigNode* q8 = r.child("load_in_8bit"); q8 && q8->as_bool())
      throw q8->error("asks for LLM.int8 base weights, which memrt does not build: use load_in_4bit (NF4, "
                      "bitsandbytes' QLoRA format) for a quantized frozen base");
    if (const ConfigNode* m = r.child("quantization_method")) {
      const std::string v = m->as_string();
      if (v != "bnb" && v != "bitsandbytes")
        throw m->error("is \"" + v + "\", which memrt does not build; use \"bnb\" (bitsandbytes' NF4/FP4)");
    }
    const ConfigNode* q4 = r.child("load_in_4bit");
    const ConfigNode* bits = r.child("quantization_bit");
    bool on = q4 && q4->as_bool();
    if (bits && !bits->is_null()) {
      const int64_t b = bits->as_int();
      if (b == 8) throw bits->error("is 8 (LLM.int8 base weights), which memrt does not build; use 4 (NF4)");
      if (b != 4) throw bits->error("is " + std::to_string(b) + "; memrt quantizes base weights to 4 bits");
      if (q4 && !q4->as_bool()) throw bits->error("is 4 but load_in_4bit is false: remove one");
      on = true;
    }
    // One key, two spellings: bitsandbytes' and LLaMA-Factory's.
    const auto either = [&](const char* bnb, const char* llama_factory) -> const ConfigNode* {
      const ConfigNode* a = r.child(bnb);
      const ConfigNode* b = r.child(llama_factory);
      if (a && b && a->describe() != b->describe())
        throw a->error("is " + a->describe() + " but " + llama_factory + " (LLaMA-Factory's name for it) is " +
                       b->describe() + ": keep one");
      return a ? a : b;
    };
    const ConfigNode* type = either("bnb_4bit_quant_type", "quantization_type");
    const ConfigNode* dq = either("bnb_4bit_use_double_quant", "double_quantization");
    const ConfigNode* dtype = r.child("bnb_4bit_compute_dtype");
    const ConfigNode* storage = r.child("bnb_4bit_quant_storage");
    if (!on) {
      for (const ConfigNode* n : {type, dq, dtype, storage})
        if (n) diag.note(*n, "is ignored: load_in_4bit is not true");
      return;
    }
    memrt::quant::Base4Options o;
    if (type) {
      const std::string t = type->as_string();
      if (t != "nf4" && t != "fp4") throw type->error("is \"" + t + "\"; bitsandbytes' 4-bit types are \"nf4\" and \"fp4\"");
      o.type = t == "nf4" ? memrt::quant::Map4::kNf4 : memrt::quant::Map4::kFp4;
    }
    if (dq) o.double_quant = dq->as_bool();
    if (dtype && !dtype->is_null() && !dtype->is_auto()) {
      std::string d = dtype->as_string();
      if (d.rfind("torch.", 0) == 0) d = d.substr(6);
      if (d == "float32" || d == "fp32" || d == "float") {
        o.compute_dtype = at::kFloat;
      } else if (d == "bfloat16" || d == "bf16") {
        o.compute_dtype = at::kBFloat16;
      } else if (d == "float16" || d == "fp16" || d == "half") {
        o.compute_dtype = at::kHalf;
      } else {
        throw dtype->error("is \"" + dtype->as_string() + "\"; use float32, bfloat16 or float16 (unset: the "
                           "run's compute dtype)");
      }
    }
    if (storage && !storage->is_null()) {
      std::string s = storage->as_string();
      if (s.rfind("torch.", 0) == 0) s = s.substr(6);
      if (s != "uint8")
        throw storage->error("is \"" + storage->as_string() + "\"; memrt keeps 4-bit codes as uint8 "
                             "(bitsandbytes' default; other storage dtypes exist for FSDP, which memrt's ZeRO does not need)");
    }
    base_.emplace(o);
  }

  LowBit state_ = LowBit::kNone;
  std::optional<memrt::quant::Base4> base_;
};

}  // namespace

MEMRT_PLUGIN(QuantPlugin, "quant", "0.3.0", "low-bit optimizer state (bitsandbytes' and torchao's) and NF4/FP4 frozen weights")
