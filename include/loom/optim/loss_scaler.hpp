// Dynamic loss scaling for fp16 (PyTorch's GradScaler): the loss gradient
// is multiplied by a large scale so that small gradients survive fp16's
// narrow range; the gradients are divided by it again in fp32 before the
// update. A step whose gradients overflowed is skipped and the scale backs
// off; after growth_interval good steps in a row it grows.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include "../core/error.hpp"

namespace loom {

struct LossScaling {
  float initial_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::size_t growth_interval = 2000;
};

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
  }

  float scale() const { return scale_; }
  std::size_t good_steps() const { return good_steps_; }
  // A checkpoint's scaler.
  void restore(float scale, std::size_t good_steps) {
    LOOM_CHECK(scale > 0.0f && std::isfinite(scale), "loss scale ", scale,
               " must be positive and finite");
    scale_ = scale;
    good_steps_ = good_steps;
  }

  // After a step: `overflowed` when its gradients were not finite.
  void update(bool overflowed) {
    if (overflowed) {
      scale_ *= options_.backoff_factor;
      good_steps_ = 0;
    } else if (++good_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
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
