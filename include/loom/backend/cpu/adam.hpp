// The Adam update, one pass over the flat parameter buffer (PyTorch's
// semantics). Adam adds weight decay to the gradient (L2); AdamW decays the
// weights apart from the gradient ("decoupled", Loshchilov & Hutter).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../../core/host_device.hpp"

namespace loom::cpu {

struct AdamStep {
  double lr = 0.0;
  double beta1 = 0.0, beta2 = 0.0, eps = 0.0;
  double weight_decay = 0.0;
  bool decoupled = false;
  std::uint64_t t = 1;  // this step's number, from 1: the bias corrections
};

// A step's scalars, the same for every element: computed once in double
// (the GPU's update reads the same ones, rounded to float alike).
struct AdamScalars {
  double step_size = 0.0;    // lr / (1 - beta1^t): the first moment's bias correction
  double correction2 = 1.0;  // 1 / sqrt(1 - beta2^t): the second moment's
  double decay = 1.0;        // AdamW's 1 - lr * weight_decay (1 for Adam)
};

inline AdamScalars adam_scalars(const AdamStep& s) {
  const auto t = static_cast<double>(s.t);
  return {.step_size = s.lr / (1.0 - std::pow(s.beta1, t)),
          .correction2 = 1.0 / std::sqrt(1.0 - std::pow(s.beta2, t)),
          .decay = s.decoupled ? 1.0 - s.lr * s.weight_decay : 1.0};
}

template <class T>
LOOM_CPU_KERNEL void adam_update(T* weights, const T* grads, T* exp_avg, T* exp_avg_sq,
                                 std::size_t count, const AdamStep& s) {
  const AdamScalars k = adam_scalars(s);
  const T step_size = static_cast<T>(k.step_size);
  const T correction2 = static_cast<T>(k.correction2);
  const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2);
  const T one_minus_b1 = static_cast<T>(1.0 - s.beta1), one_minus_b2 = static_cast<T>(1.0 - s.beta2);
  const T eps = static_cast<T>(s.eps);
  const T decay = static_cast<T>(k.decay);
  const T l2 = static_cast<T>(s.decoupled ? 0.0 : s.weight_decay);
  for (std::size_t i = 0; i < count; ++i) {
    const T g = grads[i] + l2 * weights[i];
    const T m = b1 * exp_avg[i] + one_minus_b1 * g;
    const T v = b2 * exp_avg_sq[i] + one_minus_b2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    weights[i] = weights[i] * decay - step_size * m / (std::sqrt(v) * correction2 + eps);
  }
}

}  // namespace loom::cpu
