// fp16 loss scaling: a static scale, or DeepSpeed's dynamic scaler (fp16.loss_scale 0).
// See docs/zero.md, "Numerics".
//
// Note [Dynamic loss scaling]
// The loss stage multiplies the gradient of the loss by scale() / gradient_accumulation_steps,
// so the gradients come out scaled; the engine unscales them (folds 1 / scale() into the
// optimizer's gradient scale, after the global norm is divided by scale()). After every step
// update(overflow) is called with the overflow flag all ranks agreed on (an all_reduce(max) of
// "my gradients hold an inf or nan"); an overflowing step skips the optimizer update. The
// rule is DeepSpeed's DynamicLossScaler with consecutive_hysteresis false:
//   start: scale = 2^initial_scale_power, hysteresis counter h = hysteresis
//   overflow:    if hysteresis == 1 or h == 1: scale = max(scale / 2, min_loss_scale)
//                else h -= 1;  the overflow's iteration is remembered
//   no overflow: if (iteration - last overflow iteration) % loss_scale_window == 0:
//                  h = hysteresis; scale *= 2
//   iteration += 1 (every step, skipped or not)
// A static scaler (fp16.loss_scale > 0) keeps its scale; its overflowing steps are skipped too.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace porter::zero {

class LossScaler {
 public:
  // From the fp16 section (enabled or not: a disabled one is static with scale 1). Throws
  // InvalidArgument for a negative loss_scale, a window or hysteresis below 1, or a
  // min_loss_scale <= 0.
  explicit LossScaler(const config::Fp16Config& fp16);

  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  // Applies the step's agreed overflow flag (Note [Dynamic loss scaling]).
  void update(bool overflow);
  int64_t iteration() const { return iter_; }
  int64_t skipped_steps() const { return skipped_; }

  // State for training checkpoints.
  struct State {
    double scale = 1.0;
    int64_t iteration = 0;
    int64_t last_overflow_iteration = -1;
    int64_t hysteresis_left = 1;
    int64_t skipped = 0;
  };
  State state() const;
  void set_state(const State& s);

 private:
  bool dynamic_ = false;
  double scale_ = 1.0;
  int64_t window_ = 1000;
  int64_t hysteresis_ = 2;
  double min_scale_ = 1.0;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
  int64_t hysteresis_left_ = 2;
  int64_t skipped_ = 0;
};

}  // namespace porter::zero
