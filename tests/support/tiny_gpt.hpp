// A small GPT on Debian's fortunes for the tensor-parallel tests (worker
// threads and MPI processes): 4 heads, so tensor degrees 2 and 4 divide
// its heads, MLP and vocabulary; 120 training windows in batches of 24.
#pragma once

#include <cstdlib>
#include <loom/loom.hpp>
#include <string>
#include <vector>

namespace loom::test {

inline constexpr std::size_t gpt_context = 16, gpt_width = 32, gpt_vocab = 256;
using GptAttention = Residual<LayerNorm, CausalSelfAttention<4>>;
using GptMlp = Residual<LayerNorm, Linear<4 * gpt_width>, GELU, Linear<gpt_width>>;
using TinyGpt = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>, PositionEmbedding,
                           GptAttention, GptMlp, GptAttention, GptMlp, LayerNorm,
                           Linear<gpt_vocab>>;
// The same network with each pair of Residuals written as one TransformerBlock.
using TinyGptBlocks = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>,
                                 PositionEmbedding, TransformerBlock<4>, TransformerBlock<4>,
                                 LayerNorm, Linear<gpt_vocab>>;
// ... with its output head's weight tied to its embedding's (layer 6 to layer 1).
using TinyGptTied = Sequential<Input<gpt_context>, Embedding<gpt_vocab, gpt_width>,
                               PositionEmbedding, TransformerBlock<4>, TransformerBlock<4>,
                               LayerNorm, TiedLinear<gpt_vocab>>;

// Under SGD, as tests/parallel/test_transformer_policies.cpp says why (the
// keys' bias gradient is rounding noise, which Adam would magnify).
inline const SGD::Options gpt_sgd{.lr = 0.1f, .momentum = 0.9f};
// Two epochs (the second's order shuffled): 10 steps.
inline const FitOptions gpt_fit{.epochs = 2, .batch_size = 24, .seed = 5};

// Debian's fortune files, or where LOOM_FORTUNES_DIR says (scripts/gpu-check
// carries the package to GPU machines that lack it).
inline std::string fortunes_folder() {
  const char* dir = std::getenv("LOOM_FORTUNES_DIR");
  return dir != nullptr && *dir != '\0' ? dir : data::fortunes_dir;
}

inline const data::Split& gpt_text() {
  static const data::Split split = [] {
    data::Split s = data::text_split(data::read_fortunes(fortunes_folder()), gpt_context, 17);
    return data::Split{data::head(s.train, 120), data::head(s.test, 96)};
  }();
  return split;
}

}  // namespace loom::test
