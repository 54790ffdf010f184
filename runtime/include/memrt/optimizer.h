// memrt/optimizer.h — the optimizer as the engine and plugins see it.
//
// The host builds one from the config (Adam, AdamW, SGD); a plugin may replace or wrap it in the
// optimizer-build phase (8-bit state, partitioned state, state offloaded to host memory).
#pragma once

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
  std::vector<at::Tensor> params;  // leaf tensors updated in place
  double weight_decay = 0.0;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;

  // One update of every parameter that has a gradient, with learning rate `lr`.
  virtual void step(double lr) = 0;
  // Drops every parameter's gradient (sets it undefined: no memory held between steps).
  virtual void zero_grad();

  virtual std::vector<ParamGroup>& param_groups() = 0;
  virtual const std::vector<ParamGroup>& param_groups() const = 0;

  // Checkpoint state, keyed "<param name>.<state name>" plus scalars such as "step".
  virtual TensorMap state_dict() const = 0;
  // Restores state_dict(); an unknown or missing key or a wrong shape is an error naming it.
  virtual void load_state_dict(const TensorMap& state) = 0;
  // Bytes of optimizer state currently held (memory accounting).
  virtual int64_t state_bytes() const = 0;
};

inline void Optimizer::zero_grad() {
  for (auto& group : param_groups())
    for (auto& p : group.params) p.mutable_grad() = at::Tensor();
}

}  // namespace memrt
