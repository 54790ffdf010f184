// The host's memory plan (docs/memory.md, "The estimate"): plain data parallelism in fp32 with the
// config's optimizer, from parameter shapes alone. Plugins then edit it (PluginHost::estimate_memory).
#pragma once

#include <cstdint>
#include <string>

#include "memrt/memory.h"
#include "memrt/param_store.h"
#include "memrt/plugin.h"

namespace memrt {

struct HostPlanOptions {
  StoreOptions store;       // the optimizer's state and weight decay (rank, world size: the run's)
  bool decay_all = false;   // every parameter in the decay group (store/decay.h)
  int64_t allreduce_bucket_bytes = int64_t{500'000'000};
};

// The plan for run.rank in a world of run.world_size ranks. Its weights and optimizer-state cells
// are the default store layout's bytes (padding included), and `store` that layout.
memory::MemoryEstimate host_memory_plan(const RunInfo& run, const HostPlanOptions& options);

}  // namespace memrt
