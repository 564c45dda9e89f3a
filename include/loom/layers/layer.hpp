// What every layer shares: the Bind template that attaches a layer spec to
// its input shape and position, the compile-time shape checks whose messages
// name the layer, and seeded initialisation.
//
// Layer specs (Conv2d<20, 5>, ReLU, ...) are empty tags. Bind<Spec, In, Index>
// is the layer placed in a network: it knows its input and output shapes,
// parameter count, FLOPs and workspace, and runs forward and backward by
// calling backend ops. Index counts from 1; index 0 is the Input.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "../core/meta.hpp"
#include "../core/precision.hpp"
#include "../core/rng.hpp"
#include "../core/shape.hpp"

namespace loom {

// Sums over the data-parallel replicas, for layers whose statistics span
// the global batch (SyncBatchNorm). Every replica calls it in the same order.
struct ReplicaSum {
  virtual ~ReplicaSum() = default;
  virtual void sum(std::span<double> values) = 0;
};

// The ranks that split a layer's weights (tensor parallelism, one group
// of the mesh's tensor axis): each holds a slice of the layer, and these
// combine their parts. Every rank of the group calls them in the same
// order, and every rank gets the same result, bit for bit (so the layers
// after a sum hold equal copies on every rank).
struct TensorGroup {
  virtual ~TensorGroup() = default;
  virtual void sum(std::span<float> values) = 0;
  virtual void sum(std::span<double> values) = 0;
  // Every rank's `mine` (all of one size), rank r's as the r-th block of `all`.
  virtual void gather(std::span<const float> mine, std::span<float> all) = 0;
  virtual void gather(std::span<const double> mine, std::span<double> all) = 0;
  std::size_t rank = 0, size = 1;
};

// How a forward runs: in training (batch statistics, dropout) or evaluation,
// and where its samples sit in the step's global batch. Dropout's mask is a
// function of (seed, step, global sample index), so every policy draws the
// same masks as one device.
struct Pass {
  bool training = false;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::size_t first_sample = 0;
  ReplicaSum* replicas = nullptr;  // DataParallel's, when the network syncs statistics
  TensorGroup* tensor = nullptr;   // TensorParallel's, for the layers it splits
  // Sequences: each sample's length at the network's input, from the
  // micro-batch's first sample (the data set's frames); null: all full.
  const std::int32_t* frames = nullptr;
};

// What a contextual layer gets besides its tensors.
template <class T>
struct LayerContext {
  Pass pass;
  T* state = nullptr;  // the layer's state_count elements (running statistics)
  T* saved = nullptr;  // saved x n elements, kept from the forward to its backward
  // What a block's inner layers round their outputs and gradients to, as
  // the network rounds its own layers' (net/model.hpp's set_precision).
  Precision precision = Precision::fp32;
  // Sequences of varying length: each sample's length of the time dimension
  // (the input's first, Frames of Frames x Features) at this layer's input;
  // null when every sample has all its frames. A layer over time reads
  // nothing at or past a sample's length (as zeros), writes zeros there in
  // its output and input gradient, and so lets padding change nothing. A
  // layer that changes the length declares
  //   static constexpr std::size_t frames_out(std::size_t frames_in);
  // and the network maps the lengths through it for the layers after it
  // and the loss.
  const std::int32_t* frames = nullptr;
};

// Whether a layer changes its samples' lengths (Conv1d with a stride).
template <class L>
concept ChangesFrames = requires(std::size_t f) {
  { L::frames_out(f) } -> std::convertible_to<std::size_t>;
};

// Spec wrapper produced by the fusion pass: Layer followed by Activation, run as one.
template <class Layer_, class Activation_>
struct Fused {
  using Layer = Layer_;
  using Activation = Activation_;
};

// Where a layer sits, as compile errors print it: LayerPath<3> is layer 3 of
// the network, LayerPath<3, 2> the 2nd layer inside the block that is layer
// 3 (a Residual's projection shortcut is its child 0), LayerPath<3, 2, 1>
// the 1st inside that one. Run-time messages write it "layer 3.2.1".
template <std::size_t... Steps>
struct LayerPath {};

namespace detail {

// A layer's index, as Bind numbers it, read as its path: a block's children
// are numbered 64 x (the block's index) + 1, 2, ... and a network has at
// most 63 layers at its top level (net/sequential.hpp), so every index
// below 64 is a top-level layer's and the rest are children's.
template <std::size_t Index, std::size_t... Tail>
constexpr auto layer_path_of() {
  if constexpr (Index < 64)
    return LayerPath<Index, Tail...>{};
  else
    return layer_path_of<Index / 64, Index % 64, Tail...>();
}
template <std::size_t Index>
using layer_path_t = decltype(layer_path_of<Index>());

// "layer 3", "layer 3.2", "layer 3.2.1": layer_path_t's path, for messages.
inline std::string layer_path_text(std::size_t index) {
  std::string steps;
  while (index >= 64) {
    steps = "." + std::to_string(index % 64) + steps;
    index /= 64;
  }
  return "layer " + std::to_string(index) + steps;
}

// These structs carry the numbers of a shape error in their template
// arguments, so the compiler prints the layer's path (LayerPath), the
// layer, and the expected and actual values next to the message.
template <class At, class Layer, std::size_t ExpectedRank, std::size_t ActualRank>
struct layer_input_rank_mismatch_at {
  static_assert(ExpectedRank == ActualRank,
                "loom shape error: the layer's input has the wrong number of dimensions "
                "(template arguments: layer path, layer, expected rank, actual rank). "
                "Conv2d and pooling take C x H x W; Linear takes a flat vector, or Positions x "
                "Features (per position): on C x H x W insert Flatten before it; Conv1d, GRU and "
                "LSTM take Frames x Features: insert Reshape<Frames, Features>");
  static constexpr bool ok = ExpectedRank == ActualRank;
};
template <std::size_t Index, class Layer, std::size_t ExpectedRank, std::size_t ActualRank>
using layer_input_rank_mismatch =
    layer_input_rank_mismatch_at<layer_path_t<Index>, Layer, ExpectedRank, ActualRank>;

template <class At, class Layer, std::size_t Window, std::size_t InputSize>
struct layer_window_larger_than_input_at {
  static_assert(Window <= InputSize,
                "loom shape error: the layer's window is larger than its (padded) input "
                "(template arguments: layer path, layer, window size, input size); check the "
                "sizes of the Conv2d/MaxPool2d layers before it");
  static constexpr bool ok = Window <= InputSize;
};
template <std::size_t Index, class Layer, std::size_t Window, std::size_t InputSize>
using layer_window_larger_than_input =
    layer_window_larger_than_input_at<layer_path_t<Index>, Layer, Window, InputSize>;

template <class At, class Layer, std::size_t Value>
struct layer_argument_must_be_positive_at {
  static_assert(Value > 0,
                "loom shape error: a layer size, kernel or stride is zero (template arguments: "
                "layer path, layer, value)");
  static constexpr bool ok = Value > 0;
};
template <std::size_t Index, class Layer, std::size_t Value>
using layer_argument_must_be_positive =
    layer_argument_must_be_positive_at<layer_path_t<Index>, Layer, Value>;

// Dimension I of S, or 1 when S has fewer dimensions; keeps shape arithmetic
// well-formed after a rank error so that only the named error is reported.
template <class S, std::size_t I>
inline constexpr std::size_t dim_or_one = I < S::rank ? S::dims[I < S::rank ? I : 0] : 1;

// Output length of a window sliding over `input` (floor mode).
constexpr std::size_t window_out(std::size_t input, std::size_t window, std::size_t stride,
                                 std::size_t pad) {
  return input + 2 * pad >= window && stride > 0 ? (input + 2 * pad - window) / stride + 1 : 1;
}

// Seeded uniform initialisation of `count` weights with bound `limit`: each
// value is a function of (seed, layer index, element index) only, computed
// in double and rounded once, so every backend, policy and element type that
// rounds to the same precision gets the same weights.
template <class T>
void init_uniform(T* weights, std::size_t count, double limit, std::uint64_t seed,
                  std::size_t layer_index) {
  for (std::size_t i = 0; i < count; ++i)
    weights[i] = static_cast<T>(
        (2.0 * uniform01(seed, stream_key(RngPurpose::init, layer_index), i) - 1.0) * limit);
}

// He (Kaiming) uniform when a ReLU follows, which keeps activations' variance
// through the rectifier; Glorot (Xavier) uniform otherwise.
inline double init_limit(std::size_t fan_in, std::size_t fan_out, bool relu_follows) {
  return relu_follows ? std::sqrt(6.0 / static_cast<double>(fan_in))
                      : std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
}

}  // namespace detail

// Defaults shared by every Bind specialisation; layers override what applies.
template <class Spec_, class In_, class Out_, std::size_t Index_>
struct LayerBase {
  using spec = Spec_;
  using input_shape = In_;
  using output_shape = Out_;
  static constexpr std::size_t index = Index_;
  static constexpr std::size_t weight_count = 0;
  static constexpr std::size_t bias_count = 0;
  static constexpr std::size_t param_count = 0;
  static constexpr std::size_t workspace = 0;  // elements per sample
  // Samples per chunk when the layer works through the batch in chunks (its
  // workspace then holds one chunk); 0: the whole batch at once.
  static constexpr std::size_t chunk = 0;
  static constexpr std::size_t forward_flops = 0;   // per sample
  static constexpr std::size_t backward_flops = 0;  // per sample
  static constexpr bool in_place = false;           // output aliases input (no copy, no buffer)
  static constexpr bool is_relu = false;
  // Layers that need a LayerContext (running statistics, saved tensors, the
  // Pass) set this and take it as the last argument of forward and backward.
  static constexpr bool contextual = false;
  static constexpr std::size_t saved = 0;        // elements per sample, per activation slot
  static constexpr std::size_t state_count = 0;  // not trained: updated by forward
  // Calls Pass::replicas in training (SyncBatchNorm, or a block holding one).
  static constexpr bool syncs = false;
  static constexpr bool checked = true;  // shape checks passed (layers with rules override)

  template <class T>
  static void init(T*, std::uint64_t, bool) {}
  template <class T>
  static void init_state(T*) {}
  // Names its tensors for checkpoints: visit(name, offset, shape, state)
  // for each, the offset into the layer's parameters (state: its running
  // statistics), the shape in PyTorch's layout and names.
  template <class Visit>
  static void tensors(Visit&&) {}
};

namespace detail {

// Calls a bound layer's forward/backward, with the context when it takes one.
template <class L, class T>
void run_forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                 const LayerContext<T>& context) {
  if constexpr (L::contextual)
    L::template forward<T>(params, x, y, work, n, context);
  else
    L::template forward<T>(params, x, y, work, n);
}

template <class L, class T>
void run_backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                  T* work, std::size_t n, bool accumulate, const LayerContext<T>& context) {
  if constexpr (L::contextual)
    L::template backward<T>(params, x, y, dy, dx, dparams, work, n, accumulate, context);
  else
    L::template backward<T>(params, x, y, dy, dx, dparams, work, n, accumulate);
}

}  // namespace detail

// A type with no layer implementation, named with its path as every shape
// error is.
template <class At, class Spec>
struct not_a_layer_at {
  static_assert(dependent_false<Spec>,
                "No loom layer implementation for this type (template arguments: layer path, "
                "type); is it a layer from loom/layers (Conv2d, MaxPool2d, AvgPool2d, Linear, "
                "ReLU, Flatten, BatchNorm, Residual, GRU, ...)?");
  static constexpr bool ok = false;
};

template <class Spec_, class In_, std::size_t Index_>
struct Bind : LayerBase<Spec_, In_, In_, Index_> {
  static_assert(not_a_layer_at<detail::layer_path_t<Index_>, Spec_>::ok);
};

}  // namespace loom
