// Learning-rate schedules: each a factor on the base learning rate as a
// pure function of the optimizer step (from 0) and the fit's total steps,
// so a resumed fit computes the same rates as an uninterrupted one.
// callbacks::LrSchedule applies one before every step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numbers>

#include "../core/error.hpp"

namespace loom::schedules {

struct Constant {
  double operator()(std::size_t, std::size_t) const { return 1.0; }
};

// gamma^(step / every): PyTorch's StepLR, counted in optimizer steps.
struct StepDecay {
  std::size_t every = 1;
  double gamma = 0.1;
  double operator()(std::size_t step, std::size_t) const {
    LOOM_CHECK(every > 0, "schedules::StepDecay: `every` must be at least 1 step");
    return std::pow(gamma, static_cast<double>(step / every));
  }
};

// Half a cosine from 1 down to min_factor over the fit's steps
// (PyTorch's CosineAnnealingLR with T_max = the total steps, eta_min =
// min_factor x the base rate).
struct Cosine {
  double min_factor = 0.0;
  double operator()(std::size_t step, std::size_t total) const {
    if (total == 0) return 1.0;
    const double progress =
        static_cast<double>(std::min(step, total)) / static_cast<double>(total);
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

// A linear ramp from start_factor to 1 over the first `steps` steps
// (PyTorch's LinearLR), then `After` over the remaining ones: warm-up keeps
// the first steps of a large-batch, large-rate run from diverging (Goyal et
// al., "Accurate, Large Minibatch SGD").
template <class After = Constant>
struct Warmup {
  std::size_t steps = 0;
  double start_factor = 0.1;
  After after{};
  double operator()(std::size_t step, std::size_t total) const {
    if (step < steps)
      return start_factor +
             (1.0 - start_factor) * static_cast<double>(step) / static_cast<double>(steps);
    return after(step - steps, total > steps ? total - steps : 0);
  }
};

}  // namespace loom::schedules
