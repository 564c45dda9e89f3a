// Flatten: C x H x W becomes one vector of C*H*W. NCHW rows are already
// contiguous per sample, so the layer aliases its input: no copy, no buffer.
#pragma once

#include <cstddef>
#include <string_view>

#include "layer.hpp"

namespace loom {

struct Flatten {};

namespace detail {

// A layer that only renames the shape: its output aliases its input (every
// backend runs kind "flatten" as nothing at all).
template <class Spec, class In, class Out, std::size_t Index>
struct AliasLayer : LayerBase<Spec, In, Out, Index> {
  static constexpr bool in_place = true;
  static constexpr std::string_view kind = "flatten";

  template <class T>
  static void forward(const T*, const T*, T*, T*, std::size_t) {}
  template <class T>
  static void backward(const T*, const T*, const T*, const T*, T*, T*, T*, std::size_t, bool) {}
};

}  // namespace detail

template <class In, std::size_t Index>
struct Bind<Flatten, In, Index> : detail::AliasLayer<Flatten, In, Shape<In::size>, Index> {};

}  // namespace loom
