// The host's memory plan (docs/memory.md, "The estimate"): plain data parallelism in fp32 with the
// config's optimizer, from parameter shapes alone. Plugins then edit it (PluginHost::estimate_memory).
#pragma once

#include <cstdint>
#include <string>

#include "memrt/memory.h"
#include "memrt/plugin.h"

namespace memrt {

struct HostPlanOptions {
  std::string optimizer = "AdamW";  // "Adam", "AdamW", "SGD"
  double momentum = 0.0;            // SGD
  int64_t allreduce_bucket_bytes = int64_t{500'000'000};
};

// The plan for run.rank in a world of run.world_size ranks.
memory::MemoryEstimate host_memory_plan(const RunInfo& run, const HostPlanOptions& options);

}  // namespace memrt
