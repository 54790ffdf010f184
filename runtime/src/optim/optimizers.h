// The built-in optimizers: Adam / AdamW with DeepSpeed's CPU Adam math, and SGD as torch.optim.SGD.
//
// State per parameter, created when the optimizer is built: Adam "<name>.exp_avg",
// "<name>.exp_avg_sq" (fp32, the parameter's shape and device); SGD "<name>.momentum_buffer" (fp32,
// only when momentum != 0); both "<name>.step" (0-d int64: the updates this parameter received).
// A parameter whose gradient is undefined at step() is skipped, its step count unchanged.
// Parameters of any floating dtype are updated in fp32 (state is always fp32); CUDA parameters
// take the CUDA kernels in builds with CUDA.
#pragma once

#include <memory>
#include <vector>

#include "config/train_config.h"
#include "memrt/optimizer.h"

namespace memrt {

// cfg.type "Adam" | "AdamW" | "SGD". DeepSpeed's rule: "AdamW", or "Adam" with adam_w_mode true
// (the default), decays weights decoupled (AdamW); "Adam" with adam_w_mode false adds the decay
// to the gradient (L2). Each group's weight_decay is used as given: the caller fills it (normally
// from cfg.weight_decay; 0 for groups that must not decay). Throws ConfigError for an unknown type
// or out-of-range hyper-parameters, Error for mismatched names/params or a name used twice.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

}  // namespace memrt
