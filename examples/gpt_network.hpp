// The GPT example's network, named once for the example and its benchmark
// against PyTorch (benchmarks/gpt_bench.cpp).
#pragma once

#include <cstddef>
#include <loom/loom.hpp>

namespace loom::examples {

// nanoGPT's "baby GPT" over bytes: 4 pre-norm blocks of 4-head causal
// self-attention and a GELU MLP, width 128, context 64; each block written
// as two residuals.
inline constexpr std::size_t gpt_vocab = 256, gpt_width = 128, gpt_context = 64, gpt_heads = 4;
using GptAttention = Residual<LayerNorm, CausalSelfAttention<gpt_heads>>;
using GptMlp = Residual<LayerNorm, Linear<4 * gpt_width>, GELU, Linear<gpt_width>>;
using BabyGpt = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>, PositionEmbedding,
                           GptAttention, GptMlp, GptAttention, GptMlp, GptAttention, GptMlp,
                           GptAttention, GptMlp, LayerNorm, Linear<gpt_vocab>>;

}  // namespace loom::examples
