// Learning-rate schedules: DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR and Hugging Face's
// linear, cosine, constant, constant_with_warmup, with each library's exact step indexing
// (docs/data-and-optim.md has the formulas and tables).
#pragma once

#include <cstdint>
#include <memory>

#include "config/train_config.h"

namespace memrt {

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  // The learning rate for the optimizer update that follows `completed_steps` successful updates
  // (0 for the very first update). Skipped (overflow) steps do not count, as in DeepSpeed.
  virtual double lr(int64_t completed_steps) const = 0;
};

// cfg.type "" -> constant optimizer_lr. total_steps: the run's optimizer steps, used where the
// schedule needs a horizon and cfg.total_num_steps is not positive (WarmupDecayLR, WarmupCosineLR,
// linear, cosine). Throws ConfigError for an unknown type or a missing/invalid parameter.
std::unique_ptr<LrSchedule> make_lr_schedule(const SchedulerConfig& cfg, double optimizer_lr,
                                             int64_t total_steps);

}  // namespace memrt
