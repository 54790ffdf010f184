// plugins/zero — ZeRO stage 1/2/3 partitioning and CPU offload.
//
// Stage 0 is plain data parallelism, done by the host (bucketed gradient all-reduce); this version
// validates the `zero_optimization` section and refuses stages 1-3 until the ZeRO work lands.
#include <memrt/plugin.h>

namespace {

class ZeroPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kZero; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader top(options, diag);
    const memrt::ConfigNode* zero = top.child("zero_optimization");
    top.finish();
    if (!zero) return;
    memrt::ConfigReader r(*zero, diag);
    const int64_t stage = r.get<int64_t>("stage", 0);
    // DeepSpeed's keys (deepspeed/runtime/zero/config.py); at stage 0 none of them has an effect.
    for (const char* k :
         {"contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
          "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
          "round_robin_gradients", "load_from_fp32_weights", "elastic_checkpoint",
          "ignore_unused_parameters", "sub_group_size", "stage3_prefetch_bucket_size",
          "prefetch_bucket_size", "stage3_param_persistence_threshold",
          "param_persistence_threshold", "stage3_model_persistence_threshold",
          "model_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
          "stage3_max_reuse_distance", "max_reuse_distance",
          "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
          "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
          "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
          "stage3_allgather_sequential", "offload_optimizer", "offload_param",
          "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings",
          "enable_sanity_checks", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"})
      r.child(k);
    r.finish();
    if (stage < 0 || stage > 3) {
      throw zero->error("stage must be 0, 1, 2 or 3 (got " + std::to_string(stage) + ")");
    }
    if (stage > 0) {
      throw zero->error("ZeRO stage " + std::to_string(stage) +
                        " is not implemented yet in this memrt version (plugins/zero); use "
                        "\"stage\": 0 (data parallel, every rank holds the full model)");
    }
  }
};

}  // namespace

MEMRT_PLUGIN(ZeroPlugin, "zero", "0.1.0", "ZeRO partitioning (stage 0 only so far)")
