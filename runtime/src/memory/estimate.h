// The host's memory plan (docs/memory.md, "The estimate"): plain data parallelism in fp32 with the
// config's optimizer, from parameter shapes alone. Plugins then edit it (PluginHost::estimate_memory).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "memrt/memory.h"
#include "memrt/param_store.h"
#include "memrt/plugin.h"

namespace memrt {

struct HostPlanOptions {
  StoreOptions store;         // the optimizer's state and weight decay (rank, world size: the run's)
  OptimizerConfig optimizer;  // its groups (store/host_groups.h)
  int64_t allreduce_bucket_bytes = int64_t{500'000'000};
};

// The parameters of the model `shape` describes as a plan starts them: in named_parameters()
// order, every one trainable, in the decay group by store/host_groups.h's decays(). What
// plan_params then edits.
std::vector<ParamInfo> shape_params(const ModelShape& shape, bool decay_all);

// Each parameter's segment (SegmentContext::index) from its name (memory::param_segment): what the
// store lays its groups out by, in the estimate and in the run alike.
std::vector<int64_t> param_segments(const std::vector<ParamInfo>& params, int64_t n_layer);

// The plan for run.rank in a world of run.world_size ranks, training `params` (shape_params after
// every plugin's plan_params). Its weights and optimizer-state cells are the store layout's bytes
// (padding included), and `store` that layout; gradients and activations count only what the
// trainable parameters need (a frozen prefix of the model keeps no activations).
memory::MemoryEstimate host_memory_plan(const RunInfo& run, const HostPlanOptions& options,
                                        const std::vector<ParamInfo>& params);

}  // namespace memrt
