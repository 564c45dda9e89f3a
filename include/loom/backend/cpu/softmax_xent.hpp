// Softmax + cross-entropy, forward and backward in one pass over the logits:
// each row's probabilities are formed once and turned straight into the
// gradient, never stored.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../../core/error.hpp"
#include "loss_sums.hpp"

namespace loom::cpu {

// dlogits = (softmax(logits) - onehot(label)) * grad_scale when dlogits is not
// null. grad_scale is 1 / (global batch), so replicas and micro-batches that
// each hold part of a batch add up to the gradient of the global mean loss.
template <class T>
LossSums softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                      std::size_t classes, T grad_scale, T* dlogits) {
  LossSums sums;
  for (std::size_t n = 0; n < batch; ++n) {
    const T* row = logits + n * classes;
    const auto label = labels[n];
    LOOM_CHECK(label >= 0 && static_cast<std::size_t>(label) < classes, "label ", label,
               " of sample ", n, " is outside the network's ", classes, " classes");
    std::size_t best = 0;
    for (std::size_t c = 1; c < classes; ++c)
      if (row[c] > row[best]) best = c;
    const T top = row[best];
    T total = T(0);
    for (std::size_t c = 0; c < classes; ++c) total += std::exp(row[c] - top);
    const T log_total = std::log(total);
    sums.loss -= static_cast<double>(row[label] - top - log_total);
    sums.correct += best == static_cast<std::size_t>(label) ? 1 : 0;
    if (dlogits != nullptr) {
      T* grad = dlogits + n * classes;
      for (std::size_t c = 0; c < classes; ++c) {
        const T p = std::exp(row[c] - top - log_total);
        grad[c] = (p - (c == static_cast<std::size_t>(label) ? T(1) : T(0))) * grad_scale;
      }
    }
  }
  return sums;
}

}  // namespace loom::cpu
