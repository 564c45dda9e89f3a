// The SGD update, one pass over the flat parameter buffer (PyTorch's
// semantics: weight decay added to the gradient, velocity v = m*v + g,
// Nesterov steps along g + m*v).
#pragma once

#include <cstddef>

namespace loom::cpu {

template <class T>
void sgd_update(T* weights, const T* grads, T* velocity, std::size_t count, T lr, T momentum,
                T weight_decay, bool nesterov) {
  for (std::size_t i = 0; i < count; ++i) {
    T g = grads[i] + weight_decay * weights[i];
    if (momentum != T(0)) {
      velocity[i] = momentum * velocity[i] + g;
      g = nesterov ? g + momentum * velocity[i] : velocity[i];
    }
    weights[i] -= lr * g;
  }
}

}  // namespace loom::cpu
