// plugins/checkpoint — activation checkpointing (recompute blocks in backward).
//
// This version validates the `activation_checkpointing` section and train.yaml's
// gradient_checkpointing, and refuses to turn recompute on until the checkpoint work lands.
#include <memrt/plugin.h>

namespace {

class CheckpointPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kCheckpoint; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader top(options, diag);
    const bool enabled = top.get<bool>("gradient_checkpointing", false);
    const memrt::ConfigNode* ac = top.child("activation_checkpointing");
    if (ac) {
      memrt::ConfigReader r(*ac, diag);
      for (const char* k : {"partition_activations", "cpu_checkpointing",
                            "contiguous_memory_optimization", "number_checkpoints",
                            "synchronize_checkpoint_boundary", "profile"})
        r.child(k);
      r.finish();
    }
    top.finish();
    if (enabled && ac) {
      throw ac->error("activation checkpointing is not implemented yet in this memrt version "
                      "(plugins/checkpoint); remove the section (and gradient_checkpointing from "
                      "train.yaml)");
    }
    if (enabled) {
      throw options.error("gradient_checkpointing is not implemented yet in this memrt version "
                          "(plugins/checkpoint); set gradient_checkpointing: false in train.yaml");
    }
  }
};

}  // namespace

MEMRT_PLUGIN(CheckpointPlugin, "checkpoint", "0.1.0", "activation checkpointing (validation only)")
