// TransformerBlock<Heads>: GPT-2's pre-norm transformer block over
// Positions x Width, as one layer of the network:
//
//   x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)),
//   the MLP Linear<Expansion x Width>, GELU, Linear<Width>.
//
// It is a named block (net/block.hpp): two Residual blocks in sequence,
// its width read off its input, so `Sequential<Input<64>, Embedding<256,
// 128>, PositionEmbedding, TransformerBlock<4>, TransformerBlock<4>,
// LayerNorm, Linear<256>>` is a two-block GPT. With the same weights it
// computes what the two Residuals written out compute, bit for bit (its
// layers are numbered inside it, so its seeded initial weights are its
// own); a pipeline cuts between blocks, and tensor parallelism splits the
// attention's heads and the MLP inside each (parallel/tensor_parallel.hpp).
//
// Positions: void for learned positions (PositionEmbedding before the
// first block), or Rotary<> (rotary embeddings in the attention).
#pragma once

#include <cstddef>
#include <string_view>

#include "../layers/layers.hpp"
#include "block.hpp"
#include "residual.hpp"

namespace loom {

template <std::size_t Heads, class Positions = void, std::size_t Expansion = 4>
struct TransformerBlock : NamedBlock {
  static_assert(Heads > 0 && Expansion > 0,
                "TransformerBlock<Heads, Positions, Expansion>: Heads and Expansion are positive");
  // A rank-1 input reads width 1 here; the attention names the rank error.
  template <class In>
  using layers =
      TypeList<Residual<LayerNorm, CausalSelfAttention<Heads, Positions>>,
               Residual<LayerNorm, Linear<Expansion * detail::dim_or_one<In, 1>>, GELU,
                        Linear<detail::dim_or_one<In, 1>>>>;
  static constexpr std::string_view kind = "transformer";
  static constexpr std::string_view name = "transformer block";
};

}  // namespace loom
