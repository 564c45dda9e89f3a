// Token and position embeddings, the way a GPT starts.
//
// Embedding<Vocab, Width>: a sequence of Context token ids in, Context x Width
// out, each position its id's row of the weight [Vocab, Width] (PyTorch's
// nn.Embedding). The ids travel in the network's float input, one per
// position, whole numbers below Vocab (exact in float up to 2^24; a network
// whose first layer takes ids is never rounded to bf16 or fp16 at its
// input, net/model.hpp): anything else is a loom::Error naming the sample,
// the position and the id. The ids have no gradient; the weight's gradient
// sums the output gradient of every position that named the row.
//
// PositionEmbedding: a learned position table [Context, Width] added to
// every sample (nanoGPT's wpe), over Context x Width.
//
// Both start from a uniform distribution of standard deviation 0.02,
// GPT-2's (which draws from a normal one of that deviation).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../core/error.hpp"
#include "layer.hpp"

namespace loom {

template <std::size_t Vocab, std::size_t Width>
struct Embedding {
  static constexpr std::size_t vocab = Vocab;
  static constexpr std::size_t width = Width;
};

struct PositionEmbedding {};

namespace detail {

// A uniform bound whose distribution has standard deviation 0.02.
inline constexpr double gpt_init_limit = 0.02 * 1.7320508075688772;

template <class In, std::size_t Width>
using embedding_output = Shape<dim_or_one<In, 0>, Width>;

}  // namespace detail

template <std::size_t Vocab, std::size_t Width, class In, std::size_t Index>
struct Bind<Embedding<Vocab, Width>, In, Index>
    : LayerBase<Embedding<Vocab, Width>, In, detail::embedding_output<In, Width>, Index> {
  using Spec = Embedding<Vocab, Width>;
  static constexpr bool checked =
      detail::layer_argument_must_be_positive<Index, Spec, Vocab>::ok &&
      detail::layer_argument_must_be_positive<Index, Spec, Width>::ok &&
      detail::layer_input_rank_mismatch<Index, Spec, 1, In::rank>::ok;
  static constexpr std::size_t context = In::size;
  static constexpr std::size_t vocab = Vocab;
  static constexpr std::size_t width = Width;
  static constexpr std::size_t weight_count = Vocab * Width;
  static constexpr std::size_t param_count = weight_count;
  static constexpr std::size_t forward_flops = 0;
  static constexpr std::size_t backward_flops = context * Width;
  static constexpr std::string_view kind = "embedding";
  // Its input holds ids, which no precision may round.
  static constexpr bool takes_ids = true;

  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    detail::init_uniform(params, weight_count, detail::gpt_init_limit, seed, Index);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {Vocab, Width}, false);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples) {
    for (std::size_t i = 0; i < samples * context; ++i) {
      const T* row = params + id_at(x, i) * Width;
      T* out = y + i * Width;
      for (std::size_t c = 0; c < Width; ++c) out[c] = row[c];
    }
  }

  template <class T>
  static void backward(const T*, const T* x, const T*, const T* dy, T* dx, T* dparams, T*,
                       std::size_t samples, bool accumulate) {
    if (!accumulate)
      for (std::size_t i = 0; i < weight_count; ++i) dparams[i] = T(0);
    for (std::size_t i = 0; i < samples * context; ++i) {
      T* row = dparams + id_at(x, i) * Width;
      const T* g = dy + i * Width;
      for (std::size_t c = 0; c < Width; ++c) row[c] += g[c];
    }
    if (dx != nullptr)
      for (std::size_t i = 0; i < samples * context; ++i) dx[i] = T(0);
  }

 private:
  // Position i's id (i = sample x Context + position), checked.
  template <class T>
  static std::size_t id_at(const T* x, std::size_t i) {
    const T v = x[i];
    LOOM_CHECK(v >= T(0) && v < T(Vocab) && std::floor(v) == v, "Embedding (layer ", Index,
               "): sample ", i / context, " holds ", v, " at position ", i % context,
               ", which is not a token id of its vocabulary of ", Vocab,
               " (whole numbers 0 to ", Vocab - 1, ")");
    return static_cast<std::size_t>(v);
  }
};

template <class In, std::size_t Index>
struct Bind<PositionEmbedding, In, Index> : LayerBase<PositionEmbedding, In, In, Index> {
  static constexpr bool checked =
      detail::layer_input_rank_mismatch<Index, PositionEmbedding, 2, In::rank>::ok;
  static constexpr std::size_t weight_count = In::size;
  static constexpr std::size_t param_count = weight_count;
  static constexpr std::size_t forward_flops = In::size;
  static constexpr std::size_t backward_flops = In::size;
  static constexpr std::string_view kind = "position_embedding";

  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    detail::init_uniform(params, weight_count, detail::gpt_init_limit, seed, Index);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {detail::dim_or_one<In, 0>, detail::dim_or_one<In, 1>}, false);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples) {
    for (std::size_t s = 0; s < samples; ++s)
      for (std::size_t i = 0; i < In::size; ++i)
        y[s * In::size + i] = x[s * In::size + i] + params[i];
  }

  template <class T>
  static void backward(const T*, const T*, const T*, const T* dy, T* dx, T* dparams, T*,
                       std::size_t samples, bool accumulate) {
    for (std::size_t i = 0; i < In::size; ++i) {
      T sum = T(0);
      for (std::size_t s = 0; s < samples; ++s) sum += dy[s * In::size + i];
      dparams[i] = accumulate ? dparams[i] + sum : sum;
    }
    if (dx != nullptr)
      for (std::size_t i = 0; i < samples * In::size; ++i) dx[i] = dy[i];
  }
};

}  // namespace loom
