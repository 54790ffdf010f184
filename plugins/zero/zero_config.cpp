#include "zero_config.h"

#include <initializer_list>
#include <string>
#include <utility>

namespace memrt::zero {

namespace {

// A key DeepSpeed also accepts under other names (its pydantic aliases): any one of them, not two.
const ConfigNode* aliased(ConfigReader& r, std::initializer_list<const char*> names) {
  const ConfigNode* found = nullptr;
  for (const char* name : names) {
    const ConfigNode* n = r.child(name);
    if (!n || n->is_null()) continue;
    if (found) {
      throw n->error("and '" + found->path() + "' are the same setting (DeepSpeed aliases): keep one");
    }
    found = n;
  }
  return found;
}

// Type-checked, then unused: a setting whose DeepSpeed meaning is what memrt does anyway.
void accept_bool(ConfigReader& r, std::initializer_list<const char*> names) {
  if (const ConfigNode* n = aliased(r, names)) n->as_bool();
}

std::string stage_key(const ConfigNode* stage) {
  return stage ? stage->path() : std::string("zero_optimization.stage");
}

// offload_optimizer / offload_param, or their legacy booleans (cpu_offload, cpu_offload_param).
// Returns whether the device is "cpu".
// `device_is_cpu`: the run's device is the host, where pin_memory cannot matter.
bool read_offload(ConfigReader& r, const char* key, const char* legacy, bool is_param, int stage,
                  const ConfigNode* stage_node, bool device_is_cpu, ConfigDiagnostics& diag) {
  const ConfigNode* section = r.child(key);
  const ConfigNode* old = r.child(legacy);
  if (section && section->is_null()) section = nullptr;
  const ConfigNode* device = nullptr;
  std::string dev = "none";
  if (old && !old->is_null()) {
    if (section) {
      throw old->error("cannot be given together with its replacement '" + section->path() + "': keep " + key);
    }
    dev = old->as_bool() ? "cpu" : "none";
    diag.note(*old, "is deprecated: read as \"" + std::string(key) + "\": {\"device\": \"" + dev + "\"}");
    device = old;
  } else if (section) {
    ConfigReader o(*section, diag);
    device = o.child("device");
    if (device && !device->is_null()) dev = device->as_string();
    if (dev == "nvme") {
      throw device->error("is \"nvme\", which memrt does not support: offload to \"cpu\" (or \"none\")");
    }
    if (dev != "cpu" && dev != "none") throw device->error("is \"" + dev + "\"; expected \"cpu\" or \"none\"");
    if (const ConfigNode* pin = o.child("pin_memory"); pin && !pin->is_null() && pin->as_bool() && dev == "cpu" &&
                                                         device_is_cpu) {
      diag.note(*pin, "has no effect on a CPU device (host memory is already where the step runs)");
    }
    if (!is_param) {
      if (const ConfigNode* ratio = o.child("ratio"); ratio && !ratio->is_null() && ratio->as_double() != 1.0) {
        throw ratio->error("is " + ratio->to_json(0) + ": it offloads part of the optimizer (DeepSpeed's "
                           "SuperOffload); memrt offloads all of it: remove ratio or set 1");
      }
      o.reject_if_true("super_offload", "SuperOffload (Grace-Hopper); use device \"cpu\"");
      o.ignore("cpuadam_cores_perc", "memrt's CPU optimizer uses the threads LibTorch is given");
      for (const char* k : {"buffer_count", "pipeline_read", "pipeline_write", "fast_init"})
        o.ignore(k, "an NVMe swapping setting; memrt offloads to CPU memory only");
    } else {
      for (const char* k : {"buffer_count", "buffer_size", "max_in_cpu"})
        o.ignore(k, "an NVMe swapping setting; memrt offloads to CPU memory only");
    }
    o.ignore("nvme_path", "device is \"" + dev + "\", not NVMe");
    o.finish();
  }
  if (dev != "cpu") return false;
  if (stage == 0) {
    throw device->error("is \"cpu\" but '" + stage_key(stage_node) + "' is 0: offloading needs ZeRO stage " +
                        (is_param ? "3" : "1, 2 or 3"));
  }
  if (is_param && stage < 3) {
    throw device->error("is \"cpu\" but '" + stage_key(stage_node) + "' is " + std::to_string(stage) +
                        ": parameter offload needs stage 3 (DeepSpeed silently ignores it below 3; memrt "
                        "refuses instead)");
  }
  return true;
}

}  // namespace

Options read_options(const ConfigNode& section, ConfigDiagnostics& diag, bool device_is_cpu) {
  ConfigReader r(section, diag);
  Options out;
  const ConfigNode* stage = r.child("stage");
  if (stage && !stage->is_null()) {
    const int64_t s = stage->as_int();
    if (s < 0 || s > 3) throw stage->error("must be 0, 1, 2 or 3 (got " + std::to_string(s) + ")");
    out.stage = static_cast<int>(s);
  }

  // What memrt honours.
  for (auto [key, into] : {std::pair{"reduce_bucket_size", &out.reduce_bucket_size},
                           {"allgather_bucket_size", &out.allgather_bucket_size}}) {
    if (const ConfigNode* n = r.child(key); n && !n->is_null()) {
      *into = n->as_int();
      if (*into <= 0) throw n->error("must be > 0 elements (got " + std::to_string(*into) + ")");
    }
  }
  out.offload_optimizer =
      read_offload(r, "offload_optimizer", "cpu_offload", false, out.stage, stage, device_is_cpu, diag);
  out.offload_param = read_offload(r, "offload_param", "cpu_offload_param", true, out.stage, stage, device_is_cpu, diag);

  if (const ConfigNode* n = r.child("reduce_scatter"); n && !n->is_null()) out.reduce_scatter = n->as_bool();
  // DeepSpeed settings whose result memrt gives by construction, whatever their value: stage 2
  // keeps one flat gradient partition per group (contiguous_gradients) and all-gathers the
  // updated partitions (allgather_partitions); unused parameters simply hand over no gradient.
  // The rest are read by stage 3.
  if (const ConfigNode* n = r.child("overlap_comm"); n && !n->is_null() && n->as_bool() && out.stage >= 1) {
    diag.note(*n, out.stage >= 2 ? "has no effect here: each gradient bucket is reduced on the backward thread "
                                   "as it fills, not overlapped on a second stream"
                                 : "has no effect here: stage 1 all-reduces the gradients after backward");
  }
  accept_bool(r, {"contiguous_gradients"});
  accept_bool(r, {"allgather_partitions"});
  accept_bool(r, {"round_robin_gradients"});
  accept_bool(r, {"load_from_fp32_weights"});
  accept_bool(r, {"ignore_unused_parameters"});
  accept_bool(r, {"use_multi_rank_bucket_allreduce"});
  // Stage 3's. Read at every stage (DeepSpeed ignores them below 3, and so do the phases here).
  auto elements = [&](std::initializer_list<const char*> names, int64_t& into) {
    if (const ConfigNode* n = aliased(r, names)) {
      into = n->as_int();
      if (into < 0) throw n->error("must be >= 0 elements (got " + std::to_string(into) + ")");
    }
  };
  elements({"stage3_param_persistence_threshold", "param_persistence_threshold"}, out.param_persistence_threshold);
  elements({"stage3_model_persistence_threshold", "model_persistence_threshold"}, out.model_persistence_threshold);
  // The host writes the consolidated model into each checkpoint when it is true at stage 3 (the
  // loader resolved "auto" and told the host); here only its type is checked.
  accept_bool(r, {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                  "stage3_gather_fp16_weights_on_model_save"});
  // Prefetch: one segment ahead, within these limits (docs/zero.md).
  elements({"stage3_prefetch_bucket_size", "prefetch_bucket_size"}, out.prefetch_bucket_size);
  elements({"stage3_max_live_parameters", "max_live_parameters"}, out.max_live_parameters);
  if (const ConfigNode* n = aliased(r, {"stage3_max_reuse_distance", "max_reuse_distance"})) {
    n->as_int();
    if (out.stage == 3)
      diag.note(*n, "has no effect here: every segment is released after its forward and gathered again "
                    "for its backward (the next one prefetched), nothing kept from one to the other");
  }
  if (const ConfigNode* n = aliased(r, {"sub_group_size"})) n->as_int();  // the step is range by range already

  for (const char* k : {"elastic_checkpoint", "log_trace_cache_warnings", "enable_sanity_checks",
                        "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
                        "stage3_module_granularity_threshold", "module_granularity_threshold",
                        "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                        "stage3_allgather_sequential", "cpu_offload_use_pin_memory",
                        "save_muon_momentum_buffer_in_memory"}) {
    r.ignore(k, "a DeepSpeed implementation detail with no counterpart in memrt");
  }
  r.reject_if_true("legacy_stage1", "legacy stage 1 was removed from DeepSpeed too; use \"stage\": 1");
  r.reject_if_true("zero_quantized_weights", "ZeRO++ quantized weights; memrt gathers full-precision weights");
  r.reject_if_true("zero_quantized_gradients", "ZeRO++ quantized gradients; memrt reduces full-precision gradients");
  r.reject_if_true("zero_quantized_nontrainable_weights", "use train.yaml load_in_4bit for frozen 4-bit base weights");
  r.reject_if_true("mics_hierarchical_params_gather", "MiCS; memrt partitions over all data-parallel ranks");
  if (const ConfigNode* n = r.child("zero_hpz_partition_size"); n && !n->is_null() && n->as_int() > 1) {
    throw n->error("is not supported by memrt (ZeRO++ hierarchical partitioning): remove it or set 1");
  }
  if (const ConfigNode* n = r.child("mics_shard_size"); n && !n->is_null() && n->as_int() > 0) {
    throw n->error("is not supported by memrt (MiCS): partitions span all data-parallel ranks; remove it or set -1");
  }
  for (const char* k : {"zeropp_loco_param", "zenflow", "leaf_module"}) {
    if (const ConfigNode* n = r.child(k); n && !n->is_null()) {
      throw n->error("is not supported by memrt: use plain ZeRO stages 1-3 with optional CPU offload");
    }
  }
  if (const ConfigNode* n = r.child("aio")) {
    throw n->error("is misplaced: 'aio' is a top-level ds_config section (and memrt needs no NVMe I/O settings)");
  }
  r.finish();

  return out;
}

}  // namespace memrt::zero
