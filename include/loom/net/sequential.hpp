// Sequential<Input<...>, Layers...>: the network as a type. Shapes are
// inferred left to right at compile time (a mismatch is a compile error that
// names the layer), then the fusion pass rewrites the layer list that runs.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>

#include "../core/meta.hpp"
#include "../core/shape.hpp"
#include "../layers/layers.hpp"
#include "fusion.hpp"

namespace loom {

namespace detail {

// The shape itself, with no trace of the expressions that named it.
template <class S>
struct plain_shape;
template <std::size_t... Dims>
struct plain_shape<Shape<Dims...>> {
  using type = Shape<Dims...>;
};

template <class In, std::size_t I, class Done, class... Rest>
struct bind_all {
  using type = Done;
};

// nvcc's host front end (cudafe++) keeps how each type was written, walks it
// again for every use and prints it so: had the list held `bound` (a member
// of this instantiation, which names every earlier layer) and the next input
// been `bound::output_shape` (which names this layer's input twice, as
// LayerBase's In and Out), the walk would double with each layer: 20 s for
// 20 layers, minutes for 24. plain_shape's partial specialisation re-states
// the dimensions (a decltype would be printed as its expression, in full);
// g++ never cared.
template <class In, std::size_t I, class... Done, class L, class... Rest>
struct bind_all<In, I, TypeList<Done...>, L, Rest...> {
  // Reading `checked` instantiates the layer's shape checks here, in order,
  // so the first bad layer is the one reported.
  static_assert(Bind<L, In, I>::checked || true);
  using type = typename bind_all<typename plain_shape<typename Bind<L, In, I>::output_shape>::type,
                                 I + 1, TypeList<Done..., Bind<L, In, I>>, Rest...>::type;
};

// Where each of a run of blocks starts when laid end to end (and the total).
template <std::size_t... Sizes>
constexpr std::array<std::size_t, sizeof...(Sizes) + 1> offsets_of() {
  std::array<std::size_t, sizeof...(Sizes) + 1> offsets{};
  const std::array<std::size_t, sizeof...(Sizes)> sizes{Sizes...};
  for (std::size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

// A bound layer that holds layers: Residual, Series, a named Block
// (net/block.hpp says the protocol).
template <class L>
concept BoundBlock = requires { typename L::children; };

template <class List>
struct list_info;

template <class... Ls>
struct list_info<TypeList<Ls...>> {
  static constexpr std::size_t count = sizeof...(Ls);
  static constexpr std::size_t parameter_count = (std::size_t{0} + ... + Ls::param_count);
  static constexpr auto param_offsets = offsets_of<Ls::param_count...>();
  static constexpr std::size_t state_count = (std::size_t{0} + ... + Ls::state_count);
  static constexpr bool has_block = (false || ... || BoundBlock<Ls>);
  static constexpr bool syncs = (false || ... || Ls::syncs);
  static constexpr auto state_offsets = offsets_of<Ls::state_count...>();
  // Per sample, in elements: every output that is not an alias of its input,
  // and what layers save for their backward.
  static constexpr std::size_t activations =
      (std::size_t{0} + ... + ((Ls::in_place ? 0 : Ls::output_shape::size) + Ls::saved));
  // Whose buffer holds layer i's output: the last layer at or before i that
  // is not in place (in-place layers alias their input), or -1: the input.
  static constexpr std::array<int, count> output_owner = [] {
    std::array<int, count> owner{};
    const std::array<bool, count> in_place{Ls::in_place...};
    int last = -1;
    for (std::size_t i = 0; i < count; ++i) {
      if (!in_place[i]) last = static_cast<int>(i);
      owner[i] = last;
    }
    return owner;
  }();
  static constexpr std::size_t largest_activation =
      std::max({std::size_t{0}, Ls::input_shape::size..., Ls::output_shape::size...});
  static constexpr std::size_t workspace =
      std::max({std::size_t{0}, (Ls::chunk == 0 ? Ls::workspace : 0)...});
  static constexpr std::size_t chunked_workspace =
      std::max({std::size_t{0}, (Ls::chunk == 0 ? 0 : Ls::workspace)...});
  static constexpr std::size_t chunk = std::max({std::size_t{1}, Ls::chunk...});
  // The largest workspace of one full chunk (layers choose their chunk).
  static constexpr std::size_t chunk_workspace =
      std::max({std::size_t{0}, (Ls::chunk == 0 ? 0 : Ls::workspace * Ls::chunk)...});
};

}  // namespace detail

// A run of a network's executed layers (after fusion), [first, last): a
// pipeline stage's share when the stage's cuts fall between executed
// layers. A Model of a range holds its layers' parameters, gradients,
// running statistics and activations only, and runs the same code as the
// whole network's Model: one type for every stage.
struct LayerRange {
  std::size_t first = 0;
  std::size_t last = 0;
};

namespace detail {

// In one batch's buffers for a range of List's layers (`outputs`: those of
// the layers that write one; `input`: the range's), the buffer that holds
// layer I's output. In-place layers write nothing: theirs is an earlier
// buffer, the input when no layer of the range wrote one. Both backends'.
template <class List, std::size_t I, class T, std::size_t N>
T* range_output(const std::array<T*, N>& outputs, T* input, const LayerRange& range) {
  constexpr int owner = list_info<List>::output_owner[I];
  if constexpr (owner >= 0)
    if (static_cast<std::size_t>(owner) >= range.first) return outputs[owner];
  return input;
}
// Layer I's input: the layer before's output, or the range's input.
template <class List, std::size_t I, class T, std::size_t N>
T* range_input(const std::array<T*, N>& outputs, T* input, const LayerRange& range) {
  if constexpr (I > 0)
    if (I > range.first) return range_output<List, I - 1>(outputs, input, range);
  return input;
}

}  // namespace detail

// The activation memory plan of a layer list, in elements. Training holds
// every layer output (backward needs them), two ping-pong buffers for
// activation gradients, and one workspace shared by all layers; layers that
// work in chunks (convolutions) need workspace for one chunk only.
struct MemoryPlan {
  std::size_t parameters = 0;            // independent of the batch
  std::size_t activations = 0;           // per sample
  std::size_t activation_gradients = 0;  // per sample
  std::size_t workspace = 0;             // per sample, for layers that take the whole batch
  std::size_t chunked_workspace = 0;     // per sample, up to a layer's chunk
  std::size_t chunk = 1;                 // the largest chunk
  std::size_t chunk_workspace = 0;       // the largest full chunk's

  // Each chunked layer needs workspace x min(batch, its chunk); this bounds
  // them all.
  constexpr std::size_t workspace_elements(std::size_t batch) const {
    return std::max(workspace * batch, std::min(chunked_workspace * batch, chunk_workspace));
  }
  // Activations, their gradients and workspace for `batch` samples.
  constexpr std::size_t activation_elements(std::size_t batch) const {
    return batch * (activations + activation_gradients) + workspace_elements(batch);
  }
  // Bytes to train with `batch` samples: parameters, gradients, optimizer
  // state (one velocity per parameter for SGD with momentum) and activations.
  constexpr std::size_t training_bytes(std::size_t batch, std::size_t element_size) const {
    return (3 * parameters + activation_elements(batch)) * element_size;
  }
};

namespace detail {

template <class List>
constexpr MemoryPlan plan_of(std::size_t parameters) {
  using info = list_info<List>;
  return MemoryPlan{parameters,      info::activations,       2 * info::largest_activation,
                    info::workspace, info::chunked_workspace, info::chunk,
                    info::chunk_workspace};
}

}  // namespace detail

namespace detail {

// A weight held twice (weight tying: TiedLinear's copy of an Embedding's),
// as offsets into the flat parameter buffer.
struct TieRun {
  std::size_t source = 0;  // the tied-to layer's weight
  std::size_t copy = 0;    // the tying layer's
  std::size_t count = 0;
};

template <class L>
concept TiesWeight = requires { L::tied_to; };

// The ties among `List`'s layers (a network's top level, numbered from
// First), each checked: the tied-to layer exists and has the shape. A
// pipeline stage's network leaves out a tie whose layer it does not hold
// (the whole network's engine sums the two).
template <std::size_t First, class List>
constexpr std::size_t tie_count() {
  std::size_t n = 0;
  static_for<List::size>([&](auto i) {
    using L = type_at_t<i, List>;
    if constexpr (TiesWeight<L>)
      if (L::tied_to >= First && L::tied_to - First < List::size) ++n;
  });
  return n;
}
template <std::size_t First, class List>
constexpr auto tie_table() {
  std::array<TieRun, tie_count<First, List>()> runs{};
  std::size_t k = 0;
  static_for<List::size>([&](auto i) {
    using L = type_at_t<i, List>;
    if constexpr (TiesWeight<L>) {
      if constexpr (L::tied_to >= First && L::tied_to - First < List::size) {
        using Tied = type_at_t<L::tied_to - First, List>;
        static_assert(tied_layer_must_be_an_embedding_of_its_shape<
                      L::index, typename L::spec, L::tied_to, typename Tied::spec,
                      L::out_features, L::in_features>::ok);
        runs[k++] = {list_info<List>::param_offsets[L::tied_to - First],
                     list_info<List>::param_offsets[i], L::param_count};
      }
    }
  });
  return runs;
}

// Whether every TiedLinear of a whole network's top level names a layer it
// has (a pipeline stage's network holds only some).
template <class List>
constexpr bool ties_resolve() {
  bool ok = true;
  static_for<List::size>([&](auto i) {
    using L = type_at_t<i, List>;
    if constexpr (TiesWeight<L>)
      ok = ok && tied_layer_not_in_the_network<L::index, typename L::spec, L::tied_to,
                                               List::size>::ok;
  });
  return ok;
}

// The layers bound from `In`, numbered from FirstIndex: Sequential numbers
// from 1; a pipeline stage keeps the numbers its layers have in the whole
// network, so seeds that name a layer (Dropout's masks) are the same.
template <std::size_t FirstIndex, class In, class... Layers_>
struct Network {
  static_assert(sizeof...(Layers_) > 0, "Sequential needs at least one layer after Input");

  using input_shape = In;
  // The layers as written, each bound to its input shape and index.
  using layers = typename detail::bind_all<input_shape, FirstIndex, TypeList<>, Layers_...>::type;
  // A block's layers are numbered 64 x (its index) + 1, 2, ...: the
  // numbers seed weights and Dropout, so they must not meet the network's
  // own, and error messages read them back as paths (LayerPath<3, 2>).
  static_assert(FirstIndex + sizeof...(Layers_) <= 64,
                "a network has at most 63 layers at its top level (a block's layers are "
                "numbered 64 x its index + 1, 2, ..., and error messages name a layer by its "
                "path); group layers into blocks: Series<...>, Residual<...> or a named block");
  // The layers that run: the fusion pass's rewrite of `layers`.
  using executed = fuse_t<layers>;
  using output_shape = typename type_at_t<sizeof...(Layers_) - 1, layers>::output_shape;

  static constexpr std::size_t layer_count = sizeof...(Layers_);
  static constexpr std::size_t parameter_count = detail::list_info<layers>::parameter_count;
  // Running statistics (BatchNorm): kept beside the weights, never trained.
  static constexpr std::size_t state_count = detail::list_info<layers>::state_count;
  // Has a SyncBatchNorm: DataParallel sums its statistics over the replicas.
  static constexpr bool syncs = detail::list_info<layers>::syncs;

  // Per-sample FLOPs of layer i (1-based, as in error messages) at index i - 1.
  static constexpr auto forward_flops = []<class... Ls>(TypeList<Ls...>) {
    return std::array<std::size_t, sizeof...(Ls)>{Ls::forward_flops...};
  }(layers{});
  static constexpr auto backward_flops = []<class... Ls>(TypeList<Ls...>) {
    return std::array<std::size_t, sizeof...(Ls)>{Ls::backward_flops...};
  }(layers{});

  static constexpr MemoryPlan memory_plan = detail::plan_of<executed>(parameter_count);

  // Weights held twice (TiedLinear): each pair trains as one tensor.
  static constexpr auto ties = detail::tie_table<FirstIndex, layers>();
  // The parameters counting a tied weight once (nanoGPT's count).
  static constexpr std::size_t unique_parameter_count = [] {
    std::size_t n = parameter_count;
    for (const detail::TieRun& t : ties) n -= t.count;
    return n;
  }();
};

}  // namespace detail

template <class Input_, class... Layers_>
struct Sequential {
  static_assert(dependent_false<Input_>,
                "Sequential's first argument must be Input<C, H, W> (or Input<F>), "
                "e.g. Sequential<Input<1, 28, 28>, Flatten, Linear<10>>");
};

template <std::size_t... Dims, class... Layers_>
struct Sequential<Input<Dims...>, Layers_...> : detail::Network<1, Shape<Dims...>, Layers_...> {
  static_assert(detail::ties_resolve<typename Sequential::layers>());
};

// The same network with the fusion pass switched off: every layer runs on its
// own. It computes the same function; tests compare the two.
template <class Net_>
struct Unfused : Net_ {
  using executed = typename Net_::layers;
  static constexpr MemoryPlan memory_plan = detail::plan_of<executed>(Net_::parameter_count);
};

}  // namespace loom
