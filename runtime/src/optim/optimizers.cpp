#include "optim/optimizers.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "memrt/error.h"
#include "memrt/plugin.h"
#include "optim/fused_adam.h"
#include "optim/optimizer_math.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace memrt {

namespace {

// The seed of one update's stochastic rounding of one parameter.
uint64_t random_bits_seed(uint64_t run_seed, uint64_t slot, uint64_t update) {
  return run_seed * 0x100000001b3ull ^ (slot << 40) ^ update;
}

// The CUDA stream of a device tensor's step (a cudaStream_t, through LibTorch's device-generic
// guard: memrt links only LibTorch's CPU libraries); CPU tensors never get here.
void* cuda_stream(const at::Tensor& t) {
#ifdef MEMRT_WITH_CUDA
  return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()).native_handle();
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
  StoreOptimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store,
                 std::shared_ptr<const StepKernelTable> kernels)
      : cfg_(cfg), store_(std::move(store)), kernels_(std::move(kernels)), steps_(store_->plan().slots().size(), 0) {
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
    const StorePlan& plan = store_->plan();
    for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g)
      if (plan.step_range(g).size() != plan.groups()[static_cast<size_t>(g)].padded) return true;
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

 protected:
  // fn(slot, grad, first, n) for each parameter with a gradient and a non-empty range of
  // elements [first, first + n) this rank steps; `grad` holds exactly those n elements
  // (contiguous, 1-D): a range of the parameter's .grad, or of the group's flat gradient when the
  // store keeps one (ZeRO-2's partition, fp32 accumulation's full buffer: every parameter of the
  // range steps).
  template <class Fn>
  void for_each_range(Fn&& fn) const {
    const StorePlan& plan = store_->plan();
    for (int slot = 0; slot < static_cast<int>(plan.slots().size()); ++slot) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      if (s.group < 0) continue;
      // The part of the parameter in this rank's step range (all of it, or its partition's part).
      const ElementRange mine = plan.range(slot) & plan.step_range(s.group);
      if (mine.empty()) continue;
      const ParamStore::Group& g = store_->groups()[static_cast<size_t>(s.group)];
      at::Tensor grad;  // the parameter's whole flat gradient, or the part of it this rank holds
      int64_t held_from = 0;
      if (g.grad.defined()) {
        std::tie(grad, held_from) = store_->slice(slot, StoreBuffer::kGrad);
      } else {
        const at::Tensor& p = store_->param(slot);
        if (!p.grad().defined()) continue;
        check_grad(s, p, p.grad());
        grad = p.grad().contiguous().view({-1});
      }
      const int64_t first = mine.begin - s.offset;
      fn(slot, grad.narrow(0, first - held_from, mine.size()), first, mine.size());
    }
  }

  // The parameter's elements [first, first + n) of buffer b (not a state tensor), which this rank
  // holds: the whole parameter of a full buffer, or its part in this rank's partition.
  at::Tensor held(int slot, StoreBuffer b, int64_t first, int64_t n) const {
    const auto [view, from] = store_->slice(slot, b);
    return view.narrow(0, first - from, n);
  }

  // Counts one update for every parameter with a gradient this step (with a flat gradient
  // partition, every parameter of the group), whether or not this rank holds a range of it: each
  // rank keeps every parameter's count, so its checkpoint file holds them all and a resume under
  // another stage or partitioning restarts no parameter's bias correction.
  void count_updates() {
    const StorePlan& plan = store_->plan();
    for (int slot = 0; slot < static_cast<int>(plan.slots().size()); ++slot) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      if (s.group < 0) continue;
      if (store_->groups()[static_cast<size_t>(s.group)].grad.defined() || store_->param(slot).grad().defined())
        ++steps_[static_cast<size_t>(slot)];
    }
  }

  // The plan is fixed once the store exists: its formats are checked at the first step only.
  void check_formats() {
    if (formats_checked_) return;
    check_step_formats(store_->plan(), cfg_.type, kernels_.get());
    formats_checked_ = true;
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
  std::shared_ptr<const StepKernelTable> kernels_;  // may be null: no plugin formats
  std::vector<ParamGroup> groups_;
  std::vector<int64_t> steps_;  // per slot: updates received
  bool formats_checked_ = false;
};

class AdamOptimizer final : public StoreOptimizer {
 public:
  AdamOptimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store,
                std::shared_ptr<const StepKernelTable> kernels)
      : StoreOptimizer(cfg, std::move(store), std::move(kernels)), decoupled_(cfg.type == "AdamW" || cfg.adam_w_mode) {}

  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }

  void step(const StepScalars& scalars) override {
    const StorePlan& plan = store_->plan();
    check_formats();  // also when a plugin's wrapper delegates to this step
    const float factor = static_cast<float>(scalars.grad_factor);
    count_updates();
    for_each_range([&](int slot, const at::Tensor& grad, int64_t first, int64_t n) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      const StoreGroup& group = plan.groups()[static_cast<size_t>(s.group)];
      const double wd = group.weight_decay;
      const AdamScalars as = adam_scalars(scalars.lr * group.lr_scale, cfg_.beta1, cfg_.beta2, cfg_.eps, wd,
                                          decoupled_, cfg_.bias_correction,
                                          steps_[static_cast<size_t>(slot)]);
      at::Tensor compute = held(slot, StoreBuffer::kCompute, first, n);
      const at::Tensor master = store_->groups()[static_cast<size_t>(s.group)].master.defined()
                                    ? store_->slice(slot, StoreBuffer::kMaster).first
                                    : at::Tensor();
      const StoreGroup& group_plan = plan.groups()[static_cast<size_t>(s.group)];
      if (const StepKernel* kernel = kernels_ ? kernels_->find(plan.state_format(s.group).name) : nullptr) {
        step_with(*kernel, slot, grad, first, n, scalars, compute, master);
        return;
      }
      const at::Tensor exp_avg = store_->slice(slot, StoreBuffer::kState, 0).first;
      const at::Tensor exp_avg_sq = store_->slice(slot, StoreBuffer::kState, 1).first;
      // Stochastic rounding's draws: one stream per (run seed, parameter, update), indexed by the
      // element's position in the parameter, so every partitioning of it draws the same bits.
      auto with_rounding = [&](AdamRange r) {
        r.stochastic_round = cfg_.bf16_stochastic_round && !master.defined() && compute.scalar_type() == at::kBFloat16;
        r.seed = random_bits_seed(cfg_.seed, static_cast<uint64_t>(slot), static_cast<uint64_t>(steps_[static_cast<size_t>(slot)]));
        r.first = first;
        return r;
      };
      if (step_device(group_plan, compute.device()).is_cuda()) {
#ifdef MEMRT_WITH_CUDA
        fused_adam_cuda(with_rounding(adam_range(master, compute, grad, exp_avg, exp_avg_sq)), as, factor, cuda_stream(compute));
#else
        cuda_stream(compute);  // throws: no CUDA kernels in this build
#endif
        return;
      }
      // On the host; a device compute copy or gradient crosses over (offload on a GPU build).
      const at::Tensor host_grad = grad.is_cpu() ? grad : grad.to(at::kCPU);
      at::Tensor host_compute = compute.is_cpu() ? compute : compute.to(at::kCPU);
      fused_adam_cpu(with_rounding(adam_range(master, host_compute, host_grad, exp_avg, exp_avg_sq)), as, factor);
      if (!compute.is_cpu()) compute.copy_(host_compute);
    });
  }

 private:
  // One range through a plugin's kernel: on the device the step runs on (the host's when the
  // group is offloaded), the compute copy and gradient crossing over as for the built-in kernel.
  void step_with(const StepKernel& kernel, int slot, const at::Tensor& grad, int64_t first, int64_t n,
                 const StepScalars& scalars, const at::Tensor& compute, const at::Tensor& master) const {
    const StorePlan& plan = store_->plan();
    const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
    const StoreGroup& group = plan.groups()[static_cast<size_t>(s.group)];
    const bool on_host = !step_device(group, compute.device()).is_cuda();
    StepRange r;
    r.param = &s.param;
    r.first = first;
    r.n = n;
    r.compute = on_host && !compute.is_cpu() ? compute.to(at::kCPU) : compute;
    r.master = master;
    r.grad = on_host && !grad.is_cpu() ? grad.to(at::kCPU) : grad;
    for (size_t k = 0; k < plan.state_format(s.group).tensors.size(); ++k)
      r.state.push_back(store_->slice(slot, StoreBuffer::kState, static_cast<int>(k)).first);
    r.grad_factor = static_cast<float>(scalars.grad_factor);
    r.step = steps_[static_cast<size_t>(slot)];
    r.lr = scalars.lr * group.lr_scale;
    r.weight_decay = group.weight_decay;
    r.beta1 = cfg_.beta1;
    r.beta2 = cfg_.beta2;
    r.eps = cfg_.eps;
    r.decoupled = decoupled_;
    r.bias_correction = cfg_.bias_correction;
    kernel.step(r);
    if (!r.compute.is_same(compute)) compute.copy_(r.compute);
  }

  bool decoupled_;
};

class SgdOptimizer final : public StoreOptimizer {
 public:
  using StoreOptimizer::StoreOptimizer;
  std::string name() const override { return "SGD"; }

  void step(const StepScalars& scalars) override {
    const StorePlan& plan = store_->plan();
    check_formats();  // also when a plugin's wrapper delegates to this step
    at::NoGradGuard no_grad;
    count_updates();
    for_each_range([&](int slot, const at::Tensor& grad, int64_t first, int64_t n) {
      const ParamSlot& s = plan.slots()[static_cast<size_t>(slot)];
      SgdScalars ss;
      ss.lr = static_cast<float>(scalars.lr * plan.groups()[static_cast<size_t>(s.group)].lr_scale);
      ss.momentum = static_cast<float>(cfg_.momentum);
      ss.dampening = static_cast<float>(cfg_.dampening);
      ss.weight_decay = static_cast<float>(plan.groups()[static_cast<size_t>(s.group)].weight_decay);
      ss.nesterov = cfg_.nesterov;
      ss.first_step = steps_[static_cast<size_t>(slot)] == 1;
      const bool master = store_->groups()[static_cast<size_t>(s.group)].master.defined();
      at::Tensor compute = held(slot, StoreBuffer::kCompute, first, n);
      at::Tensor p = master ? store_->slice(slot, StoreBuffer::kMaster).first : compute;
      at::Tensor g = grad.to(at::kFloat);
      if (scalars.grad_factor != 1.0) g = g * static_cast<float>(scalars.grad_factor);
      float* buf = cfg_.momentum != 0.0 ? store_->slice(slot, StoreBuffer::kState, 0).first.data_ptr<float>() : nullptr;
      if (step_device(plan.groups()[static_cast<size_t>(s.group)], compute.device()).is_cuda()) {
#ifdef MEMRT_WITH_CUDA
        sgd_update_cuda(p.data_ptr<float>(), g.data_ptr<float>(), buf, n, ss, cuda_stream(p));
#else
        cuda_stream(p);  // throws: no CUDA kernels in this build
#endif
      } else {
        // On the host; a device parameter (fp32 without a master) or gradient crosses over.
        const at::Tensor host_g = g.is_cpu() ? g : g.to(at::kCPU);
        at::Tensor host_p = p.is_cpu() ? p : p.to(at::kCPU);
        sgd_update_cpu(host_p.data_ptr<float>(), host_g.data_ptr<float>(), buf, n, ss);
        if (!p.is_cpu()) p.copy_(host_p);
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

void StepKernelTable::set(const std::string& format, std::shared_ptr<const StepKernel> kernel) {
  if (!kernel) throw Error("step kernels: the kernel for format '" + format + "' is null");
  if (format == "fp32" || format == "bf16")
    throw Error("step kernels: '" + format + "' is the built-in step's own format; give the plugin's "
                "format a name of its own (StateFormat::name)");
  if (!kernels_.emplace(format, std::move(kernel)).second)
    throw Error("step kernels: format '" + format + "' already has a kernel; one plugin owns each format");
}

const StepKernel* StepKernelTable::find(const std::string& format) const {
  const auto it = kernels_.find(format);
  return it == kernels_.end() ? nullptr : it->second.get();
}

void check_step_formats(const StorePlan& plan, const std::string& optimizer, const StepKernelTable* kernels) {
  const bool adam = optimizer == "Adam" || optimizer == "AdamW";
  for (int g = 0; g < static_cast<int>(plan.groups().size()); ++g) {
    const StateFormat& f = plan.state_format(g);
    if (adam && kernels && kernels->find(f.name)) continue;
    if (f.is_plain() && (f.name == "fp32" || f.name == "bf16")) continue;
    throw Error("optimizer: group '" + plan.groups()[static_cast<size_t>(g)].name + "' keeps its state as '" +
                f.name + "', which the built-in " + optimizer + " step has no kernel for (it steps fp32 and bf16 " +
                "moments); the plugin that set that format must register its kernel " +
                "(OptimizerContext::step_kernels, Adam/AdamW) or replace the optimizer in build_optimizer");
  }
}

at::Device step_device(const StoreGroup& group, at::Device compute) {
  for (StoreBuffer b : {StoreBuffer::kMaster, StoreBuffer::kState}) {
    const BufferLayout& l = group.buffer(b);
    if (l.present && l.placement == memory::Placement::kHost) return at::kCPU;
  }
  return compute;
}

AdamRange adam_range(const at::Tensor& master, const at::Tensor& compute, const at::Tensor& grad,
                     const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  const int64_t n = compute.numel();
  for (const at::Tensor* t : {&master, &grad, &exp_avg, &exp_avg_sq}) {
    if (t->defined() && (t->numel() != n || !t->is_contiguous()))
      throw Error("fused Adam step: the buffers of one range must be contiguous and of one length");
  }
  if (exp_avg.scalar_type() != exp_avg_sq.scalar_type())
    throw Error("fused Adam step: exp_avg and exp_avg_sq must share a dtype");
  AdamRange r;
  r.master = master.defined() ? master.data_ptr<float>() : nullptr;
  r.compute = compute.data_ptr();
  r.compute_type = compute.scalar_type();
  r.grad = grad.data_ptr();
  r.grad_type = grad.scalar_type();
  r.exp_avg = exp_avg.data_ptr();
  r.exp_avg_sq = exp_avg_sq.data_ptr();
  r.state_type = exp_avg.scalar_type();
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

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::shared_ptr<ParamStore> store,
                                          std::shared_ptr<const StepKernelTable> kernels) {
  check_config(cfg);
  if (store->plan().options().optimizer != cfg.type) {
    throw Error("optimizer: the store was planned for " + store->plan().options().optimizer +
                "'s state, not " + cfg.type + "'s");
  }
  bool in_place_bf16 = false;
  for (const StoreGroup& g : store->plan().groups()) {
    const bool masterless16 = !g.buffer(StoreBuffer::kMaster).present && g.buffer(StoreBuffer::kCompute).dtype != at::kFloat;
    in_place_bf16 = in_place_bf16 || masterless16;
    if (cfg.type == "SGD" && (masterless16 || (g.buffer(StoreBuffer::kState).present && g.buffer(StoreBuffer::kState).dtype != at::kFloat)))
      throw ConfigError("ds_config", "optimizer.type",
                        "SGD updates 16-bit weights through fp32 masters and keeps an fp32 momentum: "
                        "bf16_master_weights_and_grads and bf16_optimizer_states are for Adam/AdamW");
  }
  if (cfg.bf16_stochastic_round && !in_place_bf16)
    throw ConfigError("ds_config", "optimizer.params.bf16_stochastic_round",
                      "rounds bf16 weights that the step updates without fp32 masters; set "
                      "\"bf16\": {\"enabled\": true, \"bf16_master_weights_and_grads\": true} or remove it");
  if (cfg.type == "SGD") return std::make_unique<SgdOptimizer>(cfg, std::move(store), std::move(kernels));
  return std::make_unique<AdamOptimizer>(cfg, std::move(store), std::move(kernels));
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
