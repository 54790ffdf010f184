// The built-in optimizers over the parameter store (memrt/param_store.h): Adam / AdamW with
// DeepSpeed's CPU Adam math as one fused pass per parameter range (fused_adam.h), and SGD as
// torch.optim.SGD.
//
// Per parameter with a gradient, the range of it this rank holds (all of it, or its part of this
// rank's partition) is stepped: the gradient, multiplied by StepScalars::grad_factor, updates the
// fp32 master (or the fp32 compute copy), whose value is then written to the compute copy. A
// parameter whose gradient is undefined at step() is skipped and keeps its update count.
// Their state lives in the store (Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer, the
// masters), which checkpoints save as the store; state_dict() holds only "<name>.step" (0-d
// int64: updates received) for each parameter this rank has stepped.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "memrt/optimizer.h"
#include "memrt/param_store.h"

namespace memrt {

// The store options of cfg (which state buffers, the decay group's weight decay). cfg.type
// "Adam" | "AdamW" | "SGD"; throws ConfigError for an unknown type or out-of-range
// hyper-parameters.
StoreOptions store_options(const OptimizerConfig& cfg);

// The step kernels plugins register for their state formats (OptimizerContext::step_kernels).
class StepKernelTable final : public StepKernels {
 public:
  void set(const std::string& format, std::shared_ptr<const StepKernel> kernel) override;
  const StepKernel* find(const std::string& format) const;  // nullptr when none

 private:
  std::map<std::string, std::shared_ptr<const StepKernel>> kernels_;
};

// DeepSpeed's rule: "AdamW", or "Adam" with adam_w_mode true (the default), decays weights
// decoupled (AdamW); "Adam" with adam_w_mode false adds the decay to the gradient (L2). Each
// group's weight decay is the store's. Adam/AdamW hand the ranges of a group whose format has a
// kernel in `kernels` to that kernel (read at each step: plugins register after this call).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store,
                                          std::shared_ptr<const StepKernelTable> kernels = nullptr);

// The built-in step takes the plain state formats (fp32, bf16 moments) and, under Adam/AdamW, those
// with a kernel in `kernels`: an Error naming the group and its format otherwise, saying that the
// plugin that set the format brings the step. The host calls it when the optimizer it built is
// still the one that will step (after build_optimizer).
void check_step_formats(const StorePlan& plan, const std::string& optimizer = "AdamW",
                        const StepKernelTable* kernels = nullptr);

// Where group `group`'s step runs: on the host when its masters or optimizer state are host
// buffers (offload_optimizer: the step's read-modify-write stays where those bytes are, and only
// the compute write-back and, without a host gradient buffer, the gradient cross over), else on
// the device of its compute buffer.
at::Device step_device(const StoreGroup& group, at::Device compute);

// A store planned from `groups` alone (tests, tools): the parameters become views of its
// buffers; 16-bit ones get fp32 masters. A group with weight_decay > 0 is the decay group (all
// such groups must agree), others decay nothing. Throws Error for mismatched names and params or
// a name used twice.
std::shared_ptr<ParamStore> make_param_store(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

// make_optimizer(cfg, make_param_store(cfg, groups)).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups);

}  // namespace memrt
