// memrt/optimizer.h — the optimizer as the engine and plugins see it.
//
// The host builds one from the config (Adam, AdamW, SGD) over the parameter store
// (memrt/param_store.h): a fused step per group over the masters and state this rank holds. A
// plugin may replace or wrap it in the optimizer-build phase.
//
// The engine's step, each optimizer step (docs/parameter-store.md, "The step"):
//   s = grad_summary()                  pass 1: sum of squares and finiteness, as the grads hold them
//   all-reduce s across ranks if grads_partitioned()
//   norm = sqrt(s.sum_squares) / grad_scale; plugins vote to skip (e.g. on !s.finite)
//   step({lr, grad_factor = 1 / (grad_scale * max(1, clip))})   pass 2, with the unscale and clip
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace memrt {

// Named tensors: parameters, optimizer state, plugin state. Scalars are 0-d tensors.
using TensorMap = std::map<std::string, at::Tensor>;

struct ParamGroup {
  std::vector<std::string> names;  // Hugging Face names, parallel to `params`
  std::vector<at::Tensor> params;  // the model's parameters (leaf tensors), updated in place
  double weight_decay = 0.0;
};

// Pass 1 of the step over the gradient elements this rank steps.
struct GradSummary {
  double sum_squares = 0.0;  // of the gradients as stored (before unscaling), summed in double
  bool finite = true;        // no inf or NaN among them
};

struct StepScalars {
  double lr = 0.0;
  // Every gradient is multiplied by this before the update: 1 / (loss scale * clip coefficient).
  double grad_factor = 1.0;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;

  // Pass 1. The default reads every parameter's .grad in param_groups().
  virtual GradSummary grad_summary() const;
  // True when grad_summary() covers only this rank's partition (the host sums it across ranks).
  virtual bool grads_partitioned() const { return false; }
  // One update of every parameter that has a gradient.
  virtual void step(const StepScalars& scalars) = 0;
  // Drops every parameter's gradient (sets it undefined: no memory held between steps).
  virtual void zero_grad();

  virtual std::vector<ParamGroup>& param_groups() = 0;
  virtual const std::vector<ParamGroup>& param_groups() const = 0;

  // Checkpoint state beyond the parameter store's buffers (which the engine saves with the store),
  // keyed "<param name>.<state name>", e.g. "<name>.step". Keys are per parameter: resumed on
  // another number of ranks, every rank is given the union of all saved ranks' entries.
  virtual TensorMap state_dict() const = 0;
  // Restores state_dict(); an unknown key or a wrong shape is an error naming it.
  virtual void load_state_dict(const TensorMap& state) = 0;
};

// ---- ABI 2.5: a state format's step kernel ----------------------------------------------------
// The built-in Adam/AdamW step over the parameter store walks every range of a parameter this rank
// steps (its partition under ZeRO, host buffers under offload, per-parameter update counts, the
// gradient wherever the store keeps it) and updates it with DeepSpeed's CPU Adam on fp32 or bf16
// moments. A plugin that gives a group another state format (plugins/quant: 8-bit and 4-bit
// moments) registers that format's kernel in build_optimizer (OptimizerContext::step_kernels); the
// step then hands each range of such a group to the kernel, with everything the update needs.
struct ParamInfo;

struct StepRange {
  const ParamInfo* param = nullptr;  // the parameter (name, shape), for messages
  // Elements [first, first + n) of the parameter. With a blockwise format `first` is a multiple of
  // the block: parameters start on block boundaries and partitions hold whole blocks.
  int64_t first = 0;
  int64_t n = 0;
  at::Tensor compute;  // n elements of the compute copy: write the updated value here
  at::Tensor master;   // n fp32 elements, or undefined (then the compute copy is the value updated)
  at::Tensor grad;     // n elements, as stored (any floating dtype): the update uses grad * grad_factor
  // One per tensor of the group's StateFormat, the values covering the range (StateTensor::per_value).
  std::vector<at::Tensor> state;
  float grad_factor = 1.f;
  int64_t step = 1;          // the parameter's update count, this update included
  double lr = 0.0;           // the schedule's learning rate times the group's lr_scale
  double weight_decay = 0.0; // the group's
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool decoupled = true;     // AdamW's decay of the weight (false: Adam's L2 term in the gradient)
  bool bias_correction = true;
};

class StepKernel {
 public:
  virtual ~StepKernel() = default;
  // Updates one range in place. Tensors are on the device the step runs on: the host's when the
  // group's master or state is offloaded or the model is on the CPU.
  virtual void step(const StepRange& range) const = 0;
};

class StepKernels {
 public:
  virtual ~StepKernels() = default;
  // The kernel for groups whose StateFormat is named `format`. A format registered twice, or one of
  // the built-in step's own ("fp32", "bf16"), is an error.
  virtual void set(const std::string& format, std::shared_ptr<const StepKernel> kernel) = 0;
};

inline GradSummary Optimizer::grad_summary() const {
  GradSummary s;
  for (const auto& group : param_groups())
    for (const auto& p : group.params) {
      if (!p.grad().defined()) continue;
      const double n = p.grad().to(at::kDouble).pow(2).sum().item<double>();
      s.sum_squares += n;
    }
  s.finite = std::isfinite(s.sum_squares);
  return s;
}

inline void Optimizer::zero_grad() {
  for (auto& group : param_groups())
    for (auto& p : group.params) p.mutable_grad() = at::Tensor();
}

}  // namespace memrt
