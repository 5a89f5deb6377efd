// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as pure functions of the step.
//
// Note [Scheduler steps]
// DeepSpeed sets the optimizer's lr from the scheduler at construction (at
// last_batch_iteration, -1 by default) and calls scheduler.step() after every optimizer
// step, which advances last_batch_iteration by one. So optimizer step k (0-based) runs at
// iteration i = last_batch_iteration + k: with the default -1, the first step runs at i = -1,
// where WarmupLR/WarmupDecayLR give warmup_min_lr and WarmupCosineLR gives 0 (the
// "before it has started" branch of lr_schedules.py). The formulas below are those of
// deepspeed/runtime/lr_schedules.py, including warmup_num_steps = max(2, warmup_num_steps)
// and the clamp of the cosine progress to [0, 1].
#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace porter::engine {
namespace {

// The warmup fraction in [0, 1) at iteration i < warmup_steps (i >= 0).
double warmup_gamma(const config::SchedulerConfig& s, int64_t warmup_steps, int64_t i) {
  if (s.warmup_type == config::WarmupType::kLinear) {
    return static_cast<double>(i) / static_cast<double>(warmup_steps);
  }
  return std::log(static_cast<double>(i + 1)) / std::log(static_cast<double>(warmup_steps));
}

}  // namespace

LrSchedule::LrSchedule(double base_lr, const std::optional<config::SchedulerConfig>& scheduler)
    : base_lr_(base_lr), scheduler_(scheduler) {}

double LrSchedule::lr(int64_t step) const {
  if (!scheduler_) return base_lr_;
  const config::SchedulerConfig& s = *scheduler_;
  const int64_t i = s.last_batch_iteration + step;  // Note [Scheduler steps]
  const int64_t warmup = std::max<int64_t>(2, s.warmup_num_steps);
  const int64_t total = s.total_num_steps.value_or(warmup);

  switch (s.type) {
    case config::SchedulerType::kWarmupLR:
    case config::SchedulerType::kWarmupDecayLR: {
      if (i < 0) return s.warmup_min_lr;
      double gamma = 1.0;
      if (i < warmup) {
        gamma = warmup_gamma(s, warmup, i);
      } else if (s.type == config::SchedulerType::kWarmupDecayLR) {
        gamma = std::max(0.0, static_cast<double>(total - i) /
                                  std::max(1.0, static_cast<double>(total - warmup)));
      }
      return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
    }
    case config::SchedulerType::kWarmupCosineLR: {
      if (i < 0) return 0.0;
      double ratio;
      if (i < warmup) {
        ratio = s.warmup_min_ratio + warmup_gamma(s, warmup, i) * (1.0 - s.warmup_min_ratio);
      } else {
        const double real_last_step = static_cast<double>(i - warmup + 1);
        const double real_total_steps = static_cast<double>(std::max<int64_t>(1, total - warmup));
        const double progress = std::min(1.0, real_last_step / real_total_steps);
        const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
        ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
      }
      return base_lr_ * ratio;
    }
  }
  return base_lr_;
}

}  // namespace porter::engine
