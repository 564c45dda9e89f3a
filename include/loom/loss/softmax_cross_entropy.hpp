// SoftmaxCrossEntropy: mean cross-entropy of softmax(logits) over the global
// batch, with its gradient written in the same pass. Trains a flat vector of
// class scores against one class per sample.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../backend/cpu/softmax_xent.hpp"
#include "../core/targets.hpp"
#include "loss.hpp"

namespace loom {

struct SoftmaxCrossEntropy {
  using Sums = cpu::LossSums;
  static constexpr const char* name = "SoftmaxCrossEntropy";
  static constexpr TargetKind target = TargetKind::class_label;
  static constexpr const char* error_rate = nullptr;
  // A softmax over each sample's scores against its class label
  // (LossOps::softmax_rows): what a GPU runs on the device.
  static constexpr bool class_softmax = true;
  // Compiles only for an output it suits (the Trainer calls it).
  template <class Out>
  static consteval bool fits() {
    static_assert(Out::rank == 1,
                  "SoftmaxCrossEntropy trains one flat vector of class scores per sample: end "
                  "the network with Linear<classes> over a flat input (Flatten first); a class "
                  "per position is PositionCrossEntropy's");
    return true;
  }

  // Loss and correct-count sums over `batch` rows; when dlogits is given it
  // receives d(mean loss over global_batch)/d(logits), times loss_scale
  // (fp16's loss scaling).
  template <class T>
  static Sums evaluate(const T* logits, const std::int32_t* labels, std::size_t batch,
                       std::size_t classes, std::size_t global_batch, T* dlogits,
                       float loss_scale = 1.0f) {
    auto sums = cpu::softmax_xent(logits, labels, batch, classes,
                                  static_cast<T>(loss_scale) / static_cast<T>(global_batch),
                                  dlogits);
    sums.denominator = static_cast<double>(batch);
    return sums;
  }

  template <class Out, class T>
  static Sums compute(const T* logits, std::size_t n, const Targets& targets, T grad_scale,
                      T* dlogits) {
    auto sums = cpu::softmax_xent(logits, targets.labels, n, Out::size, grad_scale, dlogits);
    sums.denominator = static_cast<double>(n);
    return sums;
  }
};

}  // namespace loom
