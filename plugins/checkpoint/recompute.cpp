// plugins/checkpoint — recompute in backward (see recompute.h for the sequence).
#include "recompute.h"

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memrt/memory.h>

namespace memrt {
namespace checkpoint {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The grad_fn of a checkpointed output: holds the input, the generators' state and the function.
class RecomputeBackward final : public torch::autograd::Node {
 public:
  RecomputeBackward(BlockFn fn, at::Tensor saved, bool input_requires_grad, at::Device device,
                    std::optional<RngState> rng, RecomputeTiming* timing)
      : fn_(std::move(fn)), saved_(std::move(saved)), saved_version_(saved_._version()),
        input_requires_grad_(input_requires_grad), device_(device), rng_(std::move(rng)),
        timing_(timing) {}

  std::string name() const override { return "memrt::checkpoint::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!saved_.defined()) {
      throw std::runtime_error("activation checkpointing: a checkpointed block's backward ran "
                               "twice (backward through the graph a second time is not supported; "
                               "its saved input was already released)");
    }
    if (saved_._version() != saved_version_) {
      throw std::runtime_error("activation checkpointing: a checkpointed block's input was modified "
                               "in place after the block's forward; the recompute would differ");
    }
    const auto t0 = Clock::now();
    at::Tensor x = (saved_.device() == device_ ? saved_ : saved_.to(device_)).detach();
    x.requires_grad_(input_requires_grad_);
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      std::optional<RngState> now;
      if (rng_) {
        now = RngState::capture(device_);
        rng_->restore();
      }
      y = fn_(x);
      if (now) now->restore();
    }
    const auto t1 = Clock::now();
    if (y.requires_grad()) torch::autograd::backward({y}, {grads[0]});
    y.reset();
    at::Tensor dx = input_requires_grad_ ? x.grad() : at::Tensor();
    release_variables();
    if (timing_) {
      timing_->recompute_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
      timing_->backward_ms += ms_since(t1);
    }
    return {dx};
  }

  // Autograd calls this after apply() unless the graph is retained; the engine keeps the loss
  // (and so this node) alive until the micro-step ends, so the input must go here.
  void release_variables() override { saved_.reset(); }

 private:
  BlockFn fn_;
  at::Tensor saved_;
  uint32_t saved_version_;
  bool input_requires_grad_;
  at::Device device_;
  std::optional<RngState> rng_;
  RecomputeTiming* timing_;
};

}  // namespace

RngState RngState::capture(const at::Device& device) {
  RngState s;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
    s.cpu_engine_ = cpu->engine();
    s.cpu_next_float_normal_ = cpu->next_float_normal_sample();
    s.cpu_next_double_normal_ = cpu->next_double_normal_sample();
  }
  if (!device.is_cpu()) {
    // Through GeneratorImpl's own interface: for CUDA, the seed and the Philox offset.
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.device_ = device;
    s.device_seed_ = gen.current_seed();
    s.device_offset_ = gen.get_offset();
  }
  return s;
}

void RngState::restore() const {
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
    cpu->set_engine(cpu_engine_);
    cpu->set_next_float_normal_sample(cpu_next_float_normal_);
    cpu->set_next_double_normal_sample(cpu_next_double_normal_);
  }
  if (device_) {
    at::Generator gen = at::globalContext().defaultGenerator(*device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(device_seed_);  // resets the offset; set it after
    gen.set_offset(device_offset_);
  }
}

namespace {

// LibTorch 2.13 holds autograd nodes in c10::intrusive_ptr, earlier 2.x releases in std::shared_ptr:
// a node is made the way this LibTorch's set_history() takes it.
template <typename T, typename = void>
struct HistoryTakesIntrusive : std::false_type {};
template <typename T>
struct HistoryTakesIntrusive<T, std::void_t<decltype(torch::autograd::set_history(
                                    std::declval<const at::Tensor&>(), std::declval<const c10::intrusive_ptr<T>&>()))>>
    : std::true_type {};

template <typename N, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (HistoryTakesIntrusive<torch::autograd::Node>::value) {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<N>(std::forward<Args>(args)...);
  }
}

}  // namespace

at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x, const RecomputeOptions& options,
                      RecomputeTiming* timing) {
  if (!at::GradMode::is_enabled()) return fn(x);
  const auto t0 = Clock::now();
  std::optional<RngState> rng;
  if (options.preserve_rng_state) rng = RngState::capture(x.device());
  at::Tensor saved = x.detach();
  if (options.offload) {
    // On a CPU device the input already is host memory: keep that storage (a copy would only add
    // a transient) and count it as offloaded. Elsewhere, a host copy.
    if (!saved.device().is_cpu()) saved = saved.to(at::kCPU);
    memory::claim(saved, memory::Category::kActivations, memory::Placement::kHost);
  }
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = fn(x);
  }
  if (!y.defined() || y.is_alias_of(x)) return fn(x);  // nothing to save: run it normally
  auto node = make_node<RecomputeBackward>(fn, std::move(saved), x.requires_grad(), x.device(), std::move(rng), timing);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(y, node);
  if (timing) {
    timing->forward_ms += ms_since(t0);
    ++timing->calls;
  }
  return y;
}

}  // namespace checkpoint
}  // namespace memrt
