// The GPT example's network, named once for the example and its benchmark
// against PyTorch (benchmarks/gpt_bench.cpp).
#pragma once

#include <cstddef>
#include <loom/loom.hpp>

namespace loom::examples {

// nanoGPT's "baby GPT" over bytes: 4 pre-norm transformer blocks (4-head
// causal self-attention and a GELU MLP, each in a residual), width 128,
// context 64.
inline constexpr std::size_t gpt_vocab = 256, gpt_width = 128, gpt_context = 64, gpt_heads = 4;
using GptBlock = TransformerBlock<gpt_heads>;
using BabyGpt = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>, PositionEmbedding,
                           GptBlock, GptBlock, GptBlock, GptBlock, LayerNorm, Linear<gpt_vocab>>;
// The same with the output head's weight tied to the embedding's (GPT-2's
// and nanoGPT's default): 834,304 parameters counted once.
using BabyGptTied = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>,
                               PositionEmbedding, GptBlock, GptBlock, GptBlock, GptBlock, LayerNorm,
                               TiedLinear<gpt_vocab>>;

}  // namespace loom::examples
