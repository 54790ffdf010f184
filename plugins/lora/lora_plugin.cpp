// plugins/lora — LoRA adapters.
//
// Not implemented yet: the host loads this plugin when train.yaml asks for lora, and it refuses
// with a message saying so, rather than training something other than what was asked for.
#include <memrt/plugin.h>

namespace {

class LoraPlugin final : public memrt::Plugin {
 public:
  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& /*diag*/,
                 const memrt::RunInfo& /*run*/) override {
    throw options.error("LoRA adapters is not implemented yet in this memrt version (plugins/lora); "
                        "train without it (no lora_* keys)");
  }
};

}  // namespace

MEMRT_PLUGIN(LoraPlugin, "lora", "0.1.0", "LoRA adapters (not implemented yet)")
