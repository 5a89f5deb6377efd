// zero::LossScaler: DeepSpeed's dynamic rule (Note [Dynamic loss scaling]) and static scales.
#include "zero/loss_scaler.h"

#include <gtest/gtest.h>

#include "base/error.h"

namespace porter::zero {
namespace {

config::Fp16Config dynamic(int64_t power, int64_t window, int64_t hysteresis, double min = 1.0) {
  config::Fp16Config c;
  c.enabled = true;
  c.loss_scale = 0.0;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min;
  return c;
}

TEST(LossScalerTest, DisabledIsStaticOne) {
  LossScaler s{config::Fp16Config{}};
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 1.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 1.0);
}

TEST(LossScalerTest, StaticKeepsItsScaleButCountsSkips) {
  config::Fp16Config c;
  c.enabled = true;
  c.loss_scale = 128.0;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.scale(), 128.0);
  EXPECT_EQ(s.skipped_steps(), 1);
}

TEST(LossScalerTest, GrowsEveryWindowWithoutOverflow) {
  LossScaler s(dynamic(4, 3, 1));
  EXPECT_EQ(s.scale(), 16.0);
  // (iter - (-1)) % 3 == 0 at iterations 2, 5, ...
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 32.0);
  s.update(false);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 64.0);
}

TEST(LossScalerTest, OverflowHalvesAndRestartsTheWindow) {
  LossScaler s(dynamic(4, 2, 1));
  s.update(true);  // iteration 0: 16 -> 8, last overflow 0
  EXPECT_EQ(s.scale(), 8.0);
  s.update(false);  // iteration 1: (1 - 0) % 2 != 0
  EXPECT_EQ(s.scale(), 8.0);
  s.update(false);  // iteration 2: (2 - 0) % 2 == 0 -> 16
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_EQ(s.skipped_steps(), 1);
  EXPECT_EQ(s.iteration(), 3);
}

TEST(LossScalerTest, HysteresisDelaysTheDecrease) {
  LossScaler s(dynamic(4, 100, 3));
  s.update(true);  // h 3 -> 2
  EXPECT_EQ(s.scale(), 16.0);
  s.update(true);  // h 2 -> 1
  EXPECT_EQ(s.scale(), 16.0);
  s.update(true);  // h == 1: halve
  EXPECT_EQ(s.scale(), 8.0);
  s.update(true);  // still 1: halve again
  EXPECT_EQ(s.scale(), 4.0);
  EXPECT_EQ(s.skipped_steps(), 4);
}

TEST(LossScalerTest, NeverBelowTheMinimum) {
  LossScaler s(dynamic(2, 100, 1, 2.0));
  s.update(true);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 2.0);
}

TEST(LossScalerTest, StateRoundTrips) {
  LossScaler a(dynamic(5, 4, 2));
  a.update(true);
  a.update(false);
  LossScaler b(dynamic(5, 4, 2));
  b.set_state(a.state());
  for (int i = 0; i < 9; ++i) {
    const bool o = i == 4;
    a.update(o);
    b.update(o);
    EXPECT_EQ(a.scale(), b.scale()) << i;
  }
}

TEST(LossScalerTest, RejectsBadConfigs) {
  config::Fp16Config c = dynamic(16, 0, 2);
  EXPECT_THROW(LossScaler{c}, InvalidArgument);
  c = dynamic(16, 10, 0);
  EXPECT_THROW(LossScaler{c}, InvalidArgument);
  c = dynamic(16, 10, 2, 0.0);
  EXPECT_THROW(LossScaler{c}, InvalidArgument);
  c.loss_scale = -1.0;
  EXPECT_THROW(LossScaler{c}, InvalidArgument);
}

}  // namespace
}  // namespace porter::zero
