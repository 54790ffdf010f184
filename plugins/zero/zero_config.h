// The zero_optimization section as plugins/zero reads it. Every key DeepSpeed knows
// (deepspeed/runtime/zero/config.py and offload_config.py) is honoured, accepted with a note
// where it cannot matter on this backend, or refused naming the key and what to use instead;
// anything else is an unknown key with the nearest valid one. The config loader only routes the
// section here, after two things that need more than the section: the legacy boolean form
// (`"zero_optimization": true` becomes {"stage": 1}) and "auto" bucket sizes, which come from the
// model's width in train.yaml (docs/configuration.md).
#pragma once

#include <cstdint>

#include <memrt/config_node.h>

namespace memrt::zero {

struct Options {
  int stage = 0;
  bool offload_optimizer = false;                // offload_optimizer.device "cpu" (or cpu_offload)
  int64_t reduce_bucket_size = 500'000'000;      // elements; DeepSpeed's default
  int64_t allgather_bucket_size = 500'000'000;   // likewise
  // Stages 2 and 3: each gradient bucket summed onto the ranks whose partitions hold it
  // (DeepSpeed's reduce_scatter, its default), or, false, all-reduced in place on every rank (as
  // DeepSpeed's stage 2 average_tensor and stage 3 __reduce_and_partition_ipg_grads do).
  bool reduce_scatter = true;
  // Stage 3.
  bool offload_param = false;                    // offload_param.device "cpu" (or cpu_offload_param)
  // A parameter of at most this many elements stays whole on every rank (DeepSpeed's ds_persist),
  // in model order until their sum would pass model_persistence_threshold. DeepSpeed's defaults.
  int64_t param_persistence_threshold = 100'000;
  int64_t model_persistence_threshold = INT64_MAX;
  // The next segment's gather starts while this one computes when it has at most
  // prefetch_bucket_size elements (0: never) and both together at most max_live_parameters.
  // DeepSpeed's defaults.
  int64_t prefetch_bucket_size = 50'000'000;
  int64_t max_live_parameters = 1'000'000'000;
};

// Reads the section (an object). Throws ConfigError naming the file and key; notes go to
// diag.warnings. `device_is_cpu`: the run's device is the host (pin_memory cannot matter).
Options read_options(const ConfigNode& section, ConfigDiagnostics& diag, bool device_is_cpu);

}  // namespace memrt::zero
