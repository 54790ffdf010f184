#include "optim/optimizers.h"

#include <cmath>
#include <set>

#include "memrt/error.h"
#include "optim/optimizer_math.h"

#ifdef MEMRT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace memrt {

namespace {

std::string describe(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

// Runs `update(p32, g32)` on fp32 contiguous views of parameter p and its gradient, copying in and
// out only when p is not already fp32 and contiguous.
template <typename Fn>
void with_fp32(const std::string& name, at::Tensor& p, Fn update) {
  const at::Tensor& grad = p.grad();
  if (grad.is_sparse())
    throw Error("optimizer: parameter '" + name + "' has a sparse gradient; only dense ones are supported");
  if (!p.is_floating_point())
    throw Error("optimizer: parameter '" + name + "' is " + std::string(c10::toString(p.scalar_type())) +
                "; expected a floating-point tensor");
  if (grad.sizes() != p.sizes())
    throw Error("optimizer: gradient of '" + name + "' has shape " + describe(grad) +
                ", the parameter " + describe(p));
  at::NoGradGuard no_grad;
  at::Tensor g32 = grad.to(p.device(), at::kFloat).contiguous();
  if (p.scalar_type() == at::kFloat && p.is_contiguous()) {
    update(p, g32);
  } else {
    at::Tensor p32 = p.to(at::kFloat).contiguous();
    update(p32, g32);
    p.copy_(p32);
  }
}

class OptimizerBase : public Optimizer {
 public:
  OptimizerBase(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
    std::set<std::string> seen;
    for (const auto& g : groups_) {
      if (g.names.size() != g.params.size())
        throw Error("optimizer: a parameter group has " + std::to_string(g.names.size()) +
                    " names for " + std::to_string(g.params.size()) + " parameters");
      for (size_t i = 0; i < g.params.size(); ++i) {
        if (!seen.insert(g.names[i]).second)
          throw Error("optimizer: parameter '" + g.names[i] +
                      "' appears twice in the parameter groups; each may be in one group only");
        if (!g.params[i].defined())
          throw Error("optimizer: parameter '" + g.names[i] + "' is an undefined tensor");
      }
    }
  }

  std::vector<ParamGroup>& param_groups() override { return groups_; }
  const std::vector<ParamGroup>& param_groups() const override { return groups_; }

  TensorMap state_dict() const override {
    TensorMap out;
    for (const auto& [key, t] : state_) out[key] = t;
    for (const auto& [name, step] : steps_) out[name + ".step"] = at::scalar_tensor(step, at::kLong);
    return out;
  }

  void load_state_dict(const TensorMap& state) override {
    for (const auto& [key, t] : state) {
      bool known = state_.count(key) > 0;
      if (!known && key.size() > 5 && key.compare(key.size() - 5, 5, ".step") == 0)
        known = steps_.count(key.substr(0, key.size() - 5)) > 0;
      if (!known)
        throw Error(name() + ": unexpected optimizer state '" + key +
                    "' (no parameter of that name, or a state this optimizer does not keep); "
                    "was the checkpoint written with another optimizer or model?");
    }
    for (const auto& [key, t] : state_) {
      auto it = state.find(key);
      if (it == state.end())
        throw Error(name() + ": optimizer state '" + key + "' is missing from the checkpoint");
      if (it->second.sizes() != t.sizes())
        throw Error(name() + ": optimizer state '" + key + "' has shape " + describe(it->second) +
                    ", expected " + describe(t));
    }
    for (const auto& [pname, step] : steps_) {
      auto it = state.find(pname + ".step");
      if (it == state.end())
        throw Error(name() + ": optimizer state '" + pname + ".step' is missing from the checkpoint");
      if (it->second.numel() != 1)
        throw Error(name() + ": optimizer state '" + pname + ".step' must be a scalar, got shape " +
                    describe(it->second));
    }
    at::NoGradGuard no_grad;
    for (auto& [key, t] : state_) t.copy_(state.at(key));
    for (auto& [pname, step] : steps_) step = state.at(pname + ".step").item<int64_t>();
  }

  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (const auto& [key, t] : state_) bytes += t.numel() * static_cast<int64_t>(t.element_size());
    return bytes;
  }

 protected:
  // fn(group, name, param, t) for every parameter with a gradient, t = its update count including
  // this one (parameters without a gradient keep their count, as torch's optimizers do).
  template <class Fn>
  void for_each_update(Fn&& fn) {
    for (auto& g : groups_)
      for (size_t i = 0; i < g.params.size(); ++i) {
        if (!g.params[i].grad().defined()) continue;
        fn(g, g.names[i], g.params[i], ++steps_[g.names[i]]);
      }
  }

  // fp32 zeros of p's shape on p's device, registered as "<name>.<what>".
  at::Tensor& add_state(const std::string& pname, const std::string& what, const at::Tensor& p) {
    at::Tensor t = at::zeros(p.sizes(), p.options().dtype(at::kFloat));  // p's shape, fp32
    return state_[pname + "." + what] = t;
  }

  std::vector<ParamGroup> groups_;
  std::map<std::string, at::Tensor> state_;  // "<param>.<state>" -> tensor
  std::map<std::string, int64_t> steps_;     // "<param>" -> updates received
};

void* cuda_stream_of(const at::Tensor& p, const std::string& name) {
#ifdef MEMRT_WITH_CUDA
  (void)name;
  return c10::cuda::getCurrentCUDAStream(p.device().index()).stream();
#else
  (void)p;
  throw Error("optimizer: parameter '" + name +
              "' is on a CUDA device but this memrt was built without CUDA kernels");
#endif
}

class AdamOptimizer : public OptimizerBase {
 public:
  AdamOptimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups)
      : OptimizerBase(std::move(groups)), cfg_(cfg),
        decoupled_(cfg.type == "AdamW" || cfg.adam_w_mode) {
    for (const auto& g : groups_)
      for (size_t i = 0; i < g.params.size(); ++i) {
        add_state(g.names[i], "exp_avg", g.params[i]);
        add_state(g.names[i], "exp_avg_sq", g.params[i]);
        steps_[g.names[i]] = 0;
      }
  }

  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }

  void step(double lr) override {
    for_each_update([&](const ParamGroup& g, const std::string& pname, at::Tensor& p, int64_t t) {
      const AdamScalars s = adam_scalars(lr, cfg_.beta1, cfg_.beta2, cfg_.eps, g.weight_decay,
                                         decoupled_, cfg_.bias_correction, t);
      at::Tensor& m = state_[pname + ".exp_avg"];
      at::Tensor& v = state_[pname + ".exp_avg_sq"];
      with_fp32(pname, p, [&](at::Tensor& p32, const at::Tensor& g32) {
        float* pp = p32.data_ptr<float>();
        const float* gp = g32.data_ptr<float>();
        if (p32.is_cuda())
          adam_update_cuda(pp, gp, m.data_ptr<float>(), v.data_ptr<float>(), p32.numel(), s,
                           cuda_stream_of(p32, pname));
        else
          adam_update_cpu(pp, gp, m.data_ptr<float>(), v.data_ptr<float>(), p32.numel(), s);
      });
    });
  }

 private:
  OptimizerConfig cfg_;
  bool decoupled_;
};

class SgdOptimizer : public OptimizerBase {
 public:
  SgdOptimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups)
      : OptimizerBase(std::move(groups)), cfg_(cfg) {
    for (const auto& g : groups_)
      for (size_t i = 0; i < g.params.size(); ++i) {
        if (cfg.momentum != 0.0) add_state(g.names[i], "momentum_buffer", g.params[i]);
        steps_[g.names[i]] = 0;
      }
  }

  std::string name() const override { return "SGD"; }

  void step(double lr) override {
    for_each_update([&](const ParamGroup& g, const std::string& pname, at::Tensor& p, int64_t t) {
      SgdScalars s;
      s.lr = static_cast<float>(lr);
      s.momentum = static_cast<float>(cfg_.momentum);
      s.dampening = static_cast<float>(cfg_.dampening);
      s.weight_decay = static_cast<float>(g.weight_decay);
      s.nesterov = cfg_.nesterov;
      s.first_step = t == 1;
      float* buf = nullptr;
      if (cfg_.momentum != 0.0) buf = state_[pname + ".momentum_buffer"].data_ptr<float>();
      with_fp32(pname, p, [&](at::Tensor& p32, const at::Tensor& g32) {
        if (p32.is_cuda())
          sgd_update_cuda(p32.data_ptr<float>(), g32.data_ptr<float>(), buf, p32.numel(), s,
                          cuda_stream_of(p32, pname));
        else
          sgd_update_cpu(p32.data_ptr<float>(), g32.data_ptr<float>(), buf, p32.numel(), s);
      });
    });
  }

 private:
  OptimizerConfig cfg_;
};

void check_range(bool ok, const std::string& key, const std::string& expected, double got) {
  if (!ok)
    throw ConfigError("ds_config", "optimizer.params." + key,
                      "expected " + expected + ", got " + std::to_string(got));
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, std::vector<ParamGroup> groups) {
  check_range(cfg.lr >= 0, "lr", "a learning rate >= 0", cfg.lr);
  if (cfg.type == "Adam" || cfg.type == "AdamW") {
    check_range(cfg.beta1 >= 0 && cfg.beta1 < 1, "betas[0]", "0 <= beta1 < 1", cfg.beta1);
    check_range(cfg.beta2 >= 0 && cfg.beta2 < 1, "betas[1]", "0 <= beta2 < 1", cfg.beta2);
    check_range(cfg.eps >= 0, "eps", "eps >= 0", cfg.eps);
    check_range(cfg.weight_decay >= 0, "weight_decay", "weight_decay >= 0", cfg.weight_decay);
    return std::make_unique<AdamOptimizer>(cfg, std::move(groups));
  }
  if (cfg.type == "SGD") {
    check_range(cfg.momentum >= 0, "momentum", "momentum >= 0", cfg.momentum);
    check_range(cfg.weight_decay >= 0, "weight_decay", "weight_decay >= 0", cfg.weight_decay);
    if (cfg.nesterov && (cfg.momentum <= 0 || cfg.dampening != 0))
      throw ConfigError("ds_config", "optimizer.params.nesterov",
                        "Nesterov momentum requires momentum > 0 and dampening 0 (as torch.optim.SGD)");
    return std::make_unique<SgdOptimizer>(cfg, std::move(groups));
  }
  throw ConfigError("ds_config", "optimizer.type",
                    "unknown optimizer '" + cfg.type + "'; supported: Adam, AdamW, SGD");
}

}  // namespace memrt
