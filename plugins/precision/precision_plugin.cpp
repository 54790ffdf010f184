// plugins/precision — fp16 with DeepSpeed's dynamic loss scaling, bf16, fp32 master weights.
//
// Compute weights, activations and gradients are 16-bit; the optimizer updates fp32 masters. Both
// live in the parameter store: this plugin sets the store's dtypes (plan_store), scales the loss,
// tells the step the scale its gradients carry, and votes to skip a step whose gradients
// overflowed. docs/precision.md has the phases in pseudocode and where memrt follows or leaves
// DeepSpeed.
#include <cmath>
#include <iostream>
#include <optional>

#include <memrt/plugin.h>

#include "loss_scaler.h"

namespace {

using memrt::memory::Category;
using memrt::precision::LossScaler;
using memrt::precision::LossScalerOptions;
using memrt::precision::LossScalerState;
using memrt::precision::ScalerKind;

const char* dtype_name(at::ScalarType t) { return t == at::kHalf ? "fp16" : "bf16"; }

class PrecisionPlugin final : public memrt::Plugin {
 public:
  int priority() const override { return memrt::priority::kPrecision; }

  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader top(options, diag);
    if (const memrt::ConfigNode* fp16 = top.child("fp16")) {
      memrt::ConfigReader r(*fp16, diag);
      if (r.get<bool>("enabled", false)) dtype_ = at::kHalf;
      LossScalerOptions o;
      o.loss_scale = r.get<double>("loss_scale", o.loss_scale);
      o.initial_scale_power = r.get<int>("initial_scale_power", o.initial_scale_power);
      o.loss_scale_window = r.get<int64_t>("loss_scale_window", o.loss_scale_window);
      o.hysteresis = r.get<int64_t>("hysteresis", o.hysteresis);
      o.consecutive_hysteresis = r.get<bool>("consecutive_hysteresis", o.consecutive_hysteresis);
      o.min_loss_scale = r.get<double>("min_loss_scale", o.min_loss_scale);
      r.finish();
      if (dtype_ == at::kHalf) {
        try {
          scaler_.emplace(o, ScalerKind::kFp16Optimizer);  // the options checked now; the kind
        } catch (const memrt::Error& e) {                   // follows the store (build_optimizer)
          throw fp16->error(e.what());
        }
        scaler_options_ = o;
      }
    }
    if (const memrt::ConfigNode* bf16 = top.child("bf16")) {
      memrt::ConfigReader r(*bf16, diag);
      if (r.get<bool>("enabled", false)) dtype_ = at::kBFloat16;
      check_overflow_ = r.get<bool>("check_grad_overflow", true);
      // DeepSpeed PR 7700: bf16 weights (and gradients) with no fp32 master, Adam's moments in
      // bf16 too. DeepSpeed takes them at ZeRO stages 1-3 only (and the first without the second
      // only with CPU offload); the store takes them at every stage.
      in_place_ = r.get<bool>("bf16_master_weights_and_grads", false);
      bf16_states_ = r.get<bool>("bf16_optimizer_states", false);
      r.finish();
      if (bf16_states_ && !in_place_)
        throw bf16->error("bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled "
                          "(as in DeepSpeed): set both, or remove bf16_optimizer_states");
      if (in_place_ && dtype_ != at::kBFloat16)
        throw bf16->error("bf16_master_weights_and_grads keeps bf16 weights without fp32 masters: it "
                          "needs \"enabled\": true");
    }
    if (const memrt::ConfigNode* types = top.child("data_types")) {
      memrt::ConfigReader r(*types, diag);
      const std::string compute = dtype_ == at::kFloat ? "fp32" : dtype_name(dtype_);
      if (auto accum = r.optional<std::string>("grad_accum_dtype"); accum && *accum != compute) {
        // fp32 accumulation of 16-bit gradients: the store keeps a flat fp32 gradient (full, or
        // ZeRO-2's partition) that each micro-step's 16-bit gradient is added into, as
        // DeepSpeed's BF16_Optimizer (stages 0-1) and ZeRO-2 do.
        if (*accum != "fp32" || dtype_ == at::kFloat) {
          throw types->error("grad_accum_dtype \"" + *accum + "\" differs from the " + compute +
                             " the model trains in: gradients accumulate in the model's dtype, or "
                             "in fp32 for a 16-bit model (DeepSpeed: \"unsupported mix of "
                             "model_dtype and grad_accum_dtype\"); remove it or set \"" + compute +
                             "\"" + (dtype_ == at::kFloat ? "" : " or \"fp32\""));
        }
        accumulate_fp32_ = true;
      }
      r.child("param_dtype");  // the config loader checked it agrees with fp16/bf16
      r.finish();
    }
    top.finish();
    if (dtype_ == at::kFloat) scaler_.reset();
  }

  void plan_store(memrt::StorePlanContext& ctx) override {
    if (dtype_ == at::kFloat) return;
    ctx.plan.set_compute_dtype(dtype_);
    ctx.plan.set_master_weights(!in_place_);
    if (bf16_states_) ctx.plan.set_state_dtype(at::kBFloat16);
    if (accumulate_fp32_) ctx.plan.set_grad_dtype(at::kFloat);
  }

  // The store's cells (16-bit weights, fp32 masters) follow from plan_store; this adds what the
  // compute dtype changes elsewhere: activations, gradients, the all-reduce's buckets.
  void estimate_memory(memrt::memory::MemoryEstimate& e) const override {
    if (dtype_ == at::kFloat) return;
    using memrt::memory::Placement;
    const int64_t b = static_cast<int64_t>(c10::elementSize(dtype_));
    int64_t trainable = 0;
    for (const auto& p : e.params) trainable += p.trainable ? p.numel : 0;
    memrt::memory::Table& t = e.table;
    if (!accumulate_fp32_) {  // the all-reduce's buckets hold 16-bit gradients (fp32 ones else)
      for (Placement pl : {Placement::kDevice, Placement::kHost})
        t.at(Category::kCommBuffers, pl) = t.at(Category::kCommBuffers, pl) / 4 * b;
    }

    // Llama's rotary cos/sin tables are built in the compute dtype (the host planned fp32).
    if (e.run->shape.arch == "llama")
      t.at(Category::kOther) -= 2 * e.run->block_size * e.run->shape.head_dim() * (4 - b);

    // Activations in the compute dtype, backward's candidate chosen again in it (the head's fp32
    // gradients at the loss keep their size, a block's halve). What plugins before this one added
    // to a block (the tensors their own modules keep, LoRA's dropout) is in the old compute dtype:
    // it is kept, scaled to the new one.
    const memrt::memory::ActivationEstimate host = memrt::memory::activation_estimate(*e.run, e.compute_dtype, e.params);
    const int64_t old_width = static_cast<int64_t>(c10::elementSize(e.compute_dtype));
    e.compute_dtype = dtype_;
    const std::vector<int64_t> before = e.activations.per_block;
    e.activations = memrt::memory::activation_estimate(*e.run, dtype_, e.params);
    for (size_t i = 0; i < before.size() && i < host.per_block.size(); ++i)
      e.activations.per_block[i] += (before[i] - host.per_block[i]) / old_width * b;
    if (scaler_) {
      e.activations.head += 4;  // the scaled loss backward starts from
      // A chunked head's first candidate is inside its chunks, in forward: the loss is not scaled yet.
      if (e.run->chunked_cross_entropy) e.activations.backward_at_loss -= 4;
    }
    // Gradients accumulated in fp32 go into the store's flat buffer as autograd hands them over.
    e.choose_backward_peak(accumulate_fp32_ ? 0 : b);
    if (accumulate_fp32_) {
      // Each 16-bit gradient goes into the store's flat fp32 gradient (its cells come from the
      // plan) the moment autograd hands it over: none is alive beside it, in backward or at the
      // step, so the peak is in backward.
      e.backward_grad_elements = 0;
      e.peak_in_backward = true;
      t.at(Category::kGradients) = 0;
      e.refresh_activations();
      return;
    }
    // 16-bit gradients, in backward and in the step (which reads them as they are).
    const int64_t backward_grads = e.backward_grad_elements * b;
    const int64_t step_grads = trainable * b;
    e.peak_in_backward = e.activations.total() + backward_grads >= step_grads;
    if (e.peak_in_backward) {
      t.at(Category::kGradients) = backward_grads;
      e.refresh_activations();
    } else {
      t.at(Category::kGradients) = step_grads;
      t.at(Category::kActivations) = 0;
    }
  }

  // Without ZeRO DeepSpeed runs FP16_Optimizer, whose scaler has no hysteresis; ZeRO's optimizers
  // use DynamicLossScaler. ZeRO is on when the store's optimizer side is partitioned.
  void build_optimizer(memrt::OptimizerContext& ctx) override {
    if (!scaler_) return;
    bool zero = false;
    for (int g = 0; g < static_cast<int>(ctx.store.plan().groups().size()); ++g)
      zero = zero || ctx.store.plan().partitioned(g);
    scaler_.emplace(scaler_options_, zero ? ScalerKind::kZero : ScalerKind::kFp16Optimizer);
  }

  void before_backward(memrt::BackwardContext& ctx) override {
    if (scaler_) ctx.loss = ctx.loss.to(at::kFloat) * scaler_->scale();
  }

  void after_gradient_accumulation(memrt::StepContext& ctx) override {
    if (scaler_) ctx.grad_scale = scaler_->scale();  // the step divides by it
  }

  void before_optimizer_step(memrt::StepContext& ctx) override {
    if (dtype_ == at::kFloat) return;
    // The host's pass 1 found whether any gradient on any rank is inf or NaN.
    overflow_ = (scaler_ || check_overflow_) && !ctx.grads_finite;
    if (scaler_) {
      const std::string line = scaler_->update(overflow_);
      if (!overflow_ && !line.empty() && ctx.run.rank == 0) std::cout << "[precision] " << line << "\n";
      if (overflow_) {
        ctx.control.skip_step = true;
        ctx.control.skip_reason = line;
      }
    } else if (overflow_) {
      ctx.control.skip_step = true;
      ctx.control.skip_reason = "bf16 gradients hold inf/NaN (bf16.check_grad_overflow)";
    }
  }

  void add_metrics(memrt::Metrics& metrics) override {
    if (scaler_) metrics["loss_scale"] = scaler_->scale();
  }

  // The scaler's counters: a resumed run continues exactly. (The fp32 masters are the parameter
  // store's, saved with the optimizer's state.)
  // Version 3: the scaler only; versions 1 and 2 also held the masters.
  int state_version() const override { return 3; }

  memrt::TensorMap state_dict() const override {
    memrt::TensorMap out;
    if (scaler_) {
      const LossScalerState s = scaler_->state();
      out["loss_scale"] = at::scalar_tensor(s.cur_scale, at::kDouble);
      out["cur_iter"] = at::scalar_tensor(s.cur_iter, at::kLong);
      out["last_overflow_iter"] = at::scalar_tensor(s.last_overflow_iter, at::kLong);
      out["cur_hysteresis"] = at::scalar_tensor(s.cur_hysteresis, at::kLong);
    }
    return out;
  }

  void load_state_dict(const memrt::TensorMap& state, int version) override {
    if (version != 3) {
      throw memrt::Error("precision: the checkpoint's precision state is version " +
                         std::to_string(version) + "; this plugin reads version 3 only (" +
                         (version < 3 ? "versions 1 and 2 kept the fp32 masters in the plugin; "
                                        "they now live in the parameter store" : "a newer layout") +
                         "). Resume it with the memrt version that wrote it, or start a new run "
                         "from its weights (model_name_or_path: its global_step folder)");
    }
    auto need = [&](const std::string& key) -> const at::Tensor& {
      auto it = state.find(key);
      if (it == state.end())
        throw memrt::Error("precision: the checkpoint lacks '" + key + "' (was it saved with " +
                           dtype_name(dtype_) + " enabled?)");
      return it->second;
    };
    if (scaler_) {
      LossScalerState s;
      s.cur_scale = need("loss_scale").item<double>();
      s.cur_iter = need("cur_iter").item<int64_t>();
      s.last_overflow_iter = need("last_overflow_iter").item<int64_t>();
      s.cur_hysteresis = need("cur_hysteresis").item<int64_t>();
      scaler_->load_state(s);
    }
  }

 private:
  at::ScalarType dtype_ = at::kFloat;  // the compute dtype; kFloat: the plugin is idle
  std::optional<LossScaler> scaler_;   // fp16 only
  LossScalerOptions scaler_options_;
  bool check_overflow_ = true;         // bf16: skip steps with inf/NaN gradients
  bool accumulate_fp32_ = false;       // data_types.grad_accum_dtype "fp32"
  bool in_place_ = false;              // bf16.bf16_master_weights_and_grads: no fp32 masters
  bool bf16_states_ = false;           // bf16.bf16_optimizer_states
  bool overflow_ = false;
};

}  // namespace

MEMRT_PLUGIN(PrecisionPlugin, "precision", "1.0.0",
             "fp16 with DeepSpeed's dynamic loss scaling, bf16, fp32 master weights")
