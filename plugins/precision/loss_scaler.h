// plugins/precision/loss_scaler.h — fp16 loss scaling as DeepSpeed does it, as a plain state
// machine (no LibTorch): the precision plugin asks it for the scale to multiply the loss by, and
// tells it once per optimizer step whether the gradients overflowed (already agreed across ranks).
//
// Two kinds, each reproducing one DeepSpeed class exactly (docs/precision.md, "Loss scaling"):
//   kZero           deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale — the
//                   scaler of ZeRO stages 1-3: hysteresis, and an error when an overflow comes
//                   with the scale already at min_loss_scale.
//   kFp16Optimizer  deepspeed/runtime/fp16/fused_optimizer.py (and unfused_optimizer.py),
//                   FP16_Optimizer._update_scale — fp16 without ZeRO: hysteresis is ignored, every
//                   overflow halves the scale, clamped at min_loss_scale, and never raises.
// Both double the scale after a clean window the same way. A static scale (loss_scale > 0) never
// changes; an overflow still skips the step.
#pragma once

#include <cstdint>
#include <string>

namespace memrt::precision {

// The ds_config "fp16" section's loss-scaling keys, with DeepSpeed's defaults.
struct LossScalerOptions {
  double loss_scale = 0.0;          // > 0: a static scale; 0: dynamic
  int initial_scale_power = 16;     // dynamic: start at 2^p
  int64_t loss_scale_window = 1000; // clean steps between doublings
  int64_t hysteresis = 2;           // kZero: overflows until a halving (refilled on a doubling)
  bool consecutive_hysteresis = false;  // kZero: refill hysteresis on every clean step
  double min_loss_scale = 1.0;      // floor of the dynamic scale
};

enum class ScalerKind {
  kZero,           // DeepSpeed's DynamicLossScaler (ZeRO stages 1-3): hysteresis, error at the minimum
  kFp16Optimizer,  // DeepSpeed's FP16_Optimizer (no ZeRO): halves on every overflow, clamps at the minimum
};

// What a checkpoint keeps. cur_iter counts update() calls (skipped steps included);
// last_overflow_iter is -1 before the first overflow. cur_hysteresis is what kZero has left; the
// other kinds keep it at options.hysteresis and never read it.
struct LossScalerState {
  double cur_scale;
  int64_t cur_iter;
  int64_t last_overflow_iter;
  int64_t cur_hysteresis;
};

class LossScaler {
 public:
  // Throws memrt::Error naming the fp16 key when an option is invalid: loss_scale must be finite
  // and >= 0; when dynamic (loss_scale == 0, the only case DeepSpeed checks them)
  // loss_scale_window > 0, min_loss_scale finite and > 0, hysteresis >= 1 and 2^p a finite
  // non-zero double.
  LossScaler(const LossScalerOptions& options, ScalerKind kind);

  bool dynamic() const { return dynamic_; }
  ScalerKind kind() const { return kind_; }
  const LossScalerOptions& options() const { return options_; }
  double scale() const { return state_.cur_scale; }

  // One optimizer step's outcome; `overflow` means the step is skipped. Returns the line to log
  // on rank 0 for this update, "" when there is nothing to say (DeepSpeed's words; see
  // docs/precision.md for each line). Throws memrt::Error, leaving the state unchanged, when a
  // dynamic kZero scaler overflows with its scale already at min_loss_scale.
  std::string update(bool overflow);

  LossScalerState state() const { return state_; }
  // Restores what state() returned (options come from the current config). Throws memrt::Error
  // on a state no scaler can be in: scale not finite or <= 0, cur_iter < 0, last_overflow_iter
  // outside [-1, cur_iter), cur_hysteresis < 0 (< 1 for a dynamic kZero scaler).
  void load_state(const LossScalerState& s);

 private:
  std::string update_zero(bool overflow);
  std::string update_fp16_optimizer(bool overflow);
  std::string raise_line(double from) const;

  LossScalerOptions options_;
  ScalerKind kind_;
  bool dynamic_;
  LossScalerState state_;
};

// A scale as the log lines print it: an integer when integral ("65536"), otherwise the shortest
// decimal that reads back as the same double ("0.1").
std::string format_scale(double scale);

}  // namespace memrt::precision
