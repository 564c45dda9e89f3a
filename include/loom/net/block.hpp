// Blocks: layers made of layers, one protocol for all of them. Residual,
// Series (a nested sequence), a transformer block and any block a user
// names are each a layer of the network (one line of its type, one
// pipeline cut point, one index in messages) holding child layers, and
// every part of loom that looks inside one (checkpoint names, error
// messages, the non-finite diagnosis, tensor parallelism's shares) does so
// through this protocol, never by a block's name.
//
// A bound block L (Bind<Spec, In, Index> of a block spec) has:
//   - `children`: its child layers as written, bound (numbered 64 x Index
//     + 1, 2, ...), in the order of its parameters: L's parameters and
//     running statistics are its children's, laid end to end;
//   - `block_name` ("Residual block") and child_role(p) ("body layer 2"),
//     for messages; child_prefix(p) ("body.1."), for tensor names;
//   - visit_body_outputs / visit_body_gradients, for the diagnosis of a
//     non-finite step (net/model.hpp), looking into nested blocks.
//
// A named block is a spec deriving from NamedBlock that gives its layers for
// its input shape (so a transformer block reads its width off its input):
//
//   template <std::size_t Heads>
//   struct TransformerBlock : NamedBlock {
//     template <class In>
//     using layers = TypeList<Residual<LayerNorm, CausalSelfAttention<Heads>>,
//                             Residual<LayerNorm, Linear<4 * In::dims[1]>, GELU,
//                                      Linear<In::dims[1]>>>;
//     static constexpr std::string_view kind = "transformer";
//     static constexpr std::string_view name = "transformer block";
//   };
//
// Its layers run in sequence, fused as the top level's are, each keeping
// its output for the backward in the block's saved area (the last one's in
// the block's output).
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "sequential.hpp"

namespace loom {

// The base of a named block spec (see the top of this file).
struct NamedBlock {};

// Layers run in sequence as one block: a nested Sequential, which a
// pipeline never cuts and messages name as one layer.
template <class... Layers>
struct Series : NamedBlock {
  template <class In>
  using layers = TypeList<Layers...>;
  static constexpr std::string_view kind = "series";
  static constexpr std::string_view name = "Series block";
};

namespace detail {

// The list's layers bound from `In`, numbered from First.
template <class In, std::size_t First, class List>
struct bind_list;
template <class In, std::size_t First, class... Ls>
struct bind_list<In, First, TypeList<Ls...>> {
  static_assert(sizeof...(Ls) > 0 && sizeof...(Ls) < 64, "a block holds 1 to 63 layers");
  using type = typename bind_all<In, First, TypeList<>, Ls...>::type;
};
// A block's layers, bound (numbered 64 x Index + 1, 2, ...), and its output shape.
template <class In, std::size_t Index, class List>
using block_layers_t = typename bind_list<In, 64 * Index + 1, List>::type;
template <class In, std::size_t Index, class List>
using block_output_t =
    typename type_at_t<block_layers_t<In, Index, List>::size - 1,
                       block_layers_t<In, Index, List>>::output_shape;

inline std::string ordinal(std::size_t n) {
  const std::size_t tens = n % 100;
  const char* suffix = tens >= 11 && tens <= 13 ? "th"
                       : n % 10 == 1            ? "st"
                       : n % 10 == 2            ? "nd"
                       : n % 10 == 3            ? "rd"
                                                : "th";
  return std::to_string(n) + suffix;
}

// A run of bound layers (as written: `Written`) inside a block, fused as
// the top level's: where each keeps its output and saved tensors in the
// block's saved area, and their forward and backward. IntoOutput: the last
// layer that writes an output writes the block's (a Series); otherwise
// every output stays in the saved area and the block makes its own (a
// Residual's sum).
template <class Written, bool IntoOutput>
struct Chain {
  using body = fuse_t<Written>;
  using info = list_info<body>;
  static constexpr std::size_t count = body::size;
  // The layer whose buffer holds the chain's output (-1: its input).
  static constexpr int final_owner = info::output_owner[count - 1];
  static_assert(!IntoOutput || final_owner >= 0,
                "a block whose layers all only rename the shape (Flatten) computes nothing; "
                "write them at the top level");

  static constexpr bool writes_output(std::size_t i) {
    return IntoOutput && static_cast<int>(i) == final_owner;
  }
  // Per sample: where each layer's output and saved tensors start in the
  // saved area (a layer that writes the block's output keeps none there).
  static constexpr std::array<std::size_t, count + 1> offsets = [] {
    std::array<std::size_t, count + 1> out{};
    static_for<count>([&](auto i) {
      using L = type_at_t<i, body>;
      out[i + 1] = out[i] + (L::in_place || writes_output(i) ? 0 : L::output_shape::size) +
                   L::saved;
    });
    return out;
  }();
  static constexpr std::size_t saved = offsets[count];
  // Two activation-gradient buffers for the backward, then the largest
  // workspace of a layer (per sample: a block takes the batch whole, even
  // where a convolution inside works in chunks).
  static constexpr std::size_t gradient_buffer = info::largest_activation;
  static constexpr std::size_t layer_workspace = std::max(info::workspace, info::chunked_workspace);
  static constexpr std::size_t forward_flops = [] {
    std::size_t f = 0;
    static_for<count>([&](auto i) { f += type_at_t<i, body>::forward_flops; });
    return f;
  }();
  static constexpr std::size_t backward_flops = [] {
    std::size_t f = 0;
    static_for<count>([&](auto i) { f += type_at_t<i, body>::backward_flops; });
    return f;
  }();

  template <std::size_t I, class T>
  static T* output(const T* x, T* y, T* saved_area, std::size_t n) {
    constexpr int owner = info::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<T*>(x);
    else if constexpr (writes_output(owner))
      return y;
    else
      return saved_area + n * offsets[owner];
  }
  template <std::size_t I, class T>
  static const T* input(const T* x, T* y, T* saved_area, std::size_t n) {
    if constexpr (I == 0)
      return x;
    else
      return output<I - 1>(x, y, saved_area, n);
  }
  template <std::size_t I, class T>
  static LayerContext<T> context(const LayerContext<T>& outer, std::size_t n) {
    using L = type_at_t<I, body>;
    return {outer.pass, outer.state + info::state_offsets[I],
            outer.saved + n * (offsets[I] + (L::in_place || writes_output(I)
                                                 ? 0
                                                 : L::output_shape::size)),
            outer.precision, outer.frames};
  }

  // `work` holds the block's workspace: the two gradient buffers, then the
  // layers'.
  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& outer) {
    T* layer_work = work + 2 * gradient_buffer * n;
    static_for<count>([&](auto i) {
      using L = type_at_t<i, body>;
      T* out = output<i>(x, y, outer.saved, n);
      run_forward<L, T>(params + info::param_offsets[i], input<i>(x, y, outer.saved, n), out,
                        layer_work, n, context<i>(outer, n));
      if constexpr (!L::in_place) round_to(outer.precision, out, n * L::output_shape::size);
    });
  }

  // The backward from the chain's output gradient dy: its input gradient
  // written into dx (added to it when `add`; none when dx is null). Weight
  // gradients are rounded by the network, the whole block's at once.
  template <class T>
  static void backward(const T* params, const T* x, T* y, const T* dy, T* dx, bool add,
                       T* dparams, T* work, std::size_t n, bool accumulate,
                       const LayerContext<T>& outer) {
    using In = typename type_at_t<0, body>::input_shape;
    const std::array<T*, 2> buffers{work, work + gradient_buffer * n};
    T* layer_work = work + 2 * gradient_buffer * n;
    const T* gradient = dy;
    int next = 0;
    static_for_reverse<count>([&](auto i) {
      using L = type_at_t<i, body>;
      T* layer_dx = buffers[next];
      if constexpr (i == 0)
        if (dx == nullptr || !add) layer_dx = dx;
      run_backward<L, T>(params + info::param_offsets[i], input<i>(x, y, outer.saved, n),
                         output<i>(x, y, outer.saved, n), gradient, layer_dx,
                         dparams + info::param_offsets[i], layer_work, n, accumulate,
                         context<i>(outer, n));
      // An in-place layer's gradient is its output's: nothing moves.
      if constexpr (!L::in_place) {
        if (layer_dx != nullptr)
          round_to(outer.precision, layer_dx, n * L::input_shape::size);
        gradient = layer_dx;
        next = 1 - next;
      }
    });
    if (dx == nullptr) return;
    if (add)
      for (std::size_t k = 0; k < n * In::size; ++k) dx[k] += gradient[k];
    else if (gradient != dx)
      std::copy_n(gradient, n * In::size, dx);
  }

  // visit(index, values, per-sample size) for each layer's output of the
  // last forward, in order (a nested block's layers' before its own), until
  // one returns true (found).
  template <class T, class Visit>
  static bool visit_outputs(const T* x, T* y, const LayerContext<T>& outer, std::size_t n,
                            Visit&& visit) {
    bool found = false;
    static_for<count>([&](auto i) {
      using L = type_at_t<i, body>;
      if (found) return;
      if constexpr (BoundBlock<L>)
        found = L::visit_body_outputs(input<i>(x, y, outer.saved, n), context<i>(outer, n), n,
                                      visit);
      if constexpr (!L::in_place)
        if (!found) found = visit(L::index, output<i>(x, y, outer.saved, n), L::output_shape::size);
    });
    return found;
  }
};

// visit(index, values, count) for the weight gradients of a block's
// children in backward order (the last child first, into nested blocks),
// until one returns true.
template <class B, class T, class Visit>
bool visit_child_gradients(const T* dparams, Visit&& visit) {
  using children = typename B::children;
  bool found = false;
  static_for_reverse<children::size>([&](auto i) {
    using C = type_at_t<i, children>;
    const T* grads = dparams + list_info<children>::param_offsets[i];
    if constexpr (C::param_count > 0) {
      if (found) return;
      if constexpr (BoundBlock<C>)
        found = C::visit_body_gradients(grads, visit);
      else
        found = visit(C::index, grads, C::param_count);
    }
  });
  return found;
}

// The protocol's parts every block computes alike from its children.
template <class Spec, class In, class Out, std::size_t Index, class Children>
struct BlockBase : LayerBase<Spec, In, Out, Index> {
  using children = Children;
  using child_info = list_info<Children>;
  static constexpr std::size_t param_count = child_info::parameter_count;
  static constexpr std::size_t weight_count = param_count;
  static constexpr std::size_t state_count = child_info::state_count;
  static constexpr bool syncs = child_info::syncs;
  static constexpr bool contextual = true;
  static_assert(
      []<class... Cs>(TypeList<Cs...>) { return !(false || ... || TiesWeight<Cs>); }(Children{}),
      "a TiedLinear belongs at the network's top level, beside the Embedding it ties to, not "
      "inside a block");
  // The samples' lengths reach every layer of a block unchanged.
  static_assert(
      []<class... Cs>(TypeList<Cs...>) { return !(false || ... || ChangesFrames<Cs>); }(
          Children{}),
      "a layer that changes its samples' lengths (a strided Conv1d) belongs at the network's top "
      "level, not inside a block");

  // He initialisation where a ReLU follows a child inside the block (a
  // Residual's last layer is followed by the sum, whatever comes after).
  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    init_children(params, seed, false);
  }
  // The same, with `last_relu_follows` for the last child.
  template <class T>
  static void init_children(T* params, std::uint64_t seed, bool last_relu_follows) {
    static_for<Children::size>([&](auto i) {
      bool relu_follows = last_relu_follows;
      if constexpr (i + 1 < Children::size) relu_follows = type_at_t<i + 1, Children>::is_relu;
      type_at_t<i, Children>::init(params + child_info::param_offsets[i], seed, relu_follows);
    });
  }
  template <class T>
  static void init_state(T* state) {
    static_for<Children::size>([&](auto i) {
      type_at_t<i, Children>::init_state(state + child_info::state_offsets[i]);
    });
  }
};

// Each child's tensors, named "<prefix>kind.name" by the block's prefix.
template <class B, class Visit>
void block_tensors(Visit&& visit) {
  using children = typename B::children;
  static_for<children::size>([&](auto i) {
    using C = type_at_t<i, children>;
    const std::string prefix = B::child_prefix(i) + std::string(C::kind) + ".";
    C::tensors([&](std::string_view name, std::size_t offset, std::vector<std::size_t> shape,
                   bool state) {
      visit(prefix + std::string(name),
            offset + (state ? list_info<children>::state_offsets[i]
                            : list_info<children>::param_offsets[i]),
            std::move(shape), state);
    });
  });
}

// What a sequence block's first layer tells the network: that the input
// holds token ids (an Embedding first), which no precision may round.
template <class First>
struct first_layer_traits {};
template <class First>
  requires requires { First::takes_ids; }
struct first_layer_traits<First> {
  static constexpr bool takes_ids = First::takes_ids;
};

// A block whose children run in sequence (Series, named blocks).
template <class Spec, class In, std::size_t Index>
struct SequenceBlock
    : BlockBase<Spec, In, block_output_t<In, Index, typename Spec::template layers<In>>, Index,
                block_layers_t<In, Index, typename Spec::template layers<In>>>,
      first_layer_traits<type_at_t<0, block_layers_t<In, Index, typename Spec::template layers<In>>>> {
  using chain = Chain<typename SequenceBlock::children, true>;
  static constexpr std::size_t saved = chain::saved;
  static constexpr std::size_t workspace = 2 * chain::gradient_buffer + chain::layer_workspace;
  static constexpr std::size_t forward_flops = chain::forward_flops;
  static constexpr std::size_t backward_flops = chain::backward_flops;
  static constexpr std::string_view kind = Spec::kind;
  static constexpr std::string_view block_name = Spec::name;
  // He initialisation across the block's edges, as written out: a ReLU
  // first is the layer before's, a ReLU after it the last layer's.
  static constexpr bool is_relu = type_at_t<0, typename SequenceBlock::children>::is_relu;
  template <class T>
  static void init(T* params, std::uint64_t seed, bool relu_follows) {
    SequenceBlock::init_children(params, seed, relu_follows);
  }

  static std::string child_role(std::size_t position) {
    return "layer " + std::to_string(position + 1);
  }
  static std::string child_prefix(std::size_t position) {
    return std::to_string(position) + ".";
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    block_tensors<SequenceBlock>(visit);
  }
  template <class T, class Visit>
  static bool visit_body_outputs(const T* x, const LayerContext<T>& context, std::size_t n,
                                 Visit&& visit) {
    // The last layer's output is the block's, which the caller looks at.
    return chain::visit_outputs(x, static_cast<T*>(nullptr), context, n,
                                [&](std::size_t index, const T* values, std::size_t size) {
                                  return values != nullptr && visit(index, values, size);
                                });
  }
  template <class T, class Visit>
  static bool visit_body_gradients(const T* dparams, Visit&& visit) {
    return visit_child_gradients<SequenceBlock>(dparams, visit);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& context) {
    chain::forward(params, x, y, work, n, context);
  }
  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t n, bool accumulate, const LayerContext<T>& context) {
    chain::backward(params, x, const_cast<T*>(y), dy, dx, false, dparams, work, n, accumulate,
                    context);
  }
};

}  // namespace detail

template <class Spec, class In, std::size_t Index>
  requires std::derived_from<Spec, NamedBlock>
struct Bind<Spec, In, Index> : detail::SequenceBlock<Spec, In, Index> {};

}  // namespace loom
