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
// TiedLinear<Out, Layer = 1>: the output head whose weight is layer
// Layer's, an Embedding<Out, Width> (weight tying, GPT-2's and nanoGPT's
// lm_head): y = x E^T per position, no bias. The network checks at compile
// time that layer Layer is an Embedding of that shape. The head keeps a copy
// of the weight (so a pipeline may hold the embedding and the head on
// different stages, as Megatron does); the copy starts as the embedding's
// values, and the grid engine sums the two gradients into both before every
// update, so the copies stay equal bit for bit and train as one tensor
// (clipping counts it once).
//
// All start from a uniform distribution of standard deviation 0.02,
// GPT-2's (which draws from a normal one of that deviation).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "../backend/cpu/cpu.hpp"
#include "../core/error.hpp"
#include "layer.hpp"
#include "linear.hpp"

namespace loom {

template <std::size_t Vocab, std::size_t Width>
struct Embedding {
  static constexpr std::size_t vocab = Vocab;
  static constexpr std::size_t width = Width;
};

struct PositionEmbedding {};

template <std::size_t Out, std::size_t Layer = 1>
struct TiedLinear {
  static constexpr std::size_t out_features = Out;
};

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

  // Every id of `samples` samples, checked as forward checks them (the GPU
  // checks a batch here before it goes over).
  template <class T>
  static void check_ids(const T* x, std::size_t samples) {
    for (std::size_t i = 0; i < samples * context; ++i) id_at(x, i);
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
    LOOM_CHECK(v >= T(0) && v < T(Vocab) && std::floor(v) == v, "Embedding (",
               detail::layer_path_text(Index), "): sample ", i / context, " holds ", v, " at position ", i % context,
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

namespace detail {

template <class At, class Layer, std::size_t Tied, class TiedLayer, std::size_t Out,
          std::size_t Width>
struct tied_layer_must_be_an_embedding_of_its_shape_at {
  static_assert(std::is_same_v<TiedLayer, Embedding<Out, Width>>,
                "loom shape error: a TiedLinear<Out, Layer> ties its weight to layer Layer, "
                "which must be an Embedding<Out, Width> of its Out and its input's Width "
                "(template arguments: layer path, layer, tied layer index, tied layer, Out, "
                "Width)");
  static constexpr bool ok = std::is_same_v<TiedLayer, Embedding<Out, Width>>;
};
template <std::size_t Index, class Layer, std::size_t Tied, class TiedLayer, std::size_t Out,
          std::size_t Width>
using tied_layer_must_be_an_embedding_of_its_shape =
    tied_layer_must_be_an_embedding_of_its_shape_at<layer_path_t<Index>, Layer, Tied, TiedLayer,
                                                    Out, Width>;

template <class At, class Layer, std::size_t Tied, std::size_t Count>
struct tied_layer_not_in_the_network_at {
  static_assert(Tied >= 1 && Tied <= Count,
                "loom shape error: a TiedLinear<Out, Layer> names a layer the network's top "
                "level does not have (template arguments: layer path, layer, tied layer "
                "index, top-level layer count)");
  static constexpr bool ok = Tied >= 1 && Tied <= Count;
};
template <std::size_t Index, class Layer, std::size_t Tied, std::size_t Count>
using tied_layer_not_in_the_network =
    tied_layer_not_in_the_network_at<layer_path_t<Index>, Layer, Tied, Count>;

}  // namespace detail

template <std::size_t Out, std::size_t Layer, class In, std::size_t Index>
struct Bind<TiedLinear<Out, Layer>, In, Index>
    : LayerBase<TiedLinear<Out, Layer>, In, detail::linear_output<In, Out>, Index> {
  using Spec = TiedLinear<Out, Layer>;
  static constexpr bool checked =
      detail::layer_argument_must_be_positive<Index, Spec, Out>::ok &&
      detail::layer_input_rank_mismatch<Index, Spec, 1, In::rank == 2 ? 1 : In::rank>::ok;
  static constexpr std::size_t positions = detail::linear_positions<In>;
  static constexpr std::size_t in_features = In::size / positions;
  static constexpr std::size_t out_features = Out;
  static constexpr std::size_t weight_count = Out * in_features;
  static constexpr std::size_t param_count = weight_count;
  static constexpr std::size_t forward_flops = positions * 2 * in_features * Out;
  static constexpr std::size_t backward_flops = positions * 4 * in_features * Out;
  static constexpr std::string_view kind = "tied_linear";
  // The layer whose weight this one's is (Sequential's tie table).
  static constexpr std::size_t tied_to = Layer;

  // The embedding's own values: the same function of (seed, its index).
  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    Bind<Embedding<Out, in_features>, Shape<1>, Layer>::init(params, seed, false);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {Out, in_features}, false);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples) {
    cpu::gemm<T>(false, true, samples * positions, Out, in_features, T(1), x, in_features, params,
                 in_features, T(0), y, Out);
  }

  template <class T>
  static void backward(const T* params, const T* x, const T*, const T* dy, T* dx, T* dparams, T*,
                       std::size_t samples, bool accumulate) {
    const std::size_t n = samples * positions;
    cpu::gemm<T>(true, false, Out, in_features, n, T(1), dy, Out, x, in_features,
                 accumulate ? T(1) : T(0), dparams, in_features);
    if (dx != nullptr)
      cpu::gemm<T>(false, false, n, in_features, Out, T(1), dy, Out, params, in_features, T(0), dx,
                   in_features);
  }
};

}  // namespace loom
