// A loss is a type, as dlib's loss layers are: Trainer<Net, Policy,
// Optimizer, Loss>. A new task is a new loss, not an edit of the trainer or
// the engines. A loss names
//   name                 for messages and the processes' fingerprint;
//   target               what each sample trains against (core/targets.hpp);
//   fits<Out>()          true for a network output shape it suits; for any
//                        other, a compile error in the loss's own words
//                        (consteval, called by the Trainer);
//   compute<Out>(...)    the sums over n samples (cpu::LossSums: the loss
//                        numerator, the exact predictions, an error rate's
//                        edits and references), and when doutputs is given
//                        the gradient of the summed loss times grad_scale;
//   error_rate           the name of its error rate, or nullptr;
//   denominator          what its mean is over (Denominator; samples when
//                        it does not say), counted by compute in
//                        LossSums::denominator.
// A per-sample loss's mean is over samples: the engines scale each
// micro-batch's gradient by 1 / (the global batch's samples), as always.
// (CTCLoss divides each sample's loss by its target length first, as
// PyTorch's reduction='mean'.) Any other denominator is known only once the
// whole optimizer step is seen: the engines compute its micro-batches'
// gradients unscaled, sum the denominator over the accumulated batches and
// the grid, and divide the gradients by it before the step's update, so
// every policy reproduces one device for per-position means too.
#pragma once

#include <concepts>
#include <cstddef>

#include "../backend/cpu/loss_sums.hpp"
#include "../core/targets.hpp"

namespace loom {

// What a loss's mean divides by: the global batch's samples, its counted
// output positions (PositionCrossEntropy), or its target labels.
enum class Denominator { samples, positions, labels };

inline constexpr const char* denominator_name(Denominator d) {
  switch (d) {
    case Denominator::samples: return "samples";
    case Denominator::positions: return "positions";
    case Denominator::labels: return "labels";
  }
  return "?";
}

// A loss's Denominator: its own, or samples when it names none.
template <class L>
inline constexpr Denominator denominator_of = [] {
  if constexpr (requires { L::denominator; })
    return static_cast<Denominator>(L::denominator);
  else
    return Denominator::samples;
}();

template <class L>
concept LossType = requires {
  { L::name } -> std::convertible_to<const char*>;
  { L::target } -> std::convertible_to<TargetKind>;
};

namespace detail {

// A loss behind a type-erased face: the engines are compiled once, not per
// loss (STYLE.md: templates below the interface, virtual calls above it).
class LossOps {
 public:
  virtual ~LossOps() = default;
  virtual const char* name() const = 0;
  virtual TargetKind target() const = 0;
  virtual Denominator denominator() const = 0;
  virtual cpu::LossSums compute(const float* outputs, std::size_t n, const Targets& targets,
                                float grad_scale, float* doutputs) const = 0;
  // How many rows of the output, per sample, compute() takes a softmax of
  // against a class label each (the loss's class_softmax: 1, a sample's
  // scores; its position_softmax: one per output position), the gradient
  // (softmax - one-hot) x scale; 0 for any other arithmetic. A backend
  // holding that op may run it in compute()'s place, knowing the
  // arithmetic, not the loss.
  virtual std::size_t softmax_rows() const = 0;
};

template <class Loss, class Out>
class LossOpsOf final : public LossOps {
 public:
  const char* name() const override { return Loss::name; }
  TargetKind target() const override { return Loss::target; }
  Denominator denominator() const override { return denominator_of<Loss>; }
  cpu::LossSums compute(const float* outputs, std::size_t n, const Targets& targets,
                        float grad_scale, float* doutputs) const override {
    return Loss::template compute<Out, float>(outputs, n, targets, grad_scale, doutputs);
  }
  std::size_t softmax_rows() const override {
    if constexpr (requires { Loss::class_softmax; })
      return Loss::class_softmax ? 1 : 0;
    else if constexpr (requires { Loss::position_softmax; })
      return Loss::position_softmax ? Out::dims[0] : 0;
    else
      return 0;
  }
};

// One instance per (loss, output shape), alive for the program.
template <class Loss, class Out>
const LossOps& loss_ops() {
  static const LossOpsOf<Loss, Out> ops;
  return ops;
}

}  // namespace detail
}  // namespace loom
