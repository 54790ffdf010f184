// The built-in optimizers over the parameter store (memrt/param_store.h): Adam / AdamW with
// DeepSpeed's CPU Adam math as one fused pass per parameter range (fused_adam.h), and SGD as
// torch.optim.SGD.
//
// Per parameter with a gradient, the range of it this rank holds (all of it, or its part of this
// rank's partition) is stepped: the gradient, multiplied by StepScalars::grad_factor, updates the
// fp32 master (or the fp32 compute copy), whose value is then written to the compute copy. A
// parameter whose gradient is undefined at step() is skipped and keeps its update count.
// State (the store's, fp32): Adam "<name>.exp_avg", "<name>.exp_avg_sq"; SGD
// "<name>.momentum_buffer" (only when momentum != 0); the master "exact_weight/<name>"
// (memrt::exact_weight_key) when there is one; "<name>.step" (0-d int64: updates received).
// A partitioned store's state_dict holds this rank's part of each parameter it has a part of
// (1-D where it is not the whole), a partial master under "<name>.master".
#pragma once

#include <memory>
#include <vector>

#include "config/train_config.h"
#include "memrt/optimizer.h"
#include "memrt/param_store.h"

namespace memrt {

// The store options of cfg (which state buffers, the decay group's weight decay). cfg.type
// "Adam" | "AdamW" | "SGD"; throws ConfigError for an unknown type or out-of-range
// hyper-parameters.
StoreOptions store_options(const OptimizerConfig& cfg);

// DeepSpeed's rule: "AdamW", or "Adam" with adam_w_mode true (the default), decays weights
// decoupled (AdamW); "Adam" with adam_w_mode false adds the decay to the gradient (L2). Each
// group's weight decay is the store's.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store);

// The same over a store planned from `groups` alone (tests, tools): the parameters become views
// of its buffers; 16-bit ones get fp32 masters. A group with weight_decay > 0 is the decay group
// (all such groups must agree), others decay nothing. Throws Error for mismatched names and
// params or a name used twice.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

}  // namespace memrt
