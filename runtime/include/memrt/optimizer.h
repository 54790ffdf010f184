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
