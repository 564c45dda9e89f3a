// Dynamic loss scaling for fp16 (PyTorch's GradScaler): the loss gradient
// is multiplied by a large scale so that small gradients survive fp16's
// narrow range; the gradients are divided by it again in fp32 before the
// update. A step whose gradients overflowed is skipped and the scale backs
// off; after growth_interval good steps in a row it grows. Unlike PyTorch's,
// the scale stays within [min_scale, max_scale]: the trainer takes an
// overflow at min_scale for non-finite gradients (FitOptions::on_nonfinite),
// not for a scale too large.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "../core/error.hpp"
#include "../core/precision.hpp"

namespace loom {

class LossScaler {
 public:
  explicit LossScaler(LossScaling options = {}) : options_(options), scale_(options.initial_scale) {
    LOOM_CHECK(options.initial_scale > 0.0f && std::isfinite(options.initial_scale),
               "LossScaling: initial_scale must be positive and finite, got ",
               options.initial_scale);
    LOOM_CHECK(options.growth_factor > 1.0f, "LossScaling: growth_factor must be > 1, got ",
               options.growth_factor);
    LOOM_CHECK(options.backoff_factor > 0.0f && options.backoff_factor < 1.0f,
               "LossScaling: backoff_factor must be in (0, 1), got ", options.backoff_factor);
    LOOM_CHECK(options.growth_interval > 0, "LossScaling: growth_interval must be at least 1");
    LOOM_CHECK(options.min_scale > 0.0f && std::isfinite(options.max_scale),
               "LossScaling: min_scale and max_scale must be positive and finite, got ",
               options.min_scale, " and ", options.max_scale);
    LOOM_CHECK(options.min_scale <= options.initial_scale &&
                   options.initial_scale <= options.max_scale,
               "LossScaling: initial_scale ", options.initial_scale, " must lie within min_scale ",
               options.min_scale, " and max_scale ", options.max_scale,
               "; widen the bounds or change the initial scale");
  }

  float scale() const { return scale_; }
  std::size_t good_steps() const { return good_steps_; }
  // Backing off cannot help a step that overflows now.
  bool at_min_scale() const { return scale_ <= options_.min_scale; }
  // A checkpoint's scaler, brought within this scaler's bounds (a checkpoint
  // written under other bounds resumes as these would have left it).
  void restore(float scale, std::size_t good_steps) {
    LOOM_CHECK(scale > 0.0f && std::isfinite(scale), "loss scale ", scale,
               " must be positive and finite");
    scale_ = std::clamp(scale, options_.min_scale, options_.max_scale);
    good_steps_ = good_steps;
  }

  // After a step: `overflowed` when its gradients were not finite.
  void update(bool overflowed) {
    if (overflowed) {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      good_steps_ = 0;
    } else if (++good_steps_ >= options_.growth_interval) {
      scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
      good_steps_ = 0;
    }
  }

 private:
  LossScaling options_;
  float scale_;
  std::size_t good_steps_ = 0;
};

// Divides scaled gradients by `scale`; false when any is not finite (the
// step must then be skipped).
inline bool unscale_gradients(std::span<float> grads, float scale) {
  const float inverse = 1.0f / scale;
  bool finite = true;
  for (float& g : grads) {
    g *= inverse;
    finite = finite && std::isfinite(g);
  }
  return finite;
}

}  // namespace loom
