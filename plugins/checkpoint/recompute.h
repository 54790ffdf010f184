// plugins/checkpoint — the functional core: run a function without keeping its intermediates, and
// run it again inside backward. Tensors and autograd only; no host types (testable alone).
//
//   forward:   rng = the generators' state                  # before anything draws from them
//              saved = x  (offload: a host copy, claimed as activations/host)
//              y = fn(x) under no_grad                      # intermediates freed as it goes
//              y.grad_fn = RecomputeBackward(saved, rng, fn)
//   backward:  (dL/dy arrives)
//              now = the generators' state; set them to rng  # dropout draws the same masks
//              x' = saved (back on x's device), detached, requires_grad as x did
//              y' = fn(x') with grad; generators back to now # the stream continues as if no recompute
//              backward(y', dL/dy)   # accumulates the parameters' gradients and x'.grad
//              release saved; return x'.grad as dL/dx
//
// `fn` is called twice: it must compute the same function of x both times, and must still be
// callable when backward runs (the engine's wrapper chain owns its context for that reason).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/MT19937RNGEngine.h>

namespace memrt {
namespace checkpoint {

// The default generators' state, captured without allocating tensors (so the capture never shows
// in the memory report): the CPU generator's Mersenne-Twister engine and cached normal samples;
// for a tensor on a device (a GPU), also the seed and offset of that device's default generator
// (CUDA's Philox offset), read through LibTorch's device-generic generator interface.
class RngState {
 public:
  static RngState capture(const at::Device& device);
  void restore() const;

 private:
  at::mt19937 cpu_engine_;
  std::optional<float> cpu_next_float_normal_;
  std::optional<double> cpu_next_double_normal_;
  std::optional<at::Device> device_;
  uint64_t device_seed_ = 0;
  uint64_t device_offset_ = 0;
};

struct RecomputeOptions {
  bool preserve_rng_state = true;  // restore the generators for the recompute (dropout masks repeat)
  bool offload = false;            // keep the saved input in host memory (cpu_checkpointing)
};

// Wall time spent, for `profile`: forward under no_grad, and recompute + backward of the block.
struct RecomputeTiming {
  double forward_ms = 0.0;
  double recompute_ms = 0.0;
  double backward_ms = 0.0;
  int64_t calls = 0;
};

using BlockFn = std::function<at::Tensor(const at::Tensor&)>;

// y = fn(x), keeping only x for backward, which recomputes fn(x) and backpropagates through it.
// With grad mode off this is just fn(x). `timing`, when given, must outlive the backward.
at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x, const RecomputeOptions& options,
                      RecomputeTiming* timing = nullptr);

}  // namespace checkpoint
}  // namespace memrt
