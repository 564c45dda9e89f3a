// Conv2d<Out, K, Stride, Pad>: Out filters of K x K over all input channels
// (inferred), zero padding Pad. Parameters: weight [Out, C, K, K], bias [Out].
// Forward and backward lower to GEMMs over chunks of samples (im2col); the
// bias and, when fused, the ReLU run in the pass that lays the GEMM output
// out as N x Out x H x W.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

#include "../backend/cpu/cpu.hpp"
#include "../core/activation.hpp"
#include "layer.hpp"
#include "relu.hpp"

namespace loom {

template <std::size_t Out_, std::size_t K_, std::size_t Stride_ = 1, std::size_t Pad_ = 0>
struct Conv2d {
  static constexpr std::size_t out_channels = Out_;
  static constexpr std::size_t kernel = K_;
  static constexpr std::size_t stride = Stride_;
  static constexpr std::size_t pad = Pad_;
};

namespace detail {

template <class Spec, class In, std::size_t Index, Act A>
struct ConvLayer;

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, class In, std::size_t Index,
          Act A>
struct ConvLayer<Conv2d<Out, K, S, P>, In, Index, A>
    : LayerBase<Conv2d<Out, K, S, P>, In,
                Shape<Out, window_out(dim_or_one<In, 1>, K, S, P),
                      window_out(dim_or_one<In, 2>, K, S, P)>,
                Index> {
  using Spec = Conv2d<Out, K, S, P>;
  // The padded input, or K after a rank error so that only that error shows.
  static constexpr std::size_t padded_height = In::rank == 3 ? dim_or_one<In, 1> + 2 * P : K;
  static constexpr std::size_t padded_width = In::rank == 3 ? dim_or_one<In, 2> + 2 * P : K;
  static constexpr bool checked =
      layer_argument_must_be_positive<Index, Spec, Out>::ok &&
      layer_argument_must_be_positive<Index, Spec, K>::ok &&
      layer_argument_must_be_positive<Index, Spec, S>::ok &&
      layer_input_rank_mismatch<Index, Spec, 3, In::rank>::ok &&
      layer_window_larger_than_input<Index, Spec, K, padded_height>::ok &&
      layer_window_larger_than_input<Index, Spec, K, padded_width>::ok;

  static constexpr std::size_t channels = dim_or_one<In, 0>;
  static constexpr std::size_t height = dim_or_one<In, 1>;
  static constexpr std::size_t width = dim_or_one<In, 2>;
  static constexpr std::size_t out_height = window_out(height, K, S, P);
  static constexpr std::size_t out_width = window_out(width, K, S, P);
  static constexpr std::size_t plane = out_height * out_width;
  static constexpr std::size_t patch = channels * K * K;

  static constexpr std::size_t weight_count = Out * patch;
  static constexpr std::size_t bias_count = Out;
  static constexpr std::size_t param_count = weight_count + bias_count;
  // Column matrix (reused for its gradient) + the GEMM output / its gradient,
  // for one chunk of samples at a time.
  static constexpr std::size_t workspace = patch * plane + Out * plane;
  static constexpr std::size_t chunk = cpu::conv_chunk_for(patch * plane);
  static constexpr std::size_t forward_flops = 2 * Out * plane * patch + Out * plane;
  // The input-gradient GEMM is skipped for the network's first layer.
  static constexpr std::size_t backward_flops =
      (Index == 1 ? 2 : 4) * Out * plane * patch + Out * plane;
  static constexpr std::string_view kind = "conv";
  static constexpr Act activation = A;

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {Out, channels, K, K}, false);
    visit("bias", weight_count, {Out}, false);
  }

  static cpu::ConvGeometry geometry(std::size_t n) {
    return {n, channels, height, width, K, S, P, out_height, out_width};
  }

  template <class T>
  static void init(T* params, std::uint64_t seed, bool relu_follows) {
    init_uniform(params, weight_count, init_limit(patch, Out * K * K, relu_follows), seed, Index);
    for (std::size_t i = 0; i < bias_count; ++i) params[weight_count + i] = T(0);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n) {
    for (std::size_t first = 0; first < n; first += chunk) {
      const auto g = geometry(std::min(chunk, n - first));
      T* col = work;
      T* cols_out = work + patch * g.cols();
      cpu::im2col(g, x + first * In::size, col);
      cpu::gemm<T>(false, false, Out, g.cols(), patch, T(1), params, patch, col, g.cols(), T(0),
                   cols_out, g.cols());
      cpu::bias_act_cols<A>(cols_out, params + weight_count, y + first * Out * plane, g.batch, Out,
                            plane);
    }
  }

  // Per chunk: dW (+)= dZ * col^T; dcol = W^T * dZ; dx = col2im(dcol), skipped
  // for the first layer (dx == nullptr). col is rebuilt from x rather than
  // kept from forward: it is the largest buffer and im2col is cheap next to
  // the GEMMs. Chunks after the first add to the gradients.
  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t n, bool accumulate) {
    for (std::size_t first = 0; first < n; first += chunk) {
      const auto g = geometry(std::min(chunk, n - first));
      const bool add = accumulate || first > 0;
      const std::size_t out_offset = first * Out * plane;
      T* col = work;
      T* dz = work + patch * g.cols();
      cpu::bias_act_backward_cols<A>(dy + out_offset, y + out_offset, dz, dparams + weight_count,
                                     g.batch, Out, plane, add);
      cpu::im2col(g, x + first * In::size, col);
      cpu::gemm<T>(false, true, Out, patch, g.cols(), T(1), dz, g.cols(), col, g.cols(),
                   add ? T(1) : T(0), dparams, patch);
      if (dx == nullptr) continue;
      cpu::gemm<T>(true, false, patch, g.cols(), Out, T(1), params, patch, dz, g.cols(), T(0), col,
                   g.cols());
      cpu::col2im(g, col, dx + first * In::size);
    }
  }
};

}  // namespace detail

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, class In, std::size_t Index>
struct Bind<Conv2d<Out, K, S, P>, In, Index>
    : detail::ConvLayer<Conv2d<Out, K, S, P>, In, Index, Act::identity> {};

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, class In, std::size_t Index>
struct Bind<Fused<Conv2d<Out, K, S, P>, ReLU>, In, Index>
    : detail::ConvLayer<Conv2d<Out, K, S, P>, In, Index, Act::relu> {};

}  // namespace loom
