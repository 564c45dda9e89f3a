// The fusion pass: a compile-time rewrite of a bound layer list. Each rule
// says which adjacent pair becomes one layer; the fused layer keeps the first
// layer's index and parameters, so fused and unfused networks share weights.
#pragma once

#include <cstddef>
#include <type_traits>

#include "../core/meta.hpp"
#include "../layers/layers.hpp"

namespace loom {

// Primary rule: A and B stay apart.
template <class A, class B>
struct FusionRule {
  static constexpr bool fuses = false;
  using type = A;
};

// Linear, ReLU -> one GEMM with a bias+ReLU epilogue.
template <std::size_t Out, class In, std::size_t I, class In2, std::size_t J>
struct FusionRule<Bind<Linear<Out>, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<Linear<Out>, ReLU>, In, I>;
};

// Tensor parallelism's shares of a Linear, ReLU -> the same,
// so a sharded network runs as many layers as the whole one.
template <std::size_t Out, std::size_t T, class In, std::size_t I, class In2, std::size_t J>
struct FusionRule<Bind<TensorColumns<Linear<Out>, T>, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<TensorColumns<Linear<Out>, T>, ReLU>, In, I>;
};
template <std::size_t Out, std::size_t T, class In, std::size_t I, class In2, std::size_t J>
struct FusionRule<Bind<TensorRows<Linear<Out>, T>, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<TensorRows<Linear<Out>, T>, ReLU>, In, I>;
};

// Conv2d, ReLU -> convolution with a bias+ReLU epilogue.
template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, class In, std::size_t I,
          class In2, std::size_t J>
struct FusionRule<Bind<Conv2d<Out, K, S, P>, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<Conv2d<Out, K, S, P>, ReLU>, In, I>;
};

// Conv1d, ReLU -> the same, with the bias+ReLU epilogue.
template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t D, class In,
          std::size_t I, class In2, std::size_t J>
struct FusionRule<Bind<Conv1d<Out, K, S, P, D>, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<Conv1d<Out, K, S, P, D>, ReLU>, In, I>;
};

// BatchNorm, ReLU -> the ReLU applied in the normalisation's pass, and
// its mask applied in the backward's.
template <BatchNormSpec BN, class In, std::size_t I, class In2, std::size_t J>
struct FusionRule<Bind<BN, In, I>, Bind<ReLU, In2, J>> {
  static constexpr bool fuses = true;
  using type = Bind<Fused<BN, ReLU>, In, I>;
};

namespace detail {

template <class Done, class... Rest>
struct fuse_list {
  using type = Done;
};

template <class... Done, class A>
struct fuse_list<TypeList<Done...>, A> {
  using type = TypeList<Done..., A>;
};

template <class... Done, class A, class B, class... Rest>
struct fuse_list<TypeList<Done...>, A, B, Rest...> {
  using rule = FusionRule<A, B>;
  using type =
      typename std::conditional_t<rule::fuses,
                                  fuse_list<TypeList<Done..., typename rule::type>, Rest...>,
                                  fuse_list<TypeList<Done..., A>, B, Rest...>>::type;
};

template <class List>
struct fuse;
template <class... Ls>
struct fuse<TypeList<Ls...>> {
  using type = typename fuse_list<TypeList<>, Ls...>::type;
};

}  // namespace detail

template <class List>
using fuse_t = typename detail::fuse<List>::type;

}  // namespace loom
