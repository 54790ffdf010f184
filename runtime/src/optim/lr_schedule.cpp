#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "memrt/error.h"

namespace memrt {

namespace {

constexpr double kPi = 3.14159265358979323846;

// ---- DeepSpeed (deepspeed/runtime/lr_schedules.py) ------------------------------------------
// Stepping protocol, which fixes the index: the constructor runs with last_batch_iteration = -1
// and immediately writes get_lr() into the optimizer (WarmupLR.__init__: `if last_batch_iteration
// == -1: self._last_lr = update_lr(...)`; WarmupCosineLR.__init__ the same), and the engine calls
// lr_scheduler.step() — last_batch_iteration += 1 — after every optimizer step that was not
// skipped for overflow (engine.py, _take_model_step: `if overflow: self.skipped_steps += 1 else:
// ... self.lr_scheduler.step(...)`). So the update after `c` completed updates runs with the lr of
// last_batch_iteration t = c - 1, and the very first update (t = -1) gets the "not started" value:
// warmup_min_lr for WarmupLR/WarmupDecayLR (`if self.last_batch_iteration < 0: return
// self.min_lrs`), 0 for WarmupCosineLR (`return [0.0 for _ in self.org_lrs]`).
// (Lines as of deepspeedai/DeepSpeed edaa722: lr_schedules.py 729-735, 745-748, 876-878, 911-914;
// engine.py 3377-3383.)

int64_t ds_iteration(int64_t completed_steps) { return completed_steps - 1; }

// The warmup fraction of WarmupLR._get_gamma / WarmupCosineLR.get_lr_ratio for t < W.
double ds_warmup_gamma(int64_t t, int64_t W, bool log_warmup) {
  if (log_warmup) return std::log(static_cast<double>(t + 1)) / std::log(static_cast<double>(W));
  return static_cast<double>(t) / static_cast<double>(W);
}

class ConstantLr : public LrSchedule {
 public:
  explicit ConstantLr(double lr) : lr_(lr) {}
  double lr(int64_t) const override { return lr_; }

 private:
  double lr_;
};

// WarmupLR, and WarmupDecayLR when `decay_total` > 0.
class DsWarmupLr : public LrSchedule {
 public:
  DsWarmupLr(const SchedulerConfig& c, int64_t decay_total)
      : min_(c.warmup_min_lr), max_(c.warmup_max_lr), W_(std::max<int64_t>(2, c.warmup_num_steps)),
        log_(c.warmup_type != "linear"), T_(decay_total) {}

  double lr(int64_t completed_steps) const override {
    int64_t t = ds_iteration(completed_steps);
    if (t < 0) return min_;
    double gamma;
    if (t < W_)
      gamma = ds_warmup_gamma(t, W_, log_);
    else if (T_ > 0)  // WarmupDecayLR._get_gamma
      gamma = std::max(0.0, static_cast<double>(T_ - t) /
                                std::max(1.0, static_cast<double>(T_ - W_)));
    else
      gamma = 1.0;
    return min_ + (max_ - min_) * gamma;
  }

 private:
  double min_, max_;
  int64_t W_;
  bool log_;
  int64_t T_;
};

class DsWarmupCosineLr : public LrSchedule {
 public:
  DsWarmupCosineLr(const SchedulerConfig& c, double base_lr, int64_t total)
      : base_(base_lr), wmin_(c.warmup_min_ratio), cmin_(c.cos_min_ratio),
        W_(std::max<int64_t>(2, c.warmup_num_steps)), log_(c.warmup_type != "linear"), T_(total) {}

  double lr(int64_t completed_steps) const override {
    int64_t t = ds_iteration(completed_steps);
    if (t < 0) return 0.0;
    double ratio;
    if (t < W_) {
      ratio = wmin_ + (1.0 - wmin_) * ds_warmup_gamma(t, W_, log_);
    } else {
      // Progress clamped to 1: the ratio stays at cos_min_ratio after total_num_steps.
      double progress = std::min(1.0, static_cast<double>(t - W_ + 1) /
                                          static_cast<double>(std::max<int64_t>(1, T_ - W_)));
      ratio = std::max(0.0, cmin_ + (1.0 - cmin_) * (1.0 + std::cos(kPi * progress)) / 2.0);
    }
    return base_ * ratio;
  }

 private:
  double base_, wmin_, cmin_;
  int64_t W_;
  bool log_;
  int64_t T_;
};

// ---- Hugging Face (transformers/optimization.py) ---------------------------------------------
// get_*_schedule_with_warmup return torch's LambdaLR, whose constructor already applies
// lr_lambda(0) and whose step() (once per optimizer step that ran) moves to lambda(1), ... So the
// update after `c` completed updates uses base_lr * lambda(c).
class HfLambdaLr : public LrSchedule {
 public:
  enum Kind { kLinear, kCosine, kConstant, kConstantWithWarmup };
  HfLambdaLr(Kind kind, double base_lr, int64_t warmup, int64_t total)
      : kind_(kind), base_(base_lr), warmup_(warmup), total_(total) {}

  double lr(int64_t completed_steps) const override { return base_ * lambda(completed_steps); }

 private:
  double lambda(int64_t step) const {
    if (kind_ == kConstant) return 1.0;
    if (step < warmup_)
      return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_));
    double span = static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
    switch (kind_) {
      case kLinear:
        return std::max(0.0, static_cast<double>(total_ - step) / span);
      case kCosine: {  // num_cycles = 0.5: half a cosine from 1 down to 0
        double progress = static_cast<double>(step - warmup_) / span;
        return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * 0.5 * 2.0 * progress)));
      }
      default:
        return 1.0;
    }
  }

  Kind kind_;
  double base_;
  int64_t warmup_, total_;
};

}  // namespace

std::unique_ptr<LrSchedule> make_lr_schedule(const SchedulerConfig& cfg, double optimizer_lr,
                                             int64_t total_steps) {
  const std::string& type = cfg.type;
  const bool deepspeed = type == "WarmupLR" || type == "WarmupDecayLR" || type == "WarmupCosineLR";
  const std::string where = deepspeed ? "scheduler.params." : "";

  // DeepSpeed's schedules take 0 too (they warm up over max(2, warmup_num_steps) steps); a
  // Hugging Face run without warmup resolves "auto" to 0.
  if (cfg.warmup_num_steps < 0)
    throw ConfigError(deepspeed ? "ds_config" : "train.yaml",
                      deepspeed ? "scheduler.params.warmup_num_steps" : "warmup_steps",
                      "expected a non-negative integer, got " + std::to_string(cfg.warmup_num_steps));
  if (deepspeed && cfg.warmup_type != "log" && cfg.warmup_type != "linear")
    throw ConfigError("ds_config", "scheduler.params.warmup_type",
                      "expected \"log\" or \"linear\", got \"" + cfg.warmup_type + "\"");
  int64_t total = cfg.total_num_steps > 0 ? cfg.total_num_steps : total_steps;
  auto need_total = [&](const std::string& key) {
    if (total <= 0)
      throw ConfigError(deepspeed ? "ds_config" : "train.yaml", key,
                        "scheduler '" + type + "' needs the number of training steps: set " + key +
                            " or max_steps (got " + std::to_string(total) + ")");
  };

  if (type.empty()) return std::make_unique<ConstantLr>(optimizer_lr);
  if (type == "WarmupLR") return std::make_unique<DsWarmupLr>(cfg, 0);
  if (type == "WarmupDecayLR") {
    need_total(where + "total_num_steps");
    return std::make_unique<DsWarmupLr>(cfg, total);
  }
  if (type == "WarmupCosineLR") {
    need_total(where + "total_num_steps");
    return std::make_unique<DsWarmupCosineLr>(cfg, optimizer_lr, total);
  }
  if (type == "linear" || type == "cosine") {
    need_total("max_steps");
    return std::make_unique<HfLambdaLr>(type == "linear" ? HfLambdaLr::kLinear : HfLambdaLr::kCosine,
                                        optimizer_lr, cfg.warmup_num_steps, total);
  }
  if (type == "constant") return std::make_unique<HfLambdaLr>(HfLambdaLr::kConstant, optimizer_lr, 0, 0);
  if (type == "constant_with_warmup")
    return std::make_unique<HfLambdaLr>(HfLambdaLr::kConstantWithWarmup, optimizer_lr,
                                        cfg.warmup_num_steps, 0);
  throw ConfigError("ds_config", "scheduler.type",
                    "unknown scheduler '" + type +
                        "'; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR (ds_config) or "
                        "lr_scheduler_type linear, cosine, constant, constant_with_warmup (train.yaml)");
}

}  // namespace memrt
