#include "optim/optimizers.h"

#include <algorithm>
#include <cmath>

#include "memrt/error.h"
#include "memrt/plugin.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"

#ifdef MEMRT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace memrt {

namespace {

// The CUDA stream of a device tensor's step; CPU tensors never get here.
void* cuda_stream(const at::Tensor& t) {
#ifdef MEMRT_WITH_CUDA
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  throw Error("optimizer: the parameters are on " + t.device().str() +
              " but this memrt was built without CUDA kernels");
#endif
}

std::string describe(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

const char kStepKey[] = ".step";
constexpr size_t kStepKeyLength = sizeof(kStepKey) - 1;

// The host's optimizers over the parameter store: per parameter with a gradient, the range of it
// this rank holds (all of it, or its part of this rank's partition) steps in one fused pass over
// the master (or fp32 compute copy), the state and the gradient; each parameter counts its own
// updates (a parameter without a gradient is skipped and keeps its count, as in torch.optim).
class StoreOptimizer : public Optimizer {
 public:
  StoreOptimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store)
      : cfg_(cfg), store_(std::move(store)), steps_(store_->plan().slots().size(), 0) {
    const StorePlan& plan = store_->plan();
    for (const StoreGroup& g : plan.groups()) {
      ParamGroup pg;
      pg.weight_decay = g.weight_decay;
      for (int slot : g.slots) {
        pg.names.push_back(plan.slots()[static_cast<size_t>(slot)].param.name);
        pg.params.push_back(store_->param(slot));
      }
      groups_.push_back(std::move(pg));
    }
  }

  std::vector<ParamGroup>& param_groups() override { return groups_; }
  const std::vector<ParamGroup>& param_groups() const override { return groups_; }

  bool grads_partitioned() const override {
    for (const StoreGroup& g : store_->plan().groups())
      if (g.buffer(StoreBuffer::kMaster).extent == Extent::kPartition ||
          g.buffer(StoreBuffer::kState).extent == Extent::kPartition)
        return true;
    return false;
  }

  GradSummary grad_summary() const override {
    GradSummary out;
    for_each_range([&](int, const at::Tensor& grad, int64_t /*first*/, int64_t n) {
      GradStats s;
      if (grad.is_cuda()) {  // LibTorch's reduction; the CPU kernel is the deterministic one
        s.sum_squares = grad.to(at::kDouble).pow(2).sum().item<double>();
        s.finite = std::isfinite(s.sum_squares);
      } else {
        s = grad_stats_cpu(grad.data_ptr(), grad.scalar_type(), n);
      }
      out.sum_squares += s.sum_squares;
      out.finite = out.finite && s.finite;
    });
    return out;
  }

  // The store's buffers (masters, moments) are saved by the engine with the store; the optimizer's
  // own state is each parameter's update count, for the parameters this rank has stepped.
  TensorMap state_dict() const override {
    TensorMap out;
    const StorePlan& plan = store_->plan();
    for (size_t slot = 0; slot < plan.slots().size(); ++slot)
      if (steps_[slot] > 0) out[plan.slots()[slot].param.name + kStepKey] = at::scalar_tensor(steps_[slot], at::kLong);
    return out;
  }

  // Accepts the counts of any trainable parameter (a checkpoint of another world size gives every
  // saved rank's); a parameter without one has received no update.
  void load_state_dict(const TensorMap& state) override {
    const StorePlan& plan = store_->plan();
    std::vector<int64_t> steps(plan.slots().size(), 0);
    for (const auto& [key, t] : state) {
      const bool is_step = key.size() > kStepKeyLength &&
                           key.compare(key.size() - kStepKeyLength, kStepKeyLength, kStepKey) == 0;
      const int64_t slot = is_step ? plan.find(key.substr(0, key.size() - kStepKeyLength)) : -1;
      if (slot < 0 || plan.slots()[static_cast<size_t>(slot)].group < 0)
        throw Error(name() + ": unexpected optimizer state '" + key +
                    "' (not \"<trainable parameter>.step\"); was the checkpoint written with "
                    "another optimizer or model?");
      if (t.dim() != 0 || t.scalar_type() != at::kLong || t.item<int64_t>() < 0)
        throw Error(name() + ": optimizer state '" + key + "' is not a non-negative int64 scalar");
      steps[static_cast<size_t>(slot)] = t.item<int64_t>();
    }
    steps_ = std::move(steps);
  }

  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (const ParamStore::Group& g : store_->groups())
      for (const at::Tensor& t : g.state) bytes += t.numel() * static_cast<int64_t>(t.element_size());
    return bytes;
  }

 protected:
  // fn(slot, grad, first, n) for each parameter with a gradient and a non-empty range of
  // elements [first, first + n) this rank steps; `grad` holds exactly those n elements
  // (contiguous, 1-D): a range of the parameter's .grad, or of the group's flat gradient
  // partition when the store keeps one (ZeRO-2: every parameter of the partition steps).
  template <class Fn>
  void for_each_range(Fn&& fn) const {
    const StorePlan& plan = store_->plan();
    for (int slot = 0; slot < static_cast<int>(plan.slots().size()); ++slot) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      if (s.group < 0) continue;
      const ParamStore::Group& g = store_->groups()[static_cast<size_t>(s.group)];
      if (g.grad.defined()) {
        auto [grad, first] = store_->slice(slot, StoreBuffer::kGrad);
        if (grad.numel() > 0) fn(slot, grad, first, grad.numel());
        continue;
      }
      const at::Tensor& p = store_->param(slot);
      at::Tensor grad = p.grad();
      if (!grad.defined()) continue;
      check_grad(s, p, grad);
      // The range this rank steps: where its master, else its state, lives (full or partition).
      const StoreBuffer owner = g.master.defined() ? StoreBuffer::kMaster
                                : g.state.empty()  ? StoreBuffer::kCompute
                                                   : StoreBuffer::kState;
      auto [view, first] = store_->slice(slot, owner);
      if (view.numel() == 0) continue;
      fn(slot, grad.contiguous().view({-1}).narrow(0, first, view.numel()), first, view.numel());
    }
  }

  void check_grad(const ParamSlot& s, const at::Tensor& p, const at::Tensor& grad) const {
    if (grad.is_sparse())
      throw Error("optimizer: parameter '" + s.param.name + "' has a sparse gradient; only dense ones are supported");
    if (grad.sizes() != p.sizes())
      throw Error("optimizer: gradient of '" + s.param.name + "' has shape " + describe(grad) +
                  ", the parameter " + describe(p));
    const at::ScalarType want = store_->plan().groups()[static_cast<size_t>(s.group)].buffer(StoreBuffer::kGrad).dtype;
    if (grad.scalar_type() != want && grad.scalar_type() != p.scalar_type())
      throw Error("optimizer: gradient of '" + s.param.name + "' is " + c10::toString(grad.scalar_type()) +
                  "; the store keeps " + c10::toString(want) + " gradients for it");
    if (grad.device() != p.device())
      throw Error("optimizer: gradient of '" + s.param.name + "' is on " + grad.device().str() +
                  ", the parameter on " + p.device().str());
  }

  OptimizerConfig cfg_;
  std::shared_ptr<ParamStore> store_;
  std::vector<ParamGroup> groups_;
  std::vector<int64_t> steps_;  // per slot: updates received
};

class AdamOptimizer final : public StoreOptimizer {
 public:
  AdamOptimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store)
      : StoreOptimizer(cfg, std::move(store)), decoupled_(cfg.type == "AdamW" || cfg.adam_w_mode) {}

  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }

  void step(const StepScalars& scalars) override {
    const StorePlan& plan = store_->plan();
    const float factor = static_cast<float>(scalars.grad_factor);
    for_each_range([&](int slot, const at::Tensor& grad, int64_t first, int64_t n) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      const double wd = plan.groups()[static_cast<size_t>(s.group)].weight_decay;
      const AdamScalars as = adam_scalars(scalars.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, wd,
                                          decoupled_, cfg_.bias_correction,
                                          ++steps_[static_cast<size_t>(slot)]);
      at::Tensor compute = store_->slice(slot, StoreBuffer::kCompute).first.narrow(0, first, n);
      const at::Tensor master = store_->groups()[static_cast<size_t>(s.group)].master.defined()
                                    ? store_->slice(slot, StoreBuffer::kMaster).first
                                    : at::Tensor();
      const AdamRange r = adam_range(master, compute, grad, store_->slice(slot, StoreBuffer::kState, 0).first,
                                     store_->slice(slot, StoreBuffer::kState, 1).first);
      if (compute.is_cuda()) {
#ifdef MEMRT_WITH_CUDA
        fused_adam_cuda(r, as, factor, cuda_stream(compute));
#else
        cuda_stream(compute);  // throws: no CUDA kernels in this build
#endif
      } else {
        fused_adam_cpu(r, as, factor);
      }
    });
  }

 private:
  bool decoupled_;
};

class SgdOptimizer final : public StoreOptimizer {
 public:
  using StoreOptimizer::StoreOptimizer;
  std::string name() const override { return "SGD"; }

  void step(const StepScalars& scalars) override {
    const StorePlan& plan = store_->plan();
    at::NoGradGuard no_grad;
    for_each_range([&](int slot, const at::Tensor& grad, int64_t first, int64_t n) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      SgdScalars ss;
      ss.lr = static_cast<float>(scalars.lr);
      ss.momentum = static_cast<float>(cfg_.momentum);
      ss.dampening = static_cast<float>(cfg_.dampening);
      ss.weight_decay = static_cast<float>(plan.groups()[static_cast<size_t>(s.group)].weight_decay);
      ss.nesterov = cfg_.nesterov;
      ss.first_step = ++steps_[static_cast<size_t>(slot)] == 1;
      const bool master = store_->groups()[static_cast<size_t>(s.group)].master.defined();
      at::Tensor compute = store_->slice(slot, StoreBuffer::kCompute).first.narrow(0, first, n);
      at::Tensor p = master ? store_->slice(slot, StoreBuffer::kMaster).first : compute;
      at::Tensor g = grad.to(at::kFloat);
      if (scalars.grad_factor != 1.0) g = g * static_cast<float>(scalars.grad_factor);
      float* buf = cfg_.momentum != 0.0 ? store_->slice(slot, StoreBuffer::kState, 0).first.data_ptr<float>() : nullptr;
      if (p.is_cuda()) {
#ifdef MEMRT_WITH_CUDA
        sgd_update_cuda(p.data_ptr<float>(), g.data_ptr<float>(), buf, n, ss, cuda_stream(p));
#else
        cuda_stream(p);  // throws: no CUDA kernels in this build
#endif
      } else {
        sgd_update_cpu(p.data_ptr<float>(), g.data_ptr<float>(), buf, n, ss);
      }
      if (master) compute.copy_(p);
    });
  }
};

void check_range(bool ok, const std::string& key, const std::string& expected, double got) {
  if (!ok)
    throw ConfigError("ds_config", "optimizer.params." + key,
                      "expected " + expected + ", got " + std::to_string(got));
}

void check_config(const OptimizerConfig& cfg) {
  check_range(cfg.lr >= 0, "lr", "a learning rate >= 0", cfg.lr);
  if (cfg.type == "Adam" || cfg.type == "AdamW") {
    check_range(cfg.beta1 >= 0 && cfg.beta1 < 1, "betas[0]", "0 <= beta1 < 1", cfg.beta1);
    check_range(cfg.beta2 >= 0 && cfg.beta2 < 1, "betas[1]", "0 <= beta2 < 1", cfg.beta2);
    check_range(cfg.eps >= 0, "eps", "eps >= 0", cfg.eps);
    check_range(cfg.weight_decay >= 0, "weight_decay", "weight_decay >= 0", cfg.weight_decay);
    return;
  }
  if (cfg.type == "SGD") {
    check_range(cfg.momentum >= 0, "momentum", "momentum >= 0", cfg.momentum);
    check_range(cfg.weight_decay >= 0, "weight_decay", "weight_decay >= 0", cfg.weight_decay);
    if (cfg.nesterov && (cfg.momentum <= 0 || cfg.dampening != 0))
      throw ConfigError("ds_config", "optimizer.params.nesterov",
                        "Nesterov momentum requires momentum > 0 and dampening 0 (as torch.optim.SGD)");
    return;
  }
  throw ConfigError("ds_config", "optimizer.type",
                    "unknown optimizer '" + cfg.type + "'; supported: Adam, AdamW, SGD");
}

}  // namespace

AdamRange adam_range(const at::Tensor& master, const at::Tensor& compute, const at::Tensor& grad,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  const int64_t n = compute.numel();
  for (const at::Tensor* t : {&master, &grad, &exp_avg, &exp_avg_sq}) {
    if (t->defined() && (t->numel() != n || !t->is_contiguous()))
      throw Error("fused Adam step: the buffers of one range must be contiguous and of one length");
  }
  AdamRange r;
  r.master = master.defined() ? master.data_ptr<float>() : nullptr;
  r.compute = compute.data_ptr();
  r.compute_type = compute.scalar_type();
  r.grad = grad.data_ptr();
  r.grad_type = grad.scalar_type();
  r.exp_avg = exp_avg.data_ptr<float>();
  r.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  r.n = n;
  return r;
}

StoreOptions store_options(const OptimizerConfig& cfg) {
  check_config(cfg);
  StoreOptions o;
  o.optimizer = cfg.type;
  o.momentum = cfg.momentum;
  o.weight_decay = cfg.weight_decay;
  return o;
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store) {
  check_config(cfg);
  if (store->plan().options().optimizer != cfg.type) {
    throw Error("optimizer: the store was planned for " + store->plan().options().optimizer +
                "'s state, not " + cfg.type + "'s");
  }
  if (cfg.type == "SGD") return std::make_unique<SgdOptimizer>(cfg, std::move(store));
  return std::make_unique<AdamOptimizer>(cfg, std::move(store));
}

std::shared_ptr<ParamStore> make_param_store(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  StoreOptions options = store_options(cfg);
  std::vector<ParamInfo> infos;
  std::vector<std::pair<std::string, at::Tensor>> params;
  bool decay_set = false, sixteen = false;
  for (const ParamGroup& g : groups) {
    if (g.names.size() != g.params.size())
      throw Error("optimizer: a parameter group has " + std::to_string(g.names.size()) +
                  " names for " + std::to_string(g.params.size()) + " parameters");
    const bool decay = g.weight_decay > 0;
    if (decay && decay_set && options.weight_decay != g.weight_decay)
      throw Error("optimizer: parameter groups decay by different amounts; the store keeps one "
                  "decaying group");
    if (decay) {
      options.weight_decay = g.weight_decay;
      decay_set = true;
    }
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (!g.params[i].defined())
        throw Error("optimizer: parameter '" + g.names[i] + "' is an undefined tensor");
      for (const auto& seen : params)
        if (seen.first == g.names[i])
          throw Error("optimizer: parameter '" + g.names[i] +
                      "' appears twice in the parameter groups; each may be in one group only");
      infos.push_back({g.names[i], g.params[i].sizes().vec(), g.params[i].scalar_type(), true, decay});
      params.emplace_back(g.names[i], g.params[i]);
      sixteen = sixteen || g.params[i].scalar_type() != at::kFloat;
    }
  }
  StorePlan plan(infos, options);
  if (sixteen) plan.set_master_weights(true);
  const at::Device device = params.empty() ? at::Device(at::kCPU) : params.front().second.device();
  return std::make_shared<ParamStore>(std::move(plan), params, device);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  return make_optimizer(cfg, make_param_store(cfg, std::move(groups)));
}

}  // namespace memrt
