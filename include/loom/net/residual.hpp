// Residual<Layers...>: y = body(x) + shortcut(x), the ResNet block. The body
// is a small network of its own (bound to the block's input, fused like the
// top level); the shortcut is the identity when the body keeps the shape,
// else a projection chosen at compile time: a 1 x 1 strided Conv2d for
// images, a Linear for vectors. A ReLU after the block is written after it:
// Residual<Conv2d<16, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<16, 3, 1, 1>,
// BatchNorm2d>, ReLU.
//
// Body layers are numbered 64 x (block index) + 1, 2, ... (the projection
// 64 x block index) in their seeds and error messages.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "sequential.hpp"

namespace loom {

template <class... Layers>
struct Residual {};

namespace detail {

template <class In, class Out, std::size_t Index>
struct shortcut_of {
  static_assert(std::is_same_v<In, Out>,
                "loom shape error: Residual's body changes the shape in a way no shortcut "
                "projects (a 1 x 1 Conv2d maps C x H x W to C' x H' x W', a Linear maps F to "
                "F'; anything else must keep the shape)");
  using type = void;  // identity
};

// Images: 1 x 1 convolution with the stride that maps the input's height onto
// the body's (a strided body halves 28 to 14, or 7 to 4 with padding).
template <std::size_t C, std::size_t H, std::size_t W, std::size_t C2, std::size_t H2,
          std::size_t W2, std::size_t Index>
  requires(C != C2 || H != H2 || W != W2)
struct shortcut_of<Shape<C, H, W>, Shape<C2, H2, W2>, Index> {
  static constexpr std::size_t stride = (H + H2 - 1) / H2;
  using type = Bind<Conv2d<C2, 1, stride>, Shape<C, H, W>, Index>;
  static_assert(window_out(H, 1, stride, 0) == H2 && window_out(W, 1, stride, 0) == W2,
                "loom shape error: Residual's body changes the image size in a way no strided "
                "1 x 1 projection matches");
};

template <std::size_t F, std::size_t F2, std::size_t Index>
  requires(F != F2)
struct shortcut_of<Shape<F>, Shape<F2>, Index> {
  using type = Bind<Linear<F2>, Shape<F>, Index>;
};

template <class Body>
struct body_offsets {
  static constexpr std::size_t count = Body::size;
  // Per sample: where each body layer's output and saved tensors start in
  // the block's saved area.
  static constexpr auto compute() {
    std::array<std::size_t, count + 1> out{};
    static_for<count>([&](auto i) {
      using L = type_at_t<i, Body>;
      out[i + 1] = out[i] + (L::in_place ? 0 : L::output_shape::size) + L::saved;
    });
    return out;
  }
  static constexpr std::array<std::size_t, count + 1> offsets = compute();
};

}  // namespace detail

template <class... Ls, class In, std::size_t Index>
struct Bind<Residual<Ls...>, In, Index>
    : LayerBase<Residual<Ls...>, In,
                typename type_at_t<sizeof...(Ls) - 1,
                                   typename detail::bind_all<In, 64 * Index + 1, TypeList<>,
                                                             Ls...>::type>::output_shape,
                Index> {
  static_assert(sizeof...(Ls) > 0 && sizeof...(Ls) < 64,
                "Residual<Layers...> takes 1 to 63 layers");
  using layers = typename detail::bind_all<In, 64 * Index + 1, TypeList<>, Ls...>::type;
  using body = fuse_t<layers>;
  using Out = typename type_at_t<sizeof...(Ls) - 1, layers>::output_shape;
  using shortcut = typename detail::shortcut_of<In, Out, 64 * Index>::type;
  static constexpr bool identity = std::is_void_v<shortcut>;
  using info = detail::list_info<body>;
  static constexpr std::size_t body_count = body::size;
  static constexpr std::size_t body_params = detail::list_info<layers>::parameter_count;
  static constexpr std::size_t shortcut_params = [] {
    if constexpr (identity)
      return std::size_t{0};
    else
      return shortcut::param_count;
  }();
  static constexpr std::size_t shortcut_workspace = [] {
    if constexpr (identity)
      return std::size_t{0};
    else
      return shortcut::workspace;
  }();

  static constexpr std::size_t param_count = body_params + shortcut_params;
  static constexpr std::size_t weight_count = param_count;
  static constexpr std::size_t state_count = info::state_count;
  static constexpr bool syncs = info::syncs;
  static constexpr bool contextual = true;
  static constexpr std::size_t saved = detail::body_offsets<body>::offsets[body_count];
  // Two activation-gradient buffers for the body, then the largest workspace
  // of a body layer or the projection (per sample: the block takes the
  // batch whole, even where a convolution inside works in chunks).
  static constexpr std::size_t gradient_buffer = info::largest_activation;
  static constexpr std::size_t workspace =
      2 * gradient_buffer + std::max({info::workspace, info::chunked_workspace, shortcut_workspace});
  static constexpr std::size_t forward_flops = [] {
    std::size_t f = Out::size;
    static_for<body_count>([&](auto i) { f += type_at_t<i, body>::forward_flops; });
    if constexpr (!identity) f += shortcut::forward_flops;
    return f;
  }();
  static constexpr std::size_t backward_flops = [] {
    std::size_t f = In::size;
    static_for<body_count>([&](auto i) { f += type_at_t<i, body>::backward_flops; });
    if constexpr (!identity) f += shortcut::backward_flops;
    return f;
  }();
  static constexpr std::string_view kind = "residual";

  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    static_for<layers::size>([&](auto i) {
      using L = type_at_t<i, layers>;
      bool relu_follows = false;
      if constexpr (i + 1 < layers::size) relu_follows = type_at_t<i + 1, layers>::is_relu;
      L::init(params + detail::list_info<layers>::param_offsets[i], seed, relu_follows);
    });
    if constexpr (!identity) shortcut::init(params + body_params, seed, false);
  }
  // "body.K.kind.name" for the K-th layer of the body (from 0), and
  // "shortcut.kind.name" for a projection.
  template <class Visit>
  static void tensors(Visit&& visit) {
    static_for<layers::size>([&](auto i) {
      using L = type_at_t<i, layers>;
      const std::string prefix =
          "body." + std::to_string(i) + "." + std::string(L::kind) + ".";
      L::tensors([&](std::string_view name, std::size_t offset,
                     std::vector<std::size_t> shape, bool state) {
        visit(prefix + std::string(name),
              offset + (state ? detail::list_info<layers>::state_offsets[i]
                              : detail::list_info<layers>::param_offsets[i]),
              std::move(shape), state);
      });
    });
    if constexpr (!identity)
      shortcut::tensors([&](std::string_view name, std::size_t offset,
                            std::vector<std::size_t> shape, bool state) {
        visit("shortcut." + std::string(shortcut::kind) + "." + std::string(name),
              body_params + offset, std::move(shape), state);
      });
  }
  template <class T>
  static void init_state(T* state) {
    static_for<layers::size>([&](auto i) {
      type_at_t<i, layers>::init_state(state + detail::list_info<layers>::state_offsets[i]);
    });
  }

  template <std::size_t I, class T>
  static T* output(const T* x, T* saved_area, std::size_t n) {
    constexpr int owner = info::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<T*>(x);
    else
      return saved_area + n * detail::body_offsets<body>::offsets[owner];
  }
  template <std::size_t I, class T>
  static const T* input(const T* x, T* saved_area, std::size_t n) {
    if constexpr (I == 0)
      return x;
    else
      return output<I - 1>(x, saved_area, n);
  }
  template <std::size_t I, class T>
  static LayerContext<T> body_context(const LayerContext<T>& context, std::size_t n) {
    using L = type_at_t<I, body>;
    return {context.pass, context.state + info::state_offsets[I],
            context.saved + n * (detail::body_offsets<body>::offsets[I] +
                                 (L::in_place ? 0 : L::output_shape::size)),
            context.precision};
  }

  // For the diagnosis of a non-finite step (net/model.hpp): visit(index,
  // values, per-sample size) for each body layer's output of the last
  // forward, in order, until one returns true (found).
  template <class T, class Visit>
  static bool visit_body_outputs(const T* x, const LayerContext<T>& context, std::size_t n,
                                 Visit&& visit) {
    bool found = false;
    static_for<body_count>([&](auto i) {
      using L = type_at_t<i, body>;
      if constexpr (!L::in_place)
        if (!found) found = visit(L::index, output<i>(x, context.saved, n), L::output_shape::size);
    });
    return found;
  }
  // visit(index, values, count) for the weight gradients in backward order:
  // the projection's (its backward runs first), then the body's, last first.
  template <class T, class Visit>
  static bool visit_body_gradients(const T* dparams, Visit&& visit) {
    bool found = false;
    if constexpr (!identity) found = visit(shortcut::index, dparams + body_params, shortcut_params);
    static_for_reverse<layers::size>([&](auto i) {
      using L = type_at_t<i, layers>;
      if constexpr (L::param_count > 0)
        if (!found)
          found = visit(L::index, dparams + detail::list_info<layers>::param_offsets[i],
                        L::param_count);
    });
    return found;
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& context) {
    T* body_work = work + 2 * gradient_buffer * n;
    static_for<body_count>([&](auto i) {
      using L = type_at_t<i, body>;
      detail::run_forward<L, T>(params + info::param_offsets[i], input<i>(x, context.saved, n),
                                output<i>(x, context.saved, n), body_work, n,
                                body_context<i>(context, n));
      if constexpr (!L::in_place)
        round_to(context.precision, output<i>(x, context.saved, n), n * L::output_shape::size);
    });
    // The sum is rounded by the network, as any layer's output.
    const T* body_out = output<body_count - 1>(x, context.saved, n);
    if constexpr (identity) {
      for (std::size_t k = 0; k < n * Out::size; ++k) y[k] = body_out[k] + x[k];
    } else {
      shortcut::template forward<T>(params + body_params, x, y, body_work, n);
      round_to(context.precision, y, n * Out::size);
      for (std::size_t k = 0; k < n * Out::size; ++k) y[k] += body_out[k];
    }
  }

  template <class T>
  static void backward(const T* params, const T* x, const T*, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t n, bool accumulate, const LayerContext<T>& context) {
    std::array<T*, 2> gradients{work, work + gradient_buffer * n};
    T* body_work = work + 2 * gradient_buffer * n;
    // The shortcut's input gradient goes straight to dx; the body's is added.
    if constexpr (identity) {
      if (dx != nullptr) std::copy_n(dy, n * In::size, dx);
    } else {
      // The projection has no activation, so its output (passed as dy) is not read.
      shortcut::template backward<T>(params + body_params, x, dy, dy, dx,
                                     dparams + body_params, body_work, n, accumulate);
      if (dx != nullptr) round_to(context.precision, dx, n * In::size);
    }
    std::copy_n(dy, n * Out::size, gradients[0]);
    int current = 0;
    static_for_reverse<body_count>([&](auto i) {
      using L = type_at_t<i, body>;
      T* layer_dx = i == 0 ? (dx != nullptr ? gradients[1 - current] : nullptr)
                           : gradients[1 - current];
      detail::run_backward<L, T>(params + info::param_offsets[i], input<i>(x, context.saved, n),
                                 output<i>(x, context.saved, n), gradients[current], layer_dx,
                                 dparams + info::param_offsets[i], body_work, n, accumulate,
                                 body_context<i>(context, n));
      // Weight gradients are rounded by the network, the whole block's at once.
      if constexpr (!L::in_place)
        if (layer_dx != nullptr) round_to(context.precision, layer_dx, n * L::input_shape::size);
      if (!L::in_place) current = 1 - current;
    });
    if (dx != nullptr)
      for (std::size_t k = 0; k < n * In::size; ++k) dx[k] += gradients[current][k];
  }
};

}  // namespace loom
