// plugins/zero — ZeRO partitioning over the parameter store, and optimizer offload.
//
// Stage 0 is plain data parallelism, done by the host (bucketed gradient all-reduce). Stage 1
// partitions the fp32 masters and the optimizer state: each rank steps its partition of every
// group, then the updated compute values are all-gathered. docs/zero.md has the phases; the store
// (memrt/param_store.h) does the bookkeeping, so this plugin sets extents and placements and
// moves bytes between ranks.
#include <algorithm>
#include <string>

#include <memrt/plugin.h>

namespace {

using memrt::Extent;
using memrt::StoreBuffer;
using memrt::memory::Category;
using memrt::memory::Placement;

class ZeroPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kZero; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& run) override {
    memrt::ConfigReader top(options, diag);
    const memrt::ConfigNode* zero = top.child("zero_optimization");
    top.finish();
    if (!zero) return;
    memrt::ConfigReader r(*zero, diag);
    stage_ = r.get<int64_t>("stage", 0);
    allgather_bucket_ = r.get<int64_t>("allgather_bucket_size", allgather_bucket_);
    if (allgather_bucket_ <= 0) {
      throw zero->error("allgather_bucket_size must be > 0 elements (got " +
                        std::to_string(allgather_bucket_) + ")");
    }
    if (const memrt::ConfigNode* off = r.child("offload_optimizer")) {
      memrt::ConfigReader o(*off, diag);
      offload_ = o.get<std::string>("device", "none") == "cpu";
      const bool pin = o.get<bool>("pin_memory", false);
      if (const auto ratio = o.optional<double>("ratio"); ratio && *ratio != 1.0) {
        throw off->error("ratio " + std::to_string(*ratio) + " offloads part of the optimizer "
                         "(DeepSpeed's SuperOffload); memrt offloads all of it: remove ratio or set 1");
      }
      o.finish();
      if (offload_ && pin && run.device.is_cpu()) {
        diag.warnings.push_back(off->path() + ".pin_memory: no effect on a CPU device (host memory "
                                "is already where the step runs)");
      }
    }
    // DeepSpeed's keys (deepspeed/runtime/zero/config.py) for what stage 1 does not do here:
    // gradient partitioning (stage 2) and parameter partitioning (stage 3); the config loader
    // checked their types.
    for (const char* k :
         {"contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
          "use_multi_rank_bucket_allreduce", "allgather_partitions", "round_robin_gradients",
          "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
          "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
          "stage3_param_persistence_threshold", "param_persistence_threshold",
          "stage3_model_persistence_threshold", "model_persistence_threshold",
          "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
          "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
          "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
          "stage3_module_granularity_threshold", "module_granularity_threshold",
          "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "offload_param",
          "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings",
          "enable_sanity_checks", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"})
      r.child(k);
    r.finish();
    if (stage_ < 0 || stage_ > 3) {
      throw zero->error("stage must be 0, 1, 2 or 3 (got " + std::to_string(stage_) + ")");
    }
    if (stage_ > 1) {
      throw zero->error("ZeRO stage " + std::to_string(stage_) +
                        " is not implemented yet in this memrt version (plugins/zero: stages 0 and "
                        "1); "
                        "use \"stage\": 1 (optimizer state and masters partitioned) or 0");
    }
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (stage_ < 1) return;
    ctx.plan.set_extent(StoreBuffer::kMaster, Extent::kPartition);
    ctx.plan.set_extent(StoreBuffer::kState, Extent::kPartition);
    if (offload_) {
      ctx.plan.set_placement(StoreBuffer::kMaster, Placement::kHost);
      ctx.plan.set_placement(StoreBuffer::kState, Placement::kHost);
    }
  }

  // Every rank updated its partition of each compute buffer; gather the others' in chunks of
  // allgather_bucket_size elements (rank-major in a staging buffer, comm_buffers, alive only
  // here), then copy them in place.
  void after_optimizer_step(memrt::StepContext& ctx) override {
    if (stage_ < 1 || ctx.skipped || ctx.run.world_size == 1) return;
    const memrt::ParamStore& store = *store_;
    const int n = ctx.run.world_size;
    at::NoGradGuard no_grad;
    memrt::memory::Scope scope(Category::kCommBuffers);
    for (size_t g = 0; g < store.groups().size(); ++g) {
      const at::Tensor& compute = store.groups()[g].compute;
      const auto [lo, hi] = store.plan().partition(static_cast<int>(g));
      const int64_t part = hi - lo;
      const int64_t chunk = std::max<int64_t>(1, std::min(part, allgather_bucket_ / n));
      at::Tensor staging = at::empty({n * chunk}, compute.options());
      for (int64_t c0 = 0; c0 < part; c0 += chunk) {
        const int64_t len = std::min(chunk, part - c0);
        at::Tensor out = staging.narrow(0, 0, n * len);
        ctx.comm.all_gather(out, compute.narrow(0, lo + c0, len));
        for (int r = 0; r < n; ++r) {
          if (r == ctx.run.rank) continue;
          at::Tensor dst = compute.narrow(0, r * part + c0, len);
          dst.copy_(out.narrow(0, r * len, len));
        }
      }
    }
  }

  void build_optimizer(memrt::OptimizerContext& ctx) override { store_ = &ctx.store; }

 private:
  int64_t stage_ = 0;
  bool offload_ = false;
  int64_t allgather_bucket_ = 500'000'000;  // DeepSpeed's default, in elements
  const memrt::ParamStore* store_ = nullptr;
};

}  // namespace

MEMRT_PLUGIN(ZeroPlugin, "zero", "0.2.0",
             "ZeRO stage 1 over the parameter store (masters and optimizer state partitioned), "
             "optimizer offload to host memory")
