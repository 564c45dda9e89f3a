// Residual<Layers...>: y = body(x) + shortcut(x), the ResNet block. The body
// is a small network of its own (bound to the block's input, fused like the
// top level); the shortcut is the identity when the body keeps the shape,
// else a projection chosen at compile time: a 1 x 1 strided Conv2d for
// images, a Linear for vectors. A ReLU after the block is written after it:
// Residual<Conv2d<16, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<16, 3, 1, 1>,
// BatchNorm2d>, ReLU.
//
// Body layers are numbered 64 x (block index) + 1, 2, ... (the projection
// 64 x block index) in their seeds; error messages print their paths
// (LayerPath<block index, 1>, ...).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "block.hpp"
#include "sequential.hpp"

namespace loom {

template <class... Layers>
struct Residual {};

namespace detail {

// Projects: a shortcut maps In to Out (the identity, when they are equal).
// Given explicitly by every user, so that g++ prints it (it leaves defaulted
// arguments out).
template <class At, class In, class Out, bool Projects>
struct residual_body_changes_shape_at {
  static_assert(Projects,
                "loom shape error: Residual's body changes the shape in a way no shortcut "
                "projects (template arguments: the block's path, its input shape, its body's "
                "output shape, false). A 1 x 1 Conv2d maps C x H x W to C' x H' x W' with a "
                "stride that takes H to H' and W to W', a Linear maps F to F'; any other body "
                "must keep the shape");
  static constexpr bool ok = Projects;
};

// The stride of a 1 x 1 convolution that maps a height h onto h2, and
// whether it maps H x W onto H2 x W2.
constexpr std::size_t projection_stride(std::size_t h, std::size_t h2) { return (h + h2 - 1) / h2; }
constexpr bool strided_projection_fits(std::size_t h, std::size_t w, std::size_t h2,
                                       std::size_t w2) {
  const std::size_t stride = projection_stride(h, h2);
  return window_out(h, 1, stride, 0) == h2 && window_out(w, 1, stride, 0) == w2;
}

// Index: the projection's, 64 x the block's (its child 0). The check is a
// base, so it is instantiated, and reported, once.
template <class In, class Out, std::size_t Index>
struct shortcut_of
    : residual_body_changes_shape_at<layer_path_t<Index / 64>, In, Out, std::is_same_v<In, Out>> {
  using type = void;  // identity
};

// Images: 1 x 1 convolution with the stride that maps the input's height onto
// the body's (a strided body halves 28 to 14, or 7 to 4 with padding).
template <std::size_t C, std::size_t H, std::size_t W, std::size_t C2, std::size_t H2,
          std::size_t W2, std::size_t Index>
  requires(C != C2 || H != H2 || W != W2)
struct shortcut_of<Shape<C, H, W>, Shape<C2, H2, W2>, Index>
    : residual_body_changes_shape_at<layer_path_t<Index / 64>, Shape<C, H, W>, Shape<C2, H2, W2>,
                                     strided_projection_fits(H, W, H2, W2)> {
  static constexpr std::size_t stride = projection_stride(H, H2);
  using type = Bind<Conv2d<C2, 1, stride>, Shape<C, H, W>, Index>;
};

template <std::size_t F, std::size_t F2, std::size_t Index>
  requires(F != F2)
struct shortcut_of<Shape<F>, Shape<F2>, Index> {
  using type = Bind<Linear<F2>, Shape<F>, Index>;
};

// A Residual block's children: its body's layers, then the projection.
template <class Body, class Shortcut>
struct residual_children {
  using type = Body;
};
template <class... Ls, class Shortcut>
  requires(!std::is_void_v<Shortcut>)
struct residual_children<TypeList<Ls...>, Shortcut> {
  using type = TypeList<Ls..., Shortcut>;
};
template <class Body, class Shortcut>
using residual_children_t = typename residual_children<Body, Shortcut>::type;

}  // namespace detail

template <class... Ls, class In, std::size_t Index>
struct Bind<Residual<Ls...>, In, Index>
    : detail::BlockBase<
          Residual<Ls...>, In, detail::block_output_t<In, Index, TypeList<Ls...>>, Index,
          detail::residual_children_t<
              detail::block_layers_t<In, Index, TypeList<Ls...>>,
              typename detail::shortcut_of<In, detail::block_output_t<In, Index, TypeList<Ls...>>,
                                           64 * Index>::type>> {
  using layers = detail::block_layers_t<In, Index, TypeList<Ls...>>;
  using chain = detail::Chain<layers, false>;
  using body = typename chain::body;
  using info = typename chain::info;
  using Out = typename type_at_t<sizeof...(Ls) - 1, layers>::output_shape;
  using shortcut = typename detail::shortcut_of<In, Out, 64 * Index>::type;
  static constexpr bool identity = std::is_void_v<shortcut>;
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

  static constexpr std::size_t saved = chain::saved;
  static constexpr std::size_t gradient_buffer = chain::gradient_buffer;
  static constexpr std::size_t workspace =
      2 * gradient_buffer + std::max(chain::layer_workspace, shortcut_workspace);
  static constexpr std::size_t forward_flops = [] {
    std::size_t f = Out::size + chain::forward_flops;
    if constexpr (!identity) f += shortcut::forward_flops;
    return f;
  }();
  static constexpr std::size_t backward_flops = [] {
    std::size_t f = In::size + chain::backward_flops;
    if constexpr (!identity) f += shortcut::backward_flops;
    return f;
  }();
  static constexpr std::string_view kind = "residual";
  static constexpr std::string_view block_name = "Residual block";

  // "body layer 2" for the body's 2nd layer, "the projection" for the
  // shortcut's; tensors are "body.1.kind.name" and "shortcut.kind.name".
  static std::string child_role(std::size_t position) {
    return position < sizeof...(Ls) ? "body layer " + std::to_string(position + 1)
                                    : std::string("the projection");
  }
  static std::string child_prefix(std::size_t position) {
    return position < sizeof...(Ls) ? "body." + std::to_string(position) + "."
                                    : std::string("shortcut.");
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    detail::block_tensors<Bind>(visit);
  }

  // For the diagnosis of a non-finite step (net/model.hpp): the body's
  // outputs of the last forward, before the block's sum.
  template <class T, class Visit>
  static bool visit_body_outputs(const T* x, const LayerContext<T>& context, std::size_t n,
                                 Visit&& visit) {
    return chain::visit_outputs(x, static_cast<T*>(nullptr), context, n, visit);
  }
  // The projection's weight gradients first (its backward runs first), then
  // the body's, last first.
  template <class T, class Visit>
  static bool visit_body_gradients(const T* dparams, Visit&& visit) {
    return detail::visit_child_gradients<Bind>(dparams, visit);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& context) {
    T* body_work = work + 2 * gradient_buffer * n;
    chain::forward(params, x, static_cast<T*>(nullptr), work, n, context);
    // The sum is rounded by the network, as any layer's output.
    const T* body_out =
        chain::template output<body_count - 1>(x, static_cast<T*>(nullptr), context.saved, n);
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
    chain::backward(params, x, static_cast<T*>(nullptr), dy, dx, true, dparams, work, n,
                    accumulate, context);
  }
};

}  // namespace loom
