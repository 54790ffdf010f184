// loss_guard — skips optimizer steps whose loss jumps above `factor` times the running mean of
// the last `window` accepted steps (after `warmup_steps` steps that are never skipped).
//
//   "plugins": [{"name": "loss_guard", "library": "libloss_guard.so",
//                "options": {"factor": 3.0, "window": 20, "warmup_steps": 10}}]
//
// Phases: after_forward (adds up this step's micro-batch losses), before_optimizer_step (votes to
// skip; the host agrees the vote across ranks), after_optimizer_step (updates the running mean
// with accepted steps only), add_metrics ("loss_guard_skips").
//
// Memory: the last `window` losses live in a tensor the plugin claims as `other`, and
// estimate_memory() predicts those bytes, so `launcher --estimate` and the end-of-run report both
// show this plugin's term (docs/memory.md).
#include <algorithm>
#include <sstream>

#include <memrt/plugin.h>

namespace {

class LossGuard final : public memrt::Plugin {
 public:
  void configure(const memrt::ConfigNode& options, memrt::ConfigDiagnostics& diag,
                 const memrt::RunInfo& /*run*/) override {
    memrt::ConfigReader r(options, diag);
    factor_ = r.get<double>("factor", 3.0);
    window_ = r.get<int64_t>("window", 20);
    warmup_steps_ = r.get<int64_t>("warmup_steps", 10);
    r.finish();
    if (factor_ < 0.0) throw options.error("factor must be >= 0, got " + std::to_string(factor_));
    if (window_ < 1) throw options.error("window must be >= 1, got " + std::to_string(window_));
  }

  void estimate_memory(memrt::memory::MemoryEstimate& estimate) const override {
    estimate.table.at(memrt::memory::Category::kOther) += window_ * int64_t{sizeof(double)};
  }

  void on_train_begin(memrt::TrainContext& /*ctx*/) override {
    if (!history_.defined()) history_ = at::zeros({window_}, at::kDouble);  // (window,) ring
    memrt::memory::claim(history_, memrt::memory::Category::kOther);
  }

  void before_forward(memrt::MicroStepContext& ctx) override {
    if (ctx.micro_step == 0) step_loss_ = 0.0;
  }

  void after_forward(memrt::MicroStepContext& ctx) override {
    step_loss_ += ctx.loss.item<double>();  // already divided by the accumulation steps
  }

  void before_optimizer_step(memrt::StepContext& ctx) override {
    if (ctx.step < warmup_steps_ || accepted_ == 0) return;
    const int64_t n = std::min(accepted_, window_);
    const double mean = history_.narrow(0, 0, n).sum().item<double>() / static_cast<double>(n);
    if (step_loss_ > factor_ * mean) {
      std::ostringstream why;
      why << "loss_guard: loss " << step_loss_ << " > " << factor_ << " x running mean " << mean;
      ctx.control.skip_step = true;
      ctx.control.skip_reason = why.str();
    }
  }

  void after_optimizer_step(memrt::StepContext& ctx) override {
    if (ctx.skipped) {
      ++skips_;
      return;
    }
    history_.data_ptr<double>()[accepted_ % window_] = step_loss_;  // the oldest goes
    ++accepted_;
  }

  void add_metrics(memrt::Metrics& metrics) override {
    metrics["loss_guard_skips"] = static_cast<double>(skips_);
  }

  // Resuming continues with the same running mean and skip count.
  memrt::TensorMap state_dict() const override {
    return {{"history", history_.clone()},
            {"accepted", at::scalar_tensor(accepted_, at::kLong)},
            {"skips", at::scalar_tensor(skips_, at::kLong)}};
  }
  void load_state_dict(const memrt::TensorMap& state, int /*version*/) override {
    const at::Tensor h = state.at("history");
    if (h.numel() != window_) {
      throw memrt::Error("loss_guard: the checkpoint's history holds " + std::to_string(h.numel()) +
                         " losses but \"window\" is " + std::to_string(window_) +
                         "; resume with the window the run was saved with");
    }
    history_ = h.to(at::kDouble).clone();
    accepted_ = state.at("accepted").item<int64_t>();
    skips_ = state.at("skips").item<int64_t>();
  }

 private:
  double factor_ = 3.0;
  int64_t window_ = 20;
  int64_t warmup_steps_ = 10;
  double step_loss_ = 0.0;
  at::Tensor history_;     // (window,) the losses of the last accepted steps, a ring
  int64_t accepted_ = 0;  // accepted steps so far; the next loss goes to accepted_ % window
  int64_t skips_ = 0;
};

}  // namespace

MEMRT_PLUGIN(LossGuard, "loss_guard", "1.0.0",
             "skips steps whose loss jumps above a multiple of its running mean")
