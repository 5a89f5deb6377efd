// DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) with the
// formulas of deepspeed/runtime/lr_schedules.py, as pure functions of the step.
#pragma once

#include <cstdint>
#include <optional>

#include "config/config.h"

namespace porter::engine {

class LrSchedule {
 public:
  // No scheduler: the optimizer's lr at every step.
  LrSchedule(double base_lr, const std::optional<config::SchedulerConfig>& scheduler);
  // The learning rate of optimizer step `step` (0-based: the first train_step uses lr(0)).
  double lr(int64_t step) const;

 private:
  double base_lr_;
  std::optional<config::SchedulerConfig> scheduler_;
};

}  // namespace porter::engine
