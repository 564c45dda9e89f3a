// Linear<Out>: y = x W^T + b over a flat input of inferred size In, or per
// position over Positions x In (a sequence's frames: rows = samples x
// positions, as PyTorch's Linear over the last dimension).
// Parameters: weight [Out, In], bias [Out] (PyTorch's layout). Forward is one
// GEMM and one bias(+ReLU) pass; backward one fused activation-derivative +
// bias-gradient pass, then the weight and input GEMMs.
#pragma once

#include <cstddef>
#include <type_traits>
#include <string_view>

#include "../backend/cpu/cpu.hpp"
#include "../core/activation.hpp"
#include "layer.hpp"
#include "relu.hpp"

namespace loom {

template <std::size_t Out_>
struct Linear {
  static constexpr std::size_t out_features = Out_;
};

namespace detail {

// Rank 2 (Positions x Features) is per position; rank 3 must be flattened first.
template <class In>
inline constexpr std::size_t linear_positions = In::rank == 2 ? In::dims[0] : 1;

template <class In, std::size_t Out>
using linear_output = std::conditional_t<In::rank == 2, Shape<linear_positions<In>, Out>, Shape<Out>>;

template <std::size_t Out, class In, std::size_t Index, Act A>
struct LinearLayer : LayerBase<Linear<Out>, In, linear_output<In, Out>, Index> {
  using Spec = Linear<Out>;
  static constexpr bool checked =
      layer_argument_must_be_positive<Index, Spec, Out>::ok &&
      layer_input_rank_mismatch<Index, Spec, 1, In::rank == 2 ? 1 : In::rank>::ok;

  static constexpr std::size_t positions = linear_positions<In>;
  static constexpr std::size_t in_features = In::size / positions;
  static constexpr std::size_t out_features = Out;
  static constexpr std::size_t weight_count = Out * in_features;
  static constexpr std::size_t bias_count = Out;
  static constexpr std::size_t param_count = weight_count + bias_count;
  // The gradient after the activation derivative (dZ; unused without one).
  static constexpr std::size_t workspace = Out * positions;
  static constexpr std::size_t forward_flops = positions * (2 * in_features * Out + Out);
  static constexpr std::size_t backward_flops = positions * (4 * in_features * Out + Out);
  static constexpr std::string_view kind = "linear";
  static constexpr Act activation = A;

  template <class T>
  static void init(T* params, std::uint64_t seed, bool relu_follows) {
    init_uniform(params, weight_count, init_limit(in_features, Out, relu_follows), seed, Index);
    for (std::size_t i = 0; i < bias_count; ++i) params[weight_count + i] = T(0);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {Out, in_features}, false);
    visit("bias", weight_count, {Out}, false);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples) {
    const std::size_t n = samples * positions;
    cpu::gemm<T>(false, true, n, Out, in_features, T(1), x, in_features, params, in_features, T(0),
                 y, Out);
    cpu::bias_act_rows<A>(y, params + weight_count, n, Out);
  }

  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t samples, bool accumulate) {
    const std::size_t n = samples * positions;
    const T* dz = cpu::linear_dz<A>(dy, y, work, dparams + weight_count, n, Out, accumulate);
    cpu::gemm<T>(true, false, Out, in_features, n, T(1), dz, Out, x, in_features,
                 accumulate ? T(1) : T(0), dparams, in_features);
    if (dx == nullptr) return;
    cpu::gemm<T>(false, false, n, in_features, Out, T(1), dz, Out, params, in_features, T(0), dx,
                 in_features);
  }
};

}  // namespace detail

template <std::size_t Out, class In, std::size_t Index>
struct Bind<Linear<Out>, In, Index> : detail::LinearLayer<Out, In, Index, Act::identity> {};

template <std::size_t Out, class In, std::size_t Index>
struct Bind<Fused<Linear<Out>, ReLU>, In, Index> : detail::LinearLayer<Out, In, Index, Act::relu> {
};

}  // namespace loom
