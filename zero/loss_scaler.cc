// fp16 loss scaling (Note [Dynamic loss scaling]).
#include "zero/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"

namespace porter::zero {

LossScaler::LossScaler(const config::Fp16Config& fp16) {
  PORTER_CHECK(fp16.loss_scale >= 0.0, "fp16.loss_scale: expected 0 (dynamic) or a positive "
               "static scale, got ", fp16.loss_scale);
  if (!fp16.enabled) return;  // static 1
  dynamic_ = fp16.loss_scale == 0.0;
  if (!dynamic_) {
    scale_ = fp16.loss_scale;
    return;
  }
  PORTER_CHECK(fp16.loss_scale_window >= 1, "fp16.loss_scale_window: expected >= 1, got ",
               fp16.loss_scale_window);
  PORTER_CHECK(fp16.hysteresis >= 1, "fp16.hysteresis: expected >= 1, got ", fp16.hysteresis);
  PORTER_CHECK(fp16.min_loss_scale > 0.0, "fp16.min_loss_scale: expected > 0, got ",
               fp16.min_loss_scale);
  PORTER_CHECK(fp16.initial_scale_power >= 0 && fp16.initial_scale_power <= 126,
               "fp16.initial_scale_power: expected 0..126, got ", fp16.initial_scale_power);
  scale_ = std::ldexp(1.0, static_cast<int>(fp16.initial_scale_power));
  window_ = fp16.loss_scale_window;
  hysteresis_ = fp16.hysteresis;
  hysteresis_left_ = fp16.hysteresis;
  min_scale_ = fp16.min_loss_scale;
}

void LossScaler::update(bool overflow) {
  if (overflow) ++skipped_;
  if (dynamic_) {
    if (overflow) {
      if (hysteresis_ == 1 || hysteresis_left_ == 1) {
        scale_ = std::max(scale_ / 2.0, min_scale_);
      } else {
        --hysteresis_left_;
      }
      last_overflow_iter_ = iter_;
    } else if ((iter_ - last_overflow_iter_) % window_ == 0) {
      hysteresis_left_ = hysteresis_;
      scale_ *= 2.0;
    }
  }
  ++iter_;
}

LossScaler::State LossScaler::state() const {
  return {scale_, iter_, last_overflow_iter_, hysteresis_left_, skipped_};
}

void LossScaler::set_state(const State& s) {
  PORTER_CHECK(s.scale > 0.0 && std::isfinite(s.scale), "loss scale ", s.scale,
               " must be positive and finite");
  scale_ = s.scale;
  iter_ = s.iteration;
  last_overflow_iter_ = s.last_overflow_iteration;
  hysteresis_left_ = s.hysteresis_left;
  skipped_ = s.skipped;
}

}  // namespace porter::zero
