// SoftmaxCrossEntropy: mean cross-entropy of softmax(logits) over the global
// batch, with its gradient written in the same pass.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../backend/cpu/softmax_xent.hpp"

namespace loom {

struct SoftmaxCrossEntropy {
  using Sums = cpu::LossSums;

  // Loss and correct-count sums over `batch` rows; when dlogits is given it
  // receives d(mean loss over global_batch)/d(logits).
  template <class T>
  static Sums evaluate(const T* logits, const std::int32_t* labels, std::size_t batch,
                       std::size_t classes, std::size_t global_batch, T* dlogits) {
    return cpu::softmax_xent(logits, labels, batch, classes, T(1) / static_cast<T>(global_batch),
                             dlogits);
  }
};

}  // namespace loom
