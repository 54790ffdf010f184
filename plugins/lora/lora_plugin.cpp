// plugins/lora — what `finetuning_type` chooses to train beyond the full model.
//
// Built: LLaMA-Factory's freeze tuning (`finetuning_type: freeze`, freeze.h), in plan_params: only
// the chosen parameters train and hold gradients and optimizer state; the others stay as frozen
// slots of the store. Not built yet: LoRA adapters (issue 25; the design: docs/lora.md) — the loader
// routes the lora_* keys here, and the plugin refuses them rather than training something other than
// what was asked for.
#include <memrt/plugin.h>

#include <string>
#include <vector>

#include "freeze.h"

namespace {

class LoraPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kLora; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader r(options, diag);
    const std::string type = r.get<std::string>("finetuning_type", "lora");
    if (type != "freeze") {
      throw options.error("LoRA adapters are not implemented yet in this memrt version (plugins/lora); "
                          "train without them (no lora_* keys), or freeze layers with "
                          "finetuning_type: freeze");
    }
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
    r.finish();
  }

  void plan_params(memrt::ParamPlanContext& ctx) override {
    std::vector<std::string> names;
    for (const memrt::ParamInfo& p : ctx.params) names.push_back(p.name);
    const std::vector<bool> train = memrt::lora::freeze_trainable(names, ctx.run.shape.n_layer, freeze_);
    for (size_t i = 0; i < ctx.params.size(); ++i) ctx.params[i].trainable = ctx.params[i].trainable && train[i];
  }

 private:
  memrt::lora::FreezeOptions freeze_;
};

}  // namespace

MEMRT_PLUGIN(LoraPlugin, "lora", "0.2.0", "freeze tuning (LLaMA-Factory's finetuning_type: freeze)")
