// Linear's shares under tensor parallelism (Megatron's splits), on one rank
// of a tensor group of Tensor ranks. TensorParallel's sharded network
// (parallel/tensor_parallel.hpp) is made of them; nobody writes them by hand.
//
//   TensorColumns<Linear<N>, Tensor>  column-parallel: the rank's N / Tensor
//       rows of the weight and of the bias; its output is its block of the
//       features. Backward sums the ranks' parts of the input gradient.
//   TensorRows<Linear<N>, Tensor>     row-parallel: takes the rank's block of
//       the features (a TensorColumns' output, through pointwise layers) and
//       holds the matching columns of the weight; forward sums the ranks'
//       partial products, then adds the bias, which every rank holds whole.
//   TensorGather<Linear<N>, Tensor>   column-parallel whose outputs are
//       gathered: the network's last Linear (the vocabulary's scores), so
//       the loss sees every score on every rank.
//
// A pair TensorColumns, TensorRows moves one sum forward and one back,
// whatever lies between them, and leaves the features after it equal on
// every rank, bit for bit (TensorGroup's sums are), so layers outside the
// pairs (norms, embeddings) run whole on every rank and get the same
// gradients there.
//
// Each share names where its parameters lie in the whole layer's
// (tensor_segments: visit(whole offset, own offset, count, split)), from
// which the engine cuts each rank's weights and gathers checkpoints whole.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

#include "../backend/cpu/cpu.hpp"
#include "../backend/cpu/epilogue.hpp"
#include "../core/error.hpp"
#include "layer.hpp"
#include "linear.hpp"
#include "relu.hpp"

namespace loom {

template <class Layer, std::size_t Tensor>
struct TensorColumns {};
template <class Layer, std::size_t Tensor>
struct TensorRows {};
template <class Layer, std::size_t Tensor>
struct TensorGather {};

namespace detail {

// `what`: 0 the output features of a Linear whose outputs are split, 1 the
// vocabulary (the network's last Linear).
template <class At, class Layer, std::size_t Features, std::size_t Tensor>
struct tensor_degree_must_divide_features_at {
  static_assert(Features % Tensor == 0,
                "loom tensor-parallel error: the tensor degree does not divide the features this "
                "Linear splits over the ranks (template arguments: layer path, layer, features, "
                "degree): in a block's MLP the first Linear's (4 x width in a GPT), at the "
                "network's end the vocabulary; choose a degree that divides them");
  static constexpr bool ok = Features % Tensor == 0;
};
template <std::size_t Index, class Layer, std::size_t Features, std::size_t Tensor>
using tensor_degree_must_divide_features =
    tensor_degree_must_divide_features_at<layer_path_t<Index>, Layer, Features, Tensor>;

template <class T>
TensorGroup& tensor_group_of(const LayerContext<T>& ctx, std::size_t index, std::size_t size) {
  LOOM_CHECK(ctx.pass.tensor != nullptr && ctx.pass.tensor->size == size, layer_path_text(index),
             " (a Linear split over ", size,
             " ranks) runs without its tensor group: only TensorParallel's engine runs it");
  return *ctx.pass.tensor;
}

// A column-parallel share's runs in the whole Linear<N> over `in` inputs
// (weight [N, in], bias [N]): rank r's `own` rows of each.
template <class Visit>
void column_segments(std::size_t rank, std::size_t n, std::size_t in, std::size_t own,
                     Visit&& visit) {
  visit(rank * own * in, 0, own * in, true);
  visit(n * in + rank * own, own * in, own, true);
}

// What every share has: it reads its tensor group from the Pass (a
// contextual layer), over In's positions.
template <class Spec, class In, class OutShape, std::size_t Index>
struct TensorLinearBase : LayerBase<Spec, In, OutShape, Index> {
  static constexpr bool contextual = true;
  static constexpr std::size_t positions = linear_positions<In>;
};

}  // namespace detail

namespace detail {

// A ReLU right after it runs in its epilogue (net/fusion.hpp), as Linear's does.
template <std::size_t N, std::size_t Tensor, class In, std::size_t Index, Act A>
struct TensorColumnsLayer
    : TensorLinearBase<TensorColumns<Linear<N>, Tensor>, In, linear_output<In, N / Tensor>, Index> {
  using Spec = Linear<N>;
  using Local = LinearLayer<N / Tensor, In, Index, A>;
  static constexpr Act activation = A;
  static constexpr std::size_t tensor = Tensor;
  static constexpr bool checked =
      layer_input_rank_mismatch<Index, Spec, 1, In::rank == 2 ? 1 : In::rank>::ok &&
      tensor_degree_must_divide_features<Index, Spec, N, Tensor>::ok;
  static constexpr std::size_t positions = linear_positions<In>;
  static constexpr std::size_t in_features = In::size / positions;
  static constexpr std::size_t out_features = N / Tensor;
  static constexpr std::size_t weight_count = Local::weight_count;
  static constexpr std::size_t bias_count = Local::bias_count;
  static constexpr std::size_t param_count = Local::param_count;
  static constexpr std::size_t workspace = Local::workspace;
  static constexpr std::size_t forward_flops = Local::forward_flops;
  static constexpr std::size_t backward_flops = Local::backward_flops;
  static constexpr std::string_view kind = "linear";
  static constexpr std::size_t whole_param_count = N * in_features + N;

  template <class Visit>
  static void tensor_segments(std::size_t rank, Visit&& visit) {
    column_segments(rank, N, in_features, out_features, visit);
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    Local::tensors(visit);
  }
  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t samples,
                      const LayerContext<T>&) {
    Local::template forward<T>(params, x, y, work, samples);
  }
  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t samples, bool accumulate, const LayerContext<T>& ctx) {
    Local::template backward<T>(params, x, y, dy, dx, dparams, work, samples, accumulate);
    if (dx != nullptr)
      tensor_group_of(ctx, Index, Tensor).sum(std::span<T>(dx, samples * positions * in_features));
  }
};

}  // namespace detail

template <std::size_t N, std::size_t Tensor, class In, std::size_t Index>
struct Bind<TensorColumns<Linear<N>, Tensor>, In, Index>
    : detail::TensorColumnsLayer<N, Tensor, In, Index, Act::identity> {};

template <std::size_t N, std::size_t Tensor, class In, std::size_t Index>
struct Bind<Fused<TensorColumns<Linear<N>, Tensor>, ReLU>, In, Index>
    : detail::TensorColumnsLayer<N, Tensor, In, Index, Act::relu> {};

namespace detail {

// Its input is the rank's block of the features: In's last dimension is the
// whole layer's input over Tensor. A ReLU right after it runs after the
// sum and the bias (net/fusion.hpp), as Linear's does.
template <std::size_t N, std::size_t Tensor, class In, std::size_t Index, Act A>
struct TensorRowsLayer
    : TensorLinearBase<TensorRows<Linear<N>, Tensor>, In, linear_output<In, N>, Index> {
  using Spec = Linear<N>;
  static constexpr bool checked =
      layer_input_rank_mismatch<Index, Spec, 1, In::rank == 2 ? 1 : In::rank>::ok;
  static constexpr std::size_t positions = linear_positions<In>;
  static constexpr std::size_t in_features = In::size / positions;  // this rank's
  static constexpr Act activation = A;
  static constexpr std::size_t tensor = Tensor;
  static constexpr std::size_t weight_count = N * in_features;
  static constexpr std::size_t bias_count = N;
  static constexpr std::size_t param_count = weight_count + bias_count;
  // The gradient after the activation's derivative (dZ), with one.
  static constexpr std::size_t workspace = A == Act::identity ? 0 : N * positions;
  static constexpr std::size_t forward_flops = positions * (2 * in_features * N + N);
  static constexpr std::size_t backward_flops = positions * (4 * in_features * N + N);
  static constexpr std::string_view kind = "linear";
  static constexpr std::size_t whole_in = in_features * Tensor;
  static constexpr std::size_t whole_param_count = N * whole_in + N;

  template <class Visit>
  static void tensor_segments(std::size_t rank, Visit&& visit) {
    for (std::size_t row = 0; row < N; ++row)
      visit(row * whole_in + rank * in_features, row * in_features, in_features, true);
    visit(N * whole_in, weight_count, N, false);
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {N, in_features}, false);
    visit("bias", weight_count, {N}, false);
  }
  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples,
                      const LayerContext<T>& ctx) {
    const std::size_t n = samples * positions;
    cpu::gemm<T>(false, true, n, N, in_features, T(1), x, in_features, params, in_features, T(0),
                 y, N);
    tensor_group_of(ctx, Index, Tensor).sum(std::span<T>(y, n * N));
    cpu::bias_act_rows<A>(y, params + weight_count, n, N);
  }
  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t samples, bool accumulate, const LayerContext<T>&) {
    const std::size_t n = samples * positions;
    const T* dz = cpu::linear_dz<A>(dy, y, work, dparams + weight_count, n, N, accumulate);
    cpu::gemm<T>(true, false, N, in_features, n, T(1), dz, N, x, in_features,
                 accumulate ? T(1) : T(0), dparams, in_features);
    if (dx == nullptr) return;
    cpu::gemm<T>(false, false, n, in_features, N, T(1), dz, N, params, in_features, T(0), dx,
                 in_features);
  }
};

}  // namespace detail

template <std::size_t N, std::size_t Tensor, class In, std::size_t Index>
struct Bind<TensorRows<Linear<N>, Tensor>, In, Index>
    : detail::TensorRowsLayer<N, Tensor, In, Index, Act::identity> {};

template <std::size_t N, std::size_t Tensor, class In, std::size_t Index>
struct Bind<Fused<TensorRows<Linear<N>, Tensor>, ReLU>, In, Index>
    : detail::TensorRowsLayer<N, Tensor, In, Index, Act::relu> {};

template <std::size_t N, std::size_t Tensor, class In, std::size_t Index>
struct Bind<TensorGather<Linear<N>, Tensor>, In, Index>
    : detail::TensorLinearBase<TensorGather<Linear<N>, Tensor>, In, detail::linear_output<In, N>,
                               Index> {
  using Spec = Linear<N>;
  static constexpr bool checked =
      detail::layer_input_rank_mismatch<Index, Spec, 1, In::rank == 2 ? 1 : In::rank>::ok &&
      detail::tensor_degree_must_divide_features<Index, Spec, N, Tensor>::ok;
  static constexpr std::size_t positions = detail::linear_positions<In>;
  static constexpr std::size_t in_features = In::size / positions;
  static constexpr std::size_t own = N / Tensor;  // this rank's outputs
  static constexpr Act activation = Act::identity;
  static constexpr std::size_t tensor = Tensor;
  static constexpr std::size_t weight_count = own * in_features;
  static constexpr std::size_t bias_count = own;
  static constexpr std::size_t param_count = weight_count + bias_count;
  // Per position: this rank's outputs (or their gradient), and every rank's gathered.
  static constexpr std::size_t workspace = positions * (own + N);
  static constexpr std::size_t forward_flops = positions * (2 * in_features * own + own);
  static constexpr std::size_t backward_flops = positions * (4 * in_features * own + own);
  static constexpr std::string_view kind = "linear";
  static constexpr std::size_t whole_param_count = N * in_features + N;

  template <class Visit>
  static void tensor_segments(std::size_t rank, Visit&& visit) {
    detail::column_segments(rank, N, in_features, own, visit);
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {own, in_features}, false);
    visit("bias", weight_count, {own}, false);
  }
  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t samples,
                      const LayerContext<T>& ctx) {
    const std::size_t n = samples * positions;
    T* mine = work;
    T* all = work + n * own;  // rank r's n x own block at r n own
    detail::LinearLayer<own, In, Index, Act::identity>::template forward<T>(params, x, mine, nullptr,
                                                                           samples);
    detail::tensor_group_of(ctx, Index, Tensor)
        .gather(std::span<const T>(mine, n * own), std::span<T>(all, n * N));
    for (std::size_t r = 0; r < Tensor; ++r)
      for (std::size_t row = 0; row < n; ++row)
        std::copy_n(all + (r * n + row) * own, own, y + row * N + r * own);
  }
  template <class T>
  static void backward(const T* params, const T* x, const T*, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t samples, bool accumulate, const LayerContext<T>& ctx) {
    const std::size_t n = samples * positions;
    auto& group = detail::tensor_group_of(ctx, Index, Tensor);
    // Every rank holds the whole output's gradient: this rank's columns of it.
    T* d_mine = work;
    for (std::size_t row = 0; row < n; ++row)
      std::copy_n(dy + row * N + group.rank * own, own, d_mine + row * own);
    cpu::column_sums(d_mine, dparams + weight_count, n, own, accumulate);
    cpu::gemm<T>(true, false, own, in_features, n, T(1), d_mine, own, x, in_features,
                 accumulate ? T(1) : T(0), dparams, in_features);
    if (dx == nullptr) return;
    cpu::gemm<T>(false, false, n, in_features, own, T(1), d_mine, own, params, in_features, T(0),
                 dx, in_features);
    group.sum(std::span<T>(dx, n * in_features));
  }
};

}  // namespace loom
