// A loss is a type, as dlib's loss layers are: Trainer<Net, Policy,
// Optimizer, Loss>. A new task is a new loss, not an edit of the trainer or
// the engines. A loss names
//   name                 for messages and the processes' fingerprint;
//   target               what each sample trains against (core/targets.hpp);
//   fits<Out>            whether the network's output shape suits it (checked
//                        at compile time, with a message naming the loss);
//   compute<Out>(...)    the sums over n samples (cpu::LossSums: the loss
//                        numerator, the exact predictions, an error rate's
//                        edits and references), and when doutputs is given
//                        the gradient of the summed loss times grad_scale;
//   error_rate           the name of its error rate, or nullptr.
// Its mean is over samples: the engines scale each micro-batch's gradient
// by 1 / (the global batch's samples), so every policy reproduces one
// device. (CTCLoss divides each sample's loss by its target length first,
// as PyTorch's reduction='mean'.)
#pragma once

#include <concepts>
#include <cstddef>

#include "../backend/cpu/loss_sums.hpp"
#include "../core/targets.hpp"

namespace loom {

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
  virtual cpu::LossSums compute(const float* outputs, std::size_t n, const Targets& targets,
                                float grad_scale, float* doutputs) const = 0;
};

template <class Loss, class Out>
class LossOpsOf final : public LossOps {
 public:
  const char* name() const override { return Loss::name; }
  TargetKind target() const override { return Loss::target; }
  cpu::LossSums compute(const float* outputs, std::size_t n, const Targets& targets,
                        float grad_scale, float* doutputs) const override {
    return Loss::template compute<Out, float>(outputs, n, targets, grad_scale, doutputs);
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
