// plugins/precision — fp16 with dynamic loss scaling, bf16, fp32 master weights.
//
// This version validates the `fp16`, `bf16` and `data_types` sections and is a no-op when both
// are disabled; enabling either is refused with a clear message until the precision work lands.
#include <memrt/plugin.h>

namespace {

class PrecisionPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kPrecision; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader top(options, diag);
    if (const memrt::ConfigNode* fp16 = top.child("fp16")) {
      memrt::ConfigReader r(*fp16, diag);
      const bool enabled = r.get<bool>("enabled", false);
      for (const char* k : {"auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                            "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                            "fp16_master_weights_and_grads"})
        r.child(k);
      r.finish();
      if (enabled) throw not_yet(*fp16, "fp16");
    }
    if (const memrt::ConfigNode* bf16 = top.child("bf16")) {
      memrt::ConfigReader r(*bf16, diag);
      const bool enabled = r.get<bool>("enabled", false);
      for (const char* k : {"immediate_grad_update", "check_grad_overflow",
                            "bf16_master_weights_and_grads", "bf16_optimizer_states"})
        r.child(k);
      r.finish();
      if (enabled) throw not_yet(*bf16, "bf16");
    }
    if (const memrt::ConfigNode* types = top.child("data_types")) {
      memrt::ConfigReader r(*types, diag);
      for (const char* k : {"grad_accum_dtype", "param_dtype", "buffer_dtype"}) {
        if (auto v = r.optional<std::string>(k); v && *v != "fp32")
          throw types->error(std::string(k) + " \"" + *v + "\" needs 16-bit training, which is "
                             "not implemented yet; use \"fp32\" or remove it");
      }
      r.finish();
    }
    top.finish();
  }

 private:
  static memrt::ConfigError not_yet(const memrt::ConfigNode& section, const std::string& key) {
    return section.error(key + " training is not implemented yet in this memrt version "
                         "(plugins/precision); train in fp32: set \"" + key +
                         "\": {\"enabled\": false} (and " + key + ": false in train.yaml)");
  }
};

}  // namespace

MEMRT_PLUGIN(PrecisionPlugin, "precision", "0.1.0", "fp16 / bf16 mixed precision (validation only)")
