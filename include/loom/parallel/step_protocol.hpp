// The end of every optimizer step, written once for every policy and
// backend: once the step's gradients are summed (and reduced over the
// replicas), check them, unscale fp16's, clip, then update, or skip the step
// and put the running statistics back. The grid engine calls step_protocol
// over its ranks' stages (every policy, on CPUs and GPUs alike).
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/precision.hpp"
#include "../net/model.hpp"
#include "../optim/clip.hpp"
#include "../optim/loss_scaler.hpp"
#include "crew.hpp"

namespace loom::detail {

// What an executor (one device, a replica or a pipeline rank) provides. Its
// answers are the whole grid's: a rank's executor agrees with the others
// (an all-reduce of the stage's flags, say) before it answers, so that every
// rank takes the same branch.
template <class X>
concept StepExecutor = requires(X& x, float value, bool flag) {
  { x.loss_finite() } -> std::same_as<bool>;
  // fp32 and bf16 only: fp16's gradients are checked by unscaling them.
  { x.gradients_finite() } -> std::same_as<bool>;
  // Divides the gradients by the scale; false when one overflowed.
  { x.unscale(value) } -> std::same_as<bool>;
  // The step is not taken: put the running statistics back and find the
  // spot to name, the first non-finite output or input (with a non-finite
  // loss, `gradients` false) or the first non-finite gradient.
  x.skip_nonfinite(flag);
  // fp16's gradients overflowed: put the running statistics back; at the
  // minimum scale (`name_spot`) find the first non-finite gradient.
  x.skip_overflow(flag);
  x.clip(value);    // to this global norm, over every layer and stage
  x.update(value);  // the optimizer's step at this learning rate
};

enum class StepEnd { updated, nonfinite, overflowed };

// The step protocol's decisions, in the order the CPU has always taken
// them (the same float operations in the same order: policies reproduce
// one device bit for bit where their tests say so).
template <StepExecutor X>
StepEnd step_protocol(X& x, const StepSettings& settings) {
  const bool fp16 = settings.precision == Precision::fp16;
  const bool loss_finite = x.loss_finite();
  if (!loss_finite || (!fp16 && !x.gradients_finite())) {
    x.skip_nonfinite(loss_finite);
    return StepEnd::nonfinite;
  }
  if (fp16 && !x.unscale(settings.loss_scale)) {
    x.skip_overflow(settings.at_min_scale);
    return StepEnd::overflowed;
  }
  if (settings.max_grad_norm > 0.0f) x.clip(settings.max_grad_norm);
  x.update(settings.lr);
  return StepEnd::updated;
}

// The spot of a non-finite step that comes first over every rank of `c`
// (NonFiniteSpot::before; the lowest rank on a tie), on every rank: each
// rank's spot as numbers in its own entries, one sum (one non-zero term
// per entry: exact). Collective; run only for a step gone non-finite.
inline NonFiniteSpot agree_on_spot(comm::Comm& c, const NonFiniteSpot& mine) {
  constexpr std::size_t fields = 7;
  const auto ranks = static_cast<std::size_t>(c.size());
  std::vector<double> all(ranks * fields, 0.0);
  double* own = all.data() + static_cast<std::size_t>(c.rank()) * fields;
  own[0] = static_cast<double>(mine.where);
  own[1] = static_cast<double>(mine.layer);
  own[2] = static_cast<double>(mine.block);
  own[3] = static_cast<double>(mine.element);
  own[4] = static_cast<double>(mine.size);
  own[5] = static_cast<double>(mine.sample);
  own[6] = std::isnan(mine.value) ? 0.0 : mine.value > 0 ? 1.0 : -1.0;  // no nan in the sum
  c.all_reduce(std::span<double>(all), comm::ReduceOp::sum);
  NonFiniteSpot first;
  for (std::size_t r = 0; r < ranks; ++r) {
    const double* f = all.data() + r * fields;
    const NonFiniteSpot spot{static_cast<NonFiniteSpot::Where>(f[0]),
                             static_cast<std::size_t>(f[1]),
                             static_cast<std::size_t>(f[2]),
                             static_cast<std::size_t>(f[3]),
                             static_cast<std::size_t>(f[4]),
                             static_cast<std::size_t>(f[5]),
                             f[6] == 0.0 ? std::numeric_limits<float>::quiet_NaN()
                                         : static_cast<float>(f[6]) *
                                               std::numeric_limits<float>::infinity()};
    if (spot && (!first || spot.before(first))) first = spot;
  }
  return first;
}

}  // namespace loom::detail
