// plugins/checkpoint — activation checkpointing: checkpointed blocks keep only their input in
// forward and are recomputed inside backward (docs/checkpointing.md). The adapter: options,
// which blocks, the run_segment wrapper, the memory estimate, the profile metrics.
#include <memrt/plugin.h>

#include "checkpoint_estimate.h"
#include "recompute.h"

namespace {

using memrt::checkpoint::RecomputeOptions;
using memrt::checkpoint::RecomputeTiming;

class CheckpointPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kCheckpoint; }

  // Options (docs/configuration.md): {"gradient_checkpointing": bool, "activation_checkpointing":
  // {"cpu_checkpointing", "profile", "every_n_blocks"}, "gradient_checkpointing_kwargs":
  // {"use_reentrant", "preserve_rng_state"}}; the loader has already warned about DeepSpeed's keys
  // that do not apply and removed them.
  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& run) override {
    memrt::ConfigReader top(options, diag);
    enabled_ = top.get<bool>("gradient_checkpointing", false);
    int64_t every = 1;
    if (const memrt::ConfigNode* ac = top.child("activation_checkpointing")) {
      memrt::ConfigReader r(*ac, diag);
      options_.offload = r.get<bool>("cpu_checkpointing", false);
      profile_ = r.get<bool>("profile", false);
      if (const memrt::ConfigNode* n = r.child("every_n_blocks"); n && !n->is_null()) {
        every = n->as_int();
        if (every < 1) throw n->error("must be >= 1 (1: every block; n: blocks n, 2n, ...)");
        if (every > run.shape.n_layer) {
          throw n->error("is " + std::to_string(every) + " but the model has " +
                         std::to_string(run.shape.n_layer) + " blocks: no block would be "
                         "checkpointed; use at most " + std::to_string(run.shape.n_layer) +
                         ", or turn checkpointing off");
        }
      }
      r.finish();
    }
    if (const memrt::ConfigNode* kw = top.child("gradient_checkpointing_kwargs")) {
      memrt::ConfigReader r(*kw, diag);
      // torch.utils.checkpoint's two implementations give the same gradients; memrt has one
      // (an autograd node of its own), so either value is accepted.
      r.get<bool>("use_reentrant", true);
      options_.preserve_rng_state = r.get<bool>("preserve_rng_state", true);
      r.finish();
    }
    top.finish();
    checkpointed_ = memrt::checkpoint::checkpointed_blocks(run.shape.n_layer, every);
  }

  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (enabled_) memrt::checkpoint::estimate_checkpointed(e, checkpointed_, options_.offload);
  }

  bool wraps_segments() const override { return enabled_; }

  at::Tensor run_segment(memrt::SegmentContext& ctx, const at::Tensor& x,
                         const memrt::SegmentFn& next) override {
    if (ctx.kind != memrt::SegmentKind::kBlock ||
        !checkpointed_.at(static_cast<size_t>(ctx.index))) {
      return next(x);
    }
    // `next` is the rest of the chain (inner wrappers such as ZeRO-3's gather, then the block):
    // the recompute runs all of it again.
    return memrt::checkpoint::checkpoint(next, x, options_, profile_ ? &timing_ : nullptr);
  }

  // profile: DeepSpeed logs each checkpoint call's forward and recompute time; memrt adds the
  // per-step averages since the last log line to it and to metrics.jsonl.
  void add_metrics(memrt::Metrics& m) override {
    if (!profile_ || steps_since_log_ == 0) return;
    const double steps = static_cast<double>(steps_since_log_);
    m["checkpoint_forward_ms"] = timing_.forward_ms / steps;
    m["checkpoint_recompute_ms"] = timing_.recompute_ms / steps;
    m["checkpoint_backward_ms"] = timing_.backward_ms / steps;
    timing_ = RecomputeTiming{};
    steps_since_log_ = 0;
  }
  void after_optimizer_step(memrt::StepContext&) override { ++steps_since_log_; }

 private:
  bool enabled_ = false;
  bool profile_ = false;
  RecomputeOptions options_;
  std::vector<bool> checkpointed_;
  RecomputeTiming timing_;
  int64_t steps_since_log_ = 0;
};

}  // namespace

MEMRT_PLUGIN(CheckpointPlugin, "checkpoint", "1.0.0",
             "activation checkpointing: recompute blocks in backward, optionally from host memory")
