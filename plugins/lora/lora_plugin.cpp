// plugins/lora — what `finetuning_type` chooses to train beyond the full model (docs/lora.md).
//
// LoRA (`use_peft`, `adapter: lora`, `finetuning_type: lora`, or any lora_* key): plan_params
// freezes the model and adds each target projection's adapters (lora_targets.h); transform_model
// wraps those projections in LoraLinear (lora_linear.h), whose A and B are the planned parameters;
// plan_store counts the adapters as adapters. LLaMA-Factory's freeze tuning (`finetuning_type:
// freeze`, freeze.h): in plan_params only the chosen parameters train.
// Not built yet (issue 25, in docs/lora.md's order): PEFT adapter files, DoRA, LoRA+, bias modes,
// modules_to_save, QLoRA — each refused by its key rather than trained as something else.
#include <memrt/plugin.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "freeze.h"
#include "lora_linear.h"
#include "lora_targets.h"

namespace {

using memrt::lora::Target;

class LoraPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kLora; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader r(options, diag);
    const std::string type = r.get<std::string>("finetuning_type", "lora");
    freeze_mode_ = type == "freeze";
    if (freeze_mode_) {
      configure_freeze(options, r);
    } else {
      configure_lora(options, r);
    }
    r.finish();
  }

  void plan_params(memrt::ParamPlanContext& ctx) override {
    if (freeze_mode_) {
      std::vector<std::string> names;
      for (const memrt::ParamInfo& p : ctx.params) names.push_back(p.name);
      const std::vector<bool> train = memrt::lora::freeze_trainable(names, ctx.run.shape.n_layer, freeze_);
      for (size_t i = 0; i < ctx.params.size(); ++i) ctx.params[i].trainable = ctx.params[i].trainable && train[i];
      return;
    }
    targets_.clear();
    for (const Target& t : memrt::lora::select_targets(ctx.params, ctx.run.shape.arch, rule_))
      targets_[t.module] = t;
    std::vector<Target> list;
    for (const auto& [name, t] : targets_) list.push_back(t);
    memrt::lora::plan_adapters(ctx.params, list, options_.r);
  }

  // What the adapters keep for backward beyond what the base's ops keep (the host counts a
  // target's input as kept, and its output as needing a gradient, once an adapter inside it
  // trains): A's output, for B's gradient, exact; with lora_dropout, an upper bound of what each
  // target's dropout keeps: the dropped input and a mask as wide (ATen keeps less where the input
  // needs no gradient).
  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (freeze_mode_) return;
    const int64_t tokens = e.run->micro_batch_size * e.run->block_size;
    const int64_t width = static_cast<int64_t>(c10::elementSize(e.compute_dtype));
    for (const auto& [name, t] : targets_) {
      const int64_t block = memrt::memory::param_segment(name + ".weight", e.run->shape.n_layer);
      int64_t kept = options_.r * width;
      if (options_.dropout > 0.0) kept += 2 * t.in * width;
      e.activations.per_block.at(static_cast<size_t>(block)) += tokens * kept;
    }
    e.refresh_activations();
  }

  void transform_model(memrt::ModelContext& ctx) override {
    if (freeze_mode_) return;
    for (int64_t i = 0; i < ctx.model.num_blocks(); ++i) {
      memrt::Block& block = ctx.model.block(i);
      for (const std::string& name : block.linear_names()) {
        auto it = targets_.find(block.hf_prefix() + "." + name);
        if (it == targets_.end()) continue;
        // A from the run's seeded default generator (PEFT's init), B zero.
        block.replace_linear(name, torch::nn::AnyModule(memrt::lora::LoraLinear(
                                       block.linear(name), it->second.in, it->second.out, options_)));
      }
    }
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (freeze_mode_) return;
    memrt::StorePlan& plan = ctx.plan;
    // Adapters sharing a group with other trainable parameters get a group of their own, so that
    // their weights are counted apart.
    const std::vector<memrt::StoreGroup> groups = plan.groups();  // add_group changes the list
    for (const memrt::StoreGroup& g : groups) {
      size_t adapters = 0;
      for (int slot : g.slots) adapters += memrt::lora::is_adapter(plan.slots()[static_cast<size_t>(slot)].param.name);
      if (adapters == 0 || adapters == g.slots.size()) continue;
      plan.add_group({g.name + "_lora", [](const memrt::ParamInfo& p) { return memrt::lora::is_adapter(p.name); },
                      g.weight_decay, g.lr_scale});
    }
    const auto all_adapters = [&plan](const memrt::StoreGroup& g) {
      for (int slot : g.slots)
        if (!memrt::lora::is_adapter(plan.slots()[static_cast<size_t>(slot)].param.name)) return false;
      return !g.slots.empty();
    };
    plan.set_weights_category(memrt::memory::Category::kAdapters, memrt::GroupSelector("groups of LoRA adapters", all_adapters));
  }

 private:
  void configure_freeze(const memrt::ConfigNode& options, memrt::ConfigReader& r) {
    freeze_.file = options.file();
    freeze_.trainable_layers = r.get<int64_t>("freeze_trainable_layers", freeze_.trainable_layers);
    if (const memrt::ConfigNode* m = r.child("freeze_trainable_modules"); m && !m->is_null()) {
      freeze_.modules = m->as_names();
      if (freeze_.modules.empty()) throw m->error("names no module; use \"all\" or module names");
    }
    if (const memrt::ConfigNode* m = r.child("freeze_extra_modules"); m && !m->is_null())
      freeze_.extra = m->as_names();
    freeze_.llama_pro = r.get<bool>("use_llama_pro", false);
    if (freeze_.trainable_layers == 0)
      throw memrt::ConfigError(freeze_.file, "freeze_trainable_layers",
                               "is 0: no layer would train; use n > 0 for the last n layers or "
                               "n < 0 for the first -n");
  }

  void configure_lora(const memrt::ConfigNode& options, memrt::ConfigReader& r) {
    rule_.file = options.file();
    options_.r = r.get<int64_t>("lora_r", options_.r);
    if (options_.r <= 0) throw memrt::ConfigError(rule_.file, "lora_r", "is " + std::to_string(options_.r) + "; the rank must be positive");
    options_.alpha = r.get<double>("lora_alpha", options_.alpha);
    options_.dropout = r.get<double>("lora_dropout", options_.dropout);
    if (!(options_.dropout >= 0.0 && options_.dropout < 1.0))
      throw memrt::ConfigError(rule_.file, "lora_dropout", "is " + std::to_string(options_.dropout) +
                                                               "; a dropout probability must be in [0, 1)");
    options_.rslora = r.get<bool>("use_rslora", false);
    if (const memrt::ConfigNode* t = r.child("lora_target_modules"); t && !t->is_null()) {
      if (t->is_string() && t->as_string() == "all-linear") {
        rule_.all_linear = true;
      } else {
        rule_.modules = t->as_names();
        if (rule_.modules.empty()) throw t->error("names no module; list module names or use all-linear");
      }
    }
    if (const memrt::ConfigNode* d = r.child("lora_model_dir"); d && !d->is_null())
      throw d->error("loads a saved adapter, which is not implemented yet in this memrt version; remove it to train new "
                     "adapters");
  }

  bool freeze_mode_ = false;
  memrt::lora::FreezeOptions freeze_;
  memrt::lora::LoraOptions options_;
  memrt::lora::TargetRule rule_;
  std::map<std::string, Target> targets_;  // by module name
};

}  // namespace

MEMRT_PLUGIN(LoraPlugin, "lora", "0.3.0", "LoRA adapters (PEFT's), freeze tuning (LLaMA-Factory's)")
