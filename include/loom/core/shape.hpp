// Compile-time shapes. A Shape is a type, so the whole network's geometry is
// known to the compiler and shape errors become compile errors.
#pragma once

#include <array>
#include <cstddef>

namespace loom {

template <std::size_t... Dims_>
struct Shape {
  static constexpr std::size_t rank = sizeof...(Dims_);
  static constexpr std::size_t size = (std::size_t{1} * ... * Dims_);
  static constexpr std::array<std::size_t, rank> dims{Dims_...};
};

// The first element of a sample: Input<C, H, W> for images, Input<F> for vectors.
template <std::size_t... Dims_>
struct Input {
  using shape = Shape<Dims_...>;
};

}  // namespace loom
