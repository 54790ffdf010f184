// plugins/precision/loss_scaler.cpp — see loss_scaler.h and docs/precision.md ("Loss scaling").
#include "loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <memrt/error.h>

namespace memrt::precision {

namespace {

std::string printf_double(const char* format, int precision, double v) {
  const int n = std::snprintf(nullptr, 0, format, precision, v);
  std::string s(static_cast<size_t>(n) + 1, '\0');
  std::snprintf(s.data(), s.size(), format, precision, v);
  s.resize(static_cast<size_t>(n));
  return s;
}

[[noreturn]] void invalid(const std::string& key, const std::string& rule, const std::string& got) {
  throw Error("fp16." + key + " " + rule + "; got " + got);
}

}  // namespace

std::string format_scale(double scale) {
  if (std::isfinite(scale) && scale == std::floor(scale)) return printf_double("%.*f", 0, scale);
  for (int precision = 1; precision < 17; ++precision) {
    std::string s = printf_double("%.*g", precision, scale);
    if (std::strtod(s.c_str(), nullptr) == scale) return s;
  }
  return printf_double("%.*g", 17, scale);
}

LossScaler::LossScaler(const LossScalerOptions& options, ScalerKind kind)
    : options_(options), kind_(kind), dynamic_(options.loss_scale == 0.0) {
  if (!std::isfinite(options.loss_scale) || options.loss_scale < 0.0)
    invalid("loss_scale",
            "must be a finite number >= 0 (0 enables dynamic loss scaling, > 0 is a static scale)",
            format_scale(options.loss_scale));
  // Like DeepSpeed (precision_config.py), the dynamic-only keys are checked only when dynamic, so
  // a static config carrying unused values is accepted.
  if (dynamic_) {
    if (options.loss_scale_window <= 0)
      invalid("loss_scale_window",
              "must be > 0 when dynamic loss scaling is enabled (loss_scale = 0): it is the number "
              "of clean steps between doublings of the scale",
              std::to_string(options.loss_scale_window));
    if (!std::isfinite(options.min_loss_scale) || options.min_loss_scale <= 0.0)
      invalid("min_loss_scale",
              "must be a finite number > 0 when dynamic loss scaling is enabled (loss_scale = 0): "
              "it is the floor of the scale",
              format_scale(options.min_loss_scale));
    if (options.hysteresis < 1)
      invalid("hysteresis",
              "must be >= 1: it counts the overflows that lead to a halving of the scale (1: "
              "every overflow halves it; below 1 it would never be halved)",
              std::to_string(options.hysteresis));
  }
  const double initial = std::ldexp(1.0, options.initial_scale_power);
  if (dynamic_ && (!std::isfinite(initial) || initial == 0.0))
    invalid("initial_scale_power",
            "must give a representable initial scale 2^initial_scale_power (between -1074 and "
            "1023; DeepSpeed's default is 16)",
            std::to_string(options.initial_scale_power));
  state_.cur_scale = dynamic_ ? initial : options.loss_scale;
  state_.cur_iter = 0;
  state_.last_overflow_iter = -1;
  state_.cur_hysteresis = options.hysteresis;
}

std::string LossScaler::update(bool overflow) {
  std::string line;
  if (!dynamic_) {
    if (overflow)
      line = "Grad overflow on iteration: " + std::to_string(state_.cur_iter) +
             ". Using static loss scale of: " + format_scale(state_.cur_scale) + ". Skipping step.";
  } else if (kind_ == ScalerKind::kZero) {
    line = update_zero(overflow);
  } else {
    line = update_fp16_optimizer(overflow);
  }
  ++state_.cur_iter;
  return line;
}

// DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py).
std::string LossScaler::update_zero(bool overflow) {
  LossScalerState& s = state_;
  if (overflow) {
    std::string line = "OVERFLOW! Skipping step. Attempted loss scale: " + format_scale(s.cur_scale);
    if (options_.hysteresis == 1 || s.cur_hysteresis == 1) {
      if (s.cur_scale == options_.min_loss_scale)
        throw Error(
            "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
            "(memrt: fp16 gradients overflowed again with the loss scale at fp16.min_loss_scale = " +
            format_scale(options_.min_loss_scale) +
            ", so the step cannot be retried at a smaller scale. The gradients are inf/nan at any "
            "scale: check for a diverging loss (learning rate too high, too short a warmup, no "
            "gradient_clipping), inf/nan in the data, or activations too large for fp16 in the "
            "forward pass; bf16 (\"bf16\": {\"enabled\": true}) needs no loss scaling. Lowering "
            "fp16.min_loss_scale only postpones this.)");
      const double next = std::max(s.cur_scale / 2.0, options_.min_loss_scale);
      line += ", reducing to " + format_scale(next);
      s.cur_scale = next;
    } else {
      line += ", but hysteresis is " + std::to_string(s.cur_hysteresis) +
              ". Reducing hysteresis to " + std::to_string(s.cur_hysteresis - 1);
      --s.cur_hysteresis;
    }
    s.last_overflow_iter = s.cur_iter;
    return line;
  }
  std::string line;
  if (options_.consecutive_hysteresis) {
    // DeepSpeed logs this on every clean step; memrt only when it changes something.
    if (s.cur_hysteresis != options_.hysteresis)
      line = "Consecutive hysteresis is enabled. Restoring hysteresis to " +
             std::to_string(options_.hysteresis);
    s.cur_hysteresis = options_.hysteresis;
  }
  const int64_t stable = s.cur_iter - s.last_overflow_iter - 1;
  if (stable > 0 && stable % options_.loss_scale_window == 0) {
    if (!options_.consecutive_hysteresis) s.cur_hysteresis = options_.hysteresis;
    const double from = s.cur_scale;
    s.cur_scale *= 2.0;
    line += (line.empty() ? "" : "\n") + raise_line(from);
  }
  return line;
}

// FP16_Optimizer._update_scale (deepspeed/runtime/fp16/fused_optimizer.py; the same rule in
// unfused_optimizer.py): no hysteresis, no error at the minimum.
std::string LossScaler::update_fp16_optimizer(bool overflow) {
  LossScalerState& s = state_;
  const double from = s.cur_scale;
  if (overflow) {
    s.cur_scale = std::max(s.cur_scale / 2.0, options_.min_loss_scale);
    s.last_overflow_iter = s.cur_iter;
    return "Overflow detected. Skipping step. Attempted loss scale: " + format_scale(from) +
           ", reducing to " + format_scale(s.cur_scale);
  }
  const int64_t stable = s.cur_iter - s.last_overflow_iter - 1;
  if (stable > 0 && stable % options_.loss_scale_window == 0) {
    s.cur_scale *= 2.0;
    return raise_line(from);
  }
  return "";
}

std::string LossScaler::raise_line(double from) const {
  return "No Grad overflow for " + std::to_string(options_.loss_scale_window) +
         " iterations. Increasing dynamic loss scale from " + format_scale(from) + " to " +
         format_scale(state_.cur_scale);
}

void LossScaler::load_state(const LossScalerState& s) {
  const auto bad = [](const std::string& what) {
    throw Error("fp16 loss scaler state (checkpoint): " + what);
  };
  if (!std::isfinite(s.cur_scale) || s.cur_scale <= 0.0)
    bad("cur_scale must be a finite number > 0; got " + format_scale(s.cur_scale));
  if (s.cur_iter < 0) bad("cur_iter must be >= 0; got " + std::to_string(s.cur_iter));
  if (s.last_overflow_iter < -1 || s.last_overflow_iter >= s.cur_iter)
    bad("last_overflow_iter must be -1 (no overflow yet) or an earlier iteration than cur_iter = " +
        std::to_string(s.cur_iter) + "; got " + std::to_string(s.last_overflow_iter));
  const int64_t min_hysteresis = dynamic_ && kind_ == ScalerKind::kZero ? 1 : 0;
  if (s.cur_hysteresis < min_hysteresis)
    bad("cur_hysteresis must be >= " + std::to_string(min_hysteresis) + "; got " +
        std::to_string(s.cur_hysteresis));
  state_ = s;
}

}  // namespace memrt::precision
