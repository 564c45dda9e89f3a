// GlobalAvgPool: C x H x W becomes C, each channel's mean (ResNet's head).
// Reshape<Dims...>: the same elements seen as another shape, e.g. a 1 x 28 x
// 28 image as a sequence of 28 rows of 28 features, Reshape<28, 28>, for a
// GRU or LSTM. Like Flatten it aliases its input.
#pragma once

#include <cstddef>
#include <string_view>

#include "flatten.hpp"
#include "layer.hpp"

namespace loom {

struct GlobalAvgPool {};

template <std::size_t... Dims>
struct Reshape {};

namespace detail {

template <class At, class Layer, std::size_t Expected, std::size_t Actual>
struct layer_size_mismatch_at {
  static_assert(Expected == Actual,
                "loom shape error: Reshape's shape has a different number of elements than its "
                "input (template arguments: layer path, layer, input elements, reshaped "
                "elements)");
  static constexpr bool ok = Expected == Actual;
};
template <std::size_t Index, class Layer, std::size_t Expected, std::size_t Actual>
using layer_size_mismatch = layer_size_mismatch_at<layer_path_t<Index>, Layer, Expected, Actual>;

}  // namespace detail

template <class In, std::size_t Index>
struct Bind<GlobalAvgPool, In, Index>
    : LayerBase<GlobalAvgPool, In, Shape<detail::dim_or_one<In, 0>>, Index> {
  static constexpr bool checked =
      detail::layer_input_rank_mismatch<Index, GlobalAvgPool, 3, In::rank>::ok;
  static constexpr std::size_t channels = detail::dim_or_one<In, 0>;
  static constexpr std::size_t plane = In::size / channels;
  static constexpr std::size_t forward_flops = In::size;
  static constexpr std::size_t backward_flops = In::size;
  static constexpr std::string_view kind = "globalavgpool";

  template <class T>
  static void forward(const T*, const T* x, T* y, T*, std::size_t n) {
    for (std::size_t s = 0; s < n * channels; ++s) {
      T sum = 0;
      for (std::size_t i = 0; i < plane; ++i) sum += x[s * plane + i];
      y[s] = sum / static_cast<T>(plane);
    }
  }

  template <class T>
  static void backward(const T*, const T*, const T*, const T* dy, T* dx, T*, T*, std::size_t n,
                       bool) {
    if (dx == nullptr) return;
    for (std::size_t s = 0; s < n * channels; ++s)
      for (std::size_t i = 0; i < plane; ++i) dx[s * plane + i] = dy[s] / static_cast<T>(plane);
  }
};

template <std::size_t... Dims, class In, std::size_t Index>
struct Bind<Reshape<Dims...>, In, Index>
    : detail::AliasLayer<Reshape<Dims...>, In, Shape<Dims...>, Index> {
  static constexpr bool checked =
      detail::layer_size_mismatch<Index, Reshape<Dims...>, In::size, Shape<Dims...>::size>::ok;
};

}  // namespace loom
