// DeepSpeed's schedulers against values computed by hand from deepspeed/runtime/lr_schedules.py.
#include "engine/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace porter::engine {
namespace {

using config::SchedulerConfig;
using config::SchedulerType;
using config::WarmupType;

SchedulerConfig warmup(SchedulerType type, WarmupType wt, int64_t steps) {
  SchedulerConfig s;
  s.type = type;
  s.warmup_type = wt;
  s.warmup_num_steps = steps;
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1e-3;
  return s;
}

TEST(LrSchedule, NoSchedulerIsTheOptimizerLr) {
  LrSchedule lr(3e-4, std::nullopt);
  EXPECT_EQ(lr.lr(0), 3e-4);
  EXPECT_EQ(lr.lr(12345), 3e-4);
}

TEST(LrSchedule, WarmupLrLog) {
  SchedulerConfig s = warmup(SchedulerType::kWarmupLR, WarmupType::kLog, 10);
  s.warmup_min_lr = 1e-4;
  LrSchedule lr(5.0, s);
  // Step 0 runs at iteration -1 (before the first scheduler.step()): min lr.
  EXPECT_DOUBLE_EQ(lr.lr(0), 1e-4);
  // Iteration 0: log(1) = 0 -> min lr.
  EXPECT_DOUBLE_EQ(lr.lr(1), 1e-4);
  // Iteration 4: 1e-4 + 9e-4 * log(5) / log(10).
  EXPECT_NEAR(lr.lr(5), 1e-4 + 9e-4 * 0.69897000433601886, 1e-15);
  // Iteration 9: log(10)/log(10) = 1 after warmup ends at iteration >= 10 as well.
  EXPECT_NEAR(lr.lr(10), 1e-3, 1e-15);
  EXPECT_DOUBLE_EQ(lr.lr(11), 1e-3);
  EXPECT_DOUBLE_EQ(lr.lr(1000), 1e-3);
}

TEST(LrSchedule, WarmupLrLinear) {
  LrSchedule lr(1.0, warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 4));
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.0);
  EXPECT_DOUBLE_EQ(lr.lr(1), 0.0);      // iteration 0: 0/4
  EXPECT_DOUBLE_EQ(lr.lr(2), 0.25e-3);  // iteration 1: 1/4
  EXPECT_DOUBLE_EQ(lr.lr(4), 0.75e-3);  // iteration 3
  EXPECT_DOUBLE_EQ(lr.lr(5), 1e-3);     // iteration 4: warmup over
}

TEST(LrSchedule, WarmupStepsBelowTwoBecomeTwo) {
  // DeepSpeed: warmup_num_steps = max(2, warmup_num_steps).
  LrSchedule lr(1.0, warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 1));
  EXPECT_DOUBLE_EQ(lr.lr(2), 0.5e-3);  // iteration 1: 1/2
  EXPECT_DOUBLE_EQ(lr.lr(3), 1e-3);
}

TEST(LrSchedule, LastBatchIterationShiftsTheSteps) {
  SchedulerConfig s = warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 4);
  s.last_batch_iteration = 1;  // resumed: step 0 runs at iteration 1
  LrSchedule lr(1.0, s);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.25e-3);
  EXPECT_DOUBLE_EQ(lr.lr(2), 0.75e-3);
}

TEST(LrSchedule, WarmupDecayLr) {
  SchedulerConfig s = warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLinear, 4);
  s.total_num_steps = 12;
  LrSchedule lr(1.0, s);
  EXPECT_DOUBLE_EQ(lr.lr(4), 0.75e-3);  // iteration 3, warming up
  // Iteration 4: (12 - 4) / (12 - 4) = 1.
  EXPECT_DOUBLE_EQ(lr.lr(5), 1e-3);
  // Iteration 6: (12 - 6) / 8 = 0.75.
  EXPECT_DOUBLE_EQ(lr.lr(7), 0.75e-3);
  // Iteration 12 and beyond: 0.
  EXPECT_DOUBLE_EQ(lr.lr(13), 0.0);
  EXPECT_DOUBLE_EQ(lr.lr(100), 0.0);
}

TEST(LrSchedule, WarmupDecayLrDecaysTowardsMinLr) {
  SchedulerConfig s = warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLog, 2);
  s.warmup_min_lr = 2e-4;
  s.total_num_steps = 6;
  LrSchedule lr(1.0, s);
  // Iteration 3: 2e-4 + 8e-4 * (6 - 3) / (6 - 2).
  EXPECT_DOUBLE_EQ(lr.lr(4), 2e-4 + 8e-4 * 0.75);
  EXPECT_DOUBLE_EQ(lr.lr(50), 2e-4);
}

TEST(LrSchedule, WarmupCosineLr) {
  SchedulerConfig s;
  s.type = SchedulerType::kWarmupCosineLR;
  s.warmup_type = WarmupType::kLinear;
  s.warmup_num_steps = 4;
  s.total_num_steps = 8;
  s.warmup_min_ratio = 0.2;
  s.cos_min_ratio = 0.1;
  LrSchedule lr(2.0, s);
  EXPECT_DOUBLE_EQ(lr.lr(0), 0.0);              // iteration -1
  EXPECT_DOUBLE_EQ(lr.lr(1), 2.0 * 0.2);        // iteration 0: min ratio
  EXPECT_DOUBLE_EQ(lr.lr(3), 2.0 * (0.2 + 0.5 * 0.8));  // iteration 2
  // Iteration 4: progress (4 - 4 + 1) / 4 = 0.25.
  const double c = (1.0 + std::cos(std::numbers::pi * 0.25)) / 2.0;
  EXPECT_DOUBLE_EQ(lr.lr(5), 2.0 * (0.1 + 0.9 * c));
  // Iteration 6: progress 0.75.
  const double c3 = (1.0 + std::cos(std::numbers::pi * 0.75)) / 2.0;
  EXPECT_DOUBLE_EQ(lr.lr(7), 2.0 * (0.1 + 0.9 * c3));
  // Iteration 7 and later: progress clamped to 1 -> cos_min_ratio.
  EXPECT_DOUBLE_EQ(lr.lr(8), 2.0 * 0.1);
  EXPECT_DOUBLE_EQ(lr.lr(500), 2.0 * 0.1);
}

TEST(LrSchedule, WarmupCosineLrLogWarmup) {
  SchedulerConfig s;
  s.type = SchedulerType::kWarmupCosineLR;
  s.warmup_type = WarmupType::kLog;
  s.warmup_num_steps = 100;
  s.total_num_steps = 1000;
  LrSchedule lr(1e-3, s);
  // Iteration 9: log(10) / log(100) = 0.5 exactly.
  EXPECT_NEAR(lr.lr(10), 0.5e-3, 1e-18);
}

}  // namespace
}  // namespace porter::engine
