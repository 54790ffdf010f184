// The host's parameter groups (docs/parameter-store.md, "Groups"): which trainable parameters
// decay, and the per-group learning rates users write in train.yaml. The estimate and the run both
// plan the store through host_store_plan(), so both see the same groups.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "memrt/param_store.h"

namespace memrt {

// Whether a parameter decays. Hugging Face Trainer's rule (get_decay_parameter_names, transformers
// 5.x): no decay for a name that, lower-cased, contains "bias", "layernorm" or "rmsnorm", has a
// component "norm" or one ending in "_norm", nor for a LayerNorm module's parameters (GPT-2's ln_1,
// ln_2, ln_f: the built-in models' LayerNorm modules are the components starting "ln_"). With a
// ds_config optimizer (decay_all) every parameter decays: DeepSpeed builds one group.
bool decays(const std::string& name, bool decay_all);

// The store plan of `params` (the plugins' plan_params result; `segments` parallel to it) for the
// rank and world size of `options`, with the host's groups: "decay" and "no_decay" by
// ParamInfo::decay, then axolotl's when train.yaml asks for them (OptimizerConfig::groups):
//   "embeddings"  trainable parameters named *embed_tokens*, *lm_head* or
//                 *modules_to_save.default.weight*: weight decay 0, learning rate x
//                 embedding_lr_scale (or embedding_lr / lr), whenever any of the keys is set;
//   <lr_group>    the decaying parameters (of the rest) whose name contains one of its modules:
//                 learning rate x lr_group.lr / lr; the first module that matches, in the order
//                 the lr_groups list them, decides (axolotl's lookup).
// ConfigError naming train.yaml's key when a rule selects no trainable parameter.
StorePlan host_store_plan(const std::vector<ParamInfo>& params, const std::vector<int64_t>& segments,
                          const StoreOptions& options, const OptimizerConfig& optimizer);

}  // namespace memrt
