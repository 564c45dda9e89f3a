// MaxPool2d<K, Stride> and AvgPool2d<K, Stride>: K x K windows per channel,
// no padding, floor-mode output size, no parameters.
#pragma once

#include <cstddef>
#include <string_view>

#include "../backend/cpu/pool.hpp"
#include "layer.hpp"

namespace loom {

template <std::size_t K_, std::size_t Stride_ = K_>
struct MaxPool2d {
  static constexpr std::size_t kernel = K_;
  static constexpr std::size_t stride = Stride_;
};

template <std::size_t K_, std::size_t Stride_ = K_>
struct AvgPool2d {
  static constexpr std::size_t kernel = K_;
  static constexpr std::size_t stride = Stride_;
};

namespace detail {

template <class Spec, class In, std::size_t Index, bool Max>
struct PoolLayer
    : LayerBase<
          Spec, In,
          Shape<dim_or_one<In, 0>, window_out(dim_or_one<In, 1>, Spec::kernel, Spec::stride, 0),
                window_out(dim_or_one<In, 2>, Spec::kernel, Spec::stride, 0)>,
          Index> {
  static constexpr std::size_t K = Spec::kernel;
  static constexpr std::size_t S = Spec::stride;
  // The input, or K after a rank error so that only that error shows.
  static constexpr std::size_t in_height = In::rank == 3 ? dim_or_one<In, 1> : K;
  static constexpr std::size_t in_width = In::rank == 3 ? dim_or_one<In, 2> : K;
  static constexpr bool checked = layer_argument_must_be_positive<Index, Spec, K>::ok &&
                                  layer_argument_must_be_positive<Index, Spec, S>::ok &&
                                  layer_input_rank_mismatch<Index, Spec, 3, In::rank>::ok &&
                                  layer_window_larger_than_input<Index, Spec, K, in_height>::ok &&
                                  layer_window_larger_than_input<Index, Spec, K, in_width>::ok;
  using Out = Shape<dim_or_one<In, 0>, window_out(dim_or_one<In, 1>, K, S, 0),
                    window_out(dim_or_one<In, 2>, K, S, 0)>;
  static constexpr std::size_t forward_flops = Out::size * K * K;
  static constexpr std::size_t backward_flops = Out::size * K * K + In::size;
  static constexpr std::string_view kind = Max ? "maxpool" : "avgpool";

  static cpu::PoolGeometry geometry(std::size_t n) {
    return {n * Out::dims[0], dim_or_one<In, 1>, dim_or_one<In, 2>, K, S,
            Out::dims[1],     Out::dims[2]};
  }

  template <class T>
  static void forward(const T*, const T* x, T* y, T*, std::size_t n) {
    cpu::pool_forward<Max>(geometry(n), x, y);
  }

  template <class T>
  static void backward(const T*, const T* x, const T*, const T* dy, T* dx, T*, T*, std::size_t n,
                       bool) {
    if (dx == nullptr) return;
    if constexpr (Max)
      cpu::max_pool_backward(geometry(n), x, dy, dx);
    else
      cpu::avg_pool_backward(geometry(n), dy, dx);
  }
};

}  // namespace detail

template <std::size_t K, std::size_t S, class In, std::size_t Index>
struct Bind<MaxPool2d<K, S>, In, Index> : detail::PoolLayer<MaxPool2d<K, S>, In, Index, true> {};

template <std::size_t K, std::size_t S, class In, std::size_t Index>
struct Bind<AvgPool2d<K, S>, In, Index> : detail::PoolLayer<AvgPool2d<K, S>, In, Index, false> {};

}  // namespace loom
