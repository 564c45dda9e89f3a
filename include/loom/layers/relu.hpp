// ReLU: y = max(x, 0). Standalone it is one elementwise pass each way; after
// Linear or Conv2d the fusion pass folds it into their epilogue.
#pragma once

#include <cstddef>
#include <string_view>

#include "../backend/cpu/epilogue.hpp"
#include "layer.hpp"

namespace loom {

struct ReLU {};

template <class In, std::size_t Index>
struct Bind<ReLU, In, Index> : LayerBase<ReLU, In, In, Index> {
  static constexpr bool is_relu = true;
  static constexpr std::size_t forward_flops = In::size;
  static constexpr std::size_t backward_flops = In::size;
  static constexpr std::string_view kind = "relu";

  template <class T>
  static void forward(const T*, const T* x, T* y, T*, std::size_t n) {
    cpu::activation_forward<Act::relu>(x, y, n * In::size);
  }

  template <class T>
  static void backward(const T*, const T*, const T* y, const T* dy, T* dx, T*, T*, std::size_t n,
                       bool) {
    if (dx != nullptr) cpu::activation_backward<Act::relu>(dy, y, dx, n * In::size);
  }
};

}  // namespace loom
