// Model<Net, T>: one instance of a network on the CPU backend: the flat
// parameter and gradient buffers (layer offsets fixed at compile time) and an arena
// for activations sized from the memory plan, so forward and backward never
// allocate. A Model of a LayerRange is a pipeline stage's: it holds and runs
// those executed layers only.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../core/arena.hpp"
#include "../core/error.hpp"
#include "../core/meta.hpp"
#include "../core/precision.hpp"
#include "sequential.hpp"

namespace loom {

// Where a training step first went non-finite (FitOptions::on_nonfinite):
// the batch's input, then in forward order a layer's weights (an earlier
// update overflowed, or they were set so) or its output, then in backward
// order a layer's weight gradient. Plain numbers, so that ranks in other
// processes can send theirs.
struct NonFiniteSpot {
  enum class Where : std::uint8_t { nowhere, input, weight, output, gradient };
  Where where = Where::nowhere;
  std::size_t layer = 0;    // the user's index (a block's layers: 64 x block + k)
  std::size_t block = 0;    // the top-level layer holding it (== layer outside blocks)
  std::size_t element = 0;  // the first non-finite value: in one sample's output, or the gradient
  std::size_t size = 0;     // values of one sample's output (of the input), or of the gradient
  std::size_t sample = 0;   // input and outputs: which sample of the batch
  float value = 0.0f;       // nan, inf or -inf

  explicit operator bool() const { return where != Where::nowhere; }
  // Earlier in the step first: the input, outputs in forward order, then
  // gradients in backward order (the last layer's first).
  bool before(const NonFiniteSpot& other) const {
    const auto stage = [](Where w) { return w == Where::output ? Where::weight : w; };
    if (stage(where) != stage(other.where)) return stage(where) < stage(other.where);
    if (block != other.block)
      return where == Where::gradient ? block > other.block : block < other.block;
    return where < other.where;
  }
};

namespace detail {

// The index of the first non-finite of n values (n when all are finite).
// Finite or not is the exponent: all ones for inf and nan. An integer max
// over it vectorises; a test with an early exit does not, and every step
// of a healthy run reads every gradient.
template <class T>
std::size_t first_nonfinite(const T* values, std::size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    constexpr std::uint32_t exponent = 0x7f800000u;
    constexpr std::size_t block = 4096;
    for (std::size_t begin = 0; begin < n; begin += block) {
      const std::size_t end = std::min(n, begin + block);
      std::uint32_t most = 0;
      for (std::size_t i = begin; i < end; ++i)
        most = std::max(most, std::bit_cast<std::uint32_t>(values[i]) & exponent);
      if (most != exponent) continue;
      for (std::size_t i = begin; i < end; ++i)
        if (!std::isfinite(values[i])) return i;
    }
    return n;
  } else {
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isfinite(values[i])) return i;
    return n;
  }
}

template <class T>
bool all_finite(const T* values, std::size_t n) {
  return first_nonfinite(values, n) == n;
}

// f.template operator()<L>() for the bound layer of List whose index is
// `index`, looking inside blocks (their children, nested blocks' too);
// false when none is.
template <class List, class F>
bool with_layer(std::size_t index, F&& f) {
  bool found = false;
  static_for<List::size>([&](auto i) {
    using L = type_at_t<i, List>;
    if (found) return;
    if (L::index == index) {
      f.template operator()<L>();
      found = true;
      return;
    }
    if constexpr (BoundBlock<L>) found = with_layer<typename L::children>(index, f);
  });
  return found;
}

inline std::string value_text(float value) {
  return std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
}

// Where layer `index` sits inside block B, by the roles its blocks give
// their children: "body layer 2 (conv)", or inside a nested block "body
// layer 2 (linear) of the Residual block that is layer 1"; empty when it is
// not inside B.
template <class B>
std::string inside_text(std::size_t index) {
  using children = typename B::children;
  std::string text;
  static_for<children::size>([&](auto p) {
    using C = type_at_t<p, children>;
    if (!text.empty()) return;
    if (C::index == index) {
      text = B::child_role(p) + " (" + std::string(C::kind) + ")";
    } else if constexpr (BoundBlock<C>) {
      const std::string inner = inside_text<C>(index);
      if (!inner.empty())
        text = inner + " of the " + std::string(C::block_name) + " that is " + B::child_role(p);
    }
  });
  return text;
}

// "layer 3 (conv)"; inside a block (`block`: the top-level layer holding
// it), "body layer 2 (conv) of the Residual block at layer 1".
template <class Net>
std::string layer_text(std::size_t layer, std::size_t block) {
  std::string text;
  with_layer<typename Net::layers>(block, [&]<class L>() {
    if (layer == block)
      text = "layer " + std::to_string(layer) + " (" + std::string(L::kind) + ")";
    else if constexpr (BoundBlock<L>)
      text = inside_text<L>(layer) + " of the " + std::string(L::block_name) + " at layer " +
             std::to_string(block);
  });
  return text.empty() ? "layer " + std::to_string(layer) + " (?)" : text;
}

// "its weight, element 17 of 5000": where element `element` of layer
// `layer`'s parameters lies.
template <class Net>
std::string parameter_text(std::size_t layer, std::size_t element, std::size_t size) {
  std::string where = "element " + std::to_string(element) + " of " + std::to_string(size);
  with_layer<typename Net::layers>(layer, [&]<class L>() {
    L::tensors([&](std::string_view name, std::size_t begin, std::vector<std::size_t> shape,
                   bool state) {
      std::size_t count = 1;
      for (const std::size_t d : shape) count *= d;
      if (!state && element >= begin && element < begin + count)
        where = "its " + std::string(name) + ", element " + std::to_string(element - begin) +
                " of " + std::to_string(count);
    });
  });
  return where;
}

// What `spot` says, e.g. "layer 3 (conv) output became inf (sample 5 of
// the batch, element 1234 of 11520)".
template <class Net>
std::string spot_text(const NonFiniteSpot& spot) {
  using Where = NonFiniteSpot::Where;
  const std::string value = value_text(spot.value);
  const std::string at =
      "element " + std::to_string(spot.element) + " of " + std::to_string(spot.size);
  switch (spot.where) {
    case Where::input:
      return "the input batch holds " + value + " (sample " + std::to_string(spot.sample) + ", " +
             at + ")";
    case Where::output:
      return layer_text<Net>(spot.layer, spot.block) + " output became " + value + " (sample " +
             std::to_string(spot.sample) + " of the batch, " + at + ")";
    case Where::weight:
      return layer_text<Net>(spot.layer, spot.block) + " holds a weight that is " + value + " (" +
             parameter_text<Net>(spot.layer, spot.element, spot.size) +
             "): an earlier update overflowed, or it was set so";
    case Where::gradient:
      return "the gradient of " + layer_text<Net>(spot.layer, spot.block) + " became " + value +
             " (" + parameter_text<Net>(spot.layer, spot.element, spot.size) + ")";
    case Where::nowhere:
      break;
  }
  return "no layer's output or gradient is non-finite";
}

}  // namespace detail

template <class Net_, class T_ = float>
class Model {
 public:
  using Net = Net_;
  using T = T_;
  using executed = typename Net::executed;
  static constexpr std::size_t layer_count = executed::size;
  // The whole network's sizes, also on a Model of a range (whose own are
  // parameters().size(), state().size(), range_input_size() and
  // range_output_size()).
  static constexpr std::size_t parameter_count = Net::parameter_count;
  static constexpr std::size_t state_count = Net::state_count;
  static constexpr std::size_t input_size = Net::input_shape::size;
  static constexpr std::size_t output_size = Net::output_shape::size;
  static constexpr LayerRange all_layers{0, layer_count};

  explicit Model(std::uint64_t seed = 0, std::size_t max_batch = 0)
      : Model(all_layers, seed, max_batch) {}

  // The executed layers of `range` alone (parameters(), state() and the
  // sizes below are theirs), seeded as the whole network's are.
  explicit Model(LayerRange range, std::uint64_t seed = 0, std::size_t max_batch = 0)
      : range_(checked(range)),
        param_base_(offsets::param_offsets[range.first]),
        state_base_(offsets::state_offsets[range.first]),
        params_(offsets::param_offsets[range.last] - param_base_),
        grads_(params_.size()),
        state_(offsets::state_offsets[range.last] - state_base_),
        kept_state_(state_.size()),
        arena_(0, "Model activations") {
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (i == range.first) {
        in_size_ = L::input_shape::size;
        first_in_place_ = L::in_place;
      }
      if (i + 1 == range.last) out_size_ = L::output_shape::size;
    });
    initialize(seed);
    if (max_batch > 0) reserve(max_batch);
  }

  const LayerRange& range() const { return range_; }
  // Whether the range's first layer reads token ids (Embedding's takes_ids).
  bool input_takes_ids() const {
    bool ids = false;
    static_for<layer_count>([&](auto i) {
      if constexpr (requires { type_at_t<i, executed>::takes_ids; })
        ids = ids || i == range_.first;
    });
    return ids;
  }
  // Per sample, the range's input and output (the network's for the whole).
  std::size_t range_input_size() const { return in_size_; }
  std::size_t range_output_size() const { return out_size_; }
  // Sequences: the samples' lengths at the range's output for the slot's
  // last forward (the loss reads them), or null when its pass gave none.
  const std::int32_t* output_frames(std::size_t slot = 0) const {
    return frames_at(slots_.at(slot), range_.last);
  }

  // Seeded weights: the same seed gives the same weights for any backend,
  // policy, or fused/unfused form of the network.
  void initialize(std::uint64_t seed) {
    weights_stale_ = true;
    using user_layers = typename Net::layers;
    static_for<user_layers::size>([&](auto i) {
      using L = type_at_t<i, user_layers>;
      const std::size_t at = detail::list_info<user_layers>::param_offsets[i];
      const std::size_t state_at = detail::list_info<user_layers>::state_offsets[i];
      // A range's layers: their parameters and statistics lie in its buffers.
      if (!within(at, L::param_count, param_base_, params_.size()) ||
          !within(state_at, L::state_count, state_base_, state_.size()))
        return;
      L::init(params_.data() + (at - param_base_), seed, relu_follows<i>());
      L::init_state(state_.data() + (state_at - state_base_));
    });
  }

  // Sizes the activation arena for batches of up to max_batch samples, with
  // `slots` sets of layer outputs: a pipeline stage keeps one per micro-batch
  // in flight, each alive from its forward to its backward (workspace and the
  // activation-gradient buffers are shared: one backward runs at a time).
  void reserve(std::size_t max_batch, std::size_t slots = 1) {
    LOOM_CHECK(max_batch > 0, "Model::reserve: batch size must be positive");
    LOOM_CHECK(slots > 0, "Model::reserve: need at least one activation slot");
    if (max_batch <= capacity_ && slots <= slots_.size()) return;
    max_batch = std::max(max_batch, capacity_);
    slots = std::max(slots, slots_.size());
    const MemoryPlan plan = memory_plan(range_);
    arena_.reserve(activation_elements(max_batch, slots, range_));
    workspace_ = arena_.take(plan.workspace_elements(max_batch));
    grad_buffers_[0] = arena_.take(plan.activation_gradients / 2 * max_batch);
    grad_buffers_[1] = arena_.take(plan.activation_gradients / 2 * max_batch);
    slots_.assign(slots, Slot{});
    for (auto& slot : slots_)
      static_for<layer_count>([&](auto i) {
        using L = type_at_t<i, executed>;
        if (!in_range(i)) return;
        if constexpr (!L::in_place) slot.outputs[i] = arena_.take(L::output_shape::size * max_batch);
        if constexpr (L::saved > 0) slot.saved[i] = arena_.take(L::saved * max_batch);
      });
    for (auto& slot : slots_) slot.frames.assign(frames_rules * max_batch, 0);
    capacity_ = max_batch;
  }

  // The activation memory plan of a range of the layers, by Net::memory_plan's
  // rule (for all of them, its figures but `parameters`, left 0).
  static constexpr MemoryPlan memory_plan(LayerRange range) {
    MemoryPlan plan;
    std::size_t largest = 0;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (i < range.first || i >= range.last) return;
      plan.activations += (L::in_place ? 0 : L::output_shape::size) + L::saved;
      largest = std::max({largest, L::input_shape::size, L::output_shape::size});
      plan.chunk = std::max(plan.chunk, L::chunk);
      if (L::chunk == 0) {
        plan.workspace = std::max(plan.workspace, L::workspace);
      } else {
        plan.chunked_workspace = std::max(plan.chunked_workspace, L::workspace);
        plan.chunk_workspace = std::max(plan.chunk_workspace, L::workspace * L::chunk);
      }
    });
    plan.activation_gradients = 2 * largest;
    return plan;
  }

  // Elements reserve(max_batch, slots) carves: the activation memory plan,
  // with each buffer padded to the arena's alignment.
  static constexpr std::size_t activation_elements(std::size_t max_batch, std::size_t slots = 1,
                                                   LayerRange range = all_layers) {
    const MemoryPlan plan = memory_plan(range);
    using Pad = Arena<T>;
    std::size_t outputs = 0;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (i < range.first || i >= range.last) return;
      if constexpr (!L::in_place) outputs += Pad::padded_size(L::output_shape::size * max_batch);
      if constexpr (L::saved > 0) outputs += Pad::padded_size(L::saved * max_batch);
    });
    return Pad::padded_size(plan.workspace_elements(max_batch)) +
           2 * Pad::padded_size(plan.activation_gradients / 2 * max_batch) + slots * outputs;
  }

  std::size_t capacity() const { return capacity_; }
  std::size_t slots() const { return slots_.size(); }
  // Elements the activation arena holds (what reserve() allocated).
  std::size_t arena_elements() const { return arena_.capacity(); }

  // Runs the network (the range) on n samples (n x range_input_size(),
  // NCHW). Returns the outputs (n x range_output_size()), valid until the
  // next forward on that slot.
  // The input must stay valid until the slot's backward (layers read it).
  // `pass` says training or evaluation (BatchNorm, Dropout); the default,
  // evaluation, uses the running statistics and drops nothing.
  const T* forward(const T* input, std::size_t n, std::size_t slot = 0, const Pass& pass = {}) {
    check_batch(n, "forward");
    LOOM_CHECK(slot < slots_.size(), "Model::forward: activation slot ", slot, " of ",
               slots_.size(), " reserved");
    Slot& s = slots_[slot];
    s.input = input;
    s.batch = n;
    s.pass = pass;
    map_frames(s);
    if (precision_ != Precision::fp32) {
      if (weights_stale_) {
        std::ranges::copy(params_, compute_params_.begin());
        round_to(precision_, compute_params_.data(), compute_params_.size());
        weights_stale_ = false;
      }
      // The first layer reads the input rounded, as a GPU's converts it;
      // token ids (an Embedding's) are read as they are.
      if (!input_takes_ids()) {
        if (s.rounded_input.size() < capacity_ * in_size_)
          s.rounded_input.resize(capacity_ * in_size_);
        std::copy_n(input, n * in_size_, s.rounded_input.data());
        round_to(precision_, s.rounded_input.data(), n * in_size_);
        s.input = s.rounded_input.data();
      }
    }
    const T* output = nullptr;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (!in_range(i)) return;
      detail::run_forward<L, T>(layer_params<i>(), layer_input<i>(s), layer_output<i>(s),
                                workspace_, n, context<i>(s));
      if constexpr (!L::in_place)
        round_to(precision_, layer_output<i>(s), n * L::output_shape::size);
      output = layer_output<i>(s);
    });
    return output;
  }

  // Where the loss writes d(loss)/d(output) before backward().
  T* output_gradient() {
    LOOM_CHECK(capacity_ > 0, "Model::output_gradient: call reserve() or forward() first");
    return grad_buffers_[0];
  }

  // Back-propagates output_gradient() through the last forward's batch into
  // gradients(): overwritten, or added to when accumulate is true (gradient
  // accumulation over micro-batches).
  void backward(bool accumulate = false) {
    backward(accumulate, [](std::size_t) {});
  }

  // The same, calling done(i) as soon as executed layer i's gradients are
  // final (layers in reverse order; i counts from the range's first layer):
  // data parallelism starts reducing them
  // while the layers before are still back-propagating.
  template <class OnLayerDone>
  void backward(bool accumulate, OnLayerDone&& done) {
    backward_slot(0, accumulate, nullptr, done);
  }

  // A pipeline stage's backward: the micro-batch that slot `slot` holds,
  // writing d(loss)/d(input) to input_gradient (n x range_input_size()) for the
  // stage before.
  void backward(std::size_t slot, bool accumulate, T* input_gradient) {
    backward(slot, accumulate, input_gradient, [](std::size_t) {});
  }
  // The same, calling done(i) as each executed layer's gradients become
  // final (Hybrid reduces a stage's gradients over its copies meanwhile).
  template <class OnLayerDone>
  void backward(std::size_t slot, bool accumulate, T* input_gradient, OnLayerDone&& done) {
    LOOM_CHECK(slot < slots_.size(), "Model::backward: activation slot ", slot, " of ",
               slots_.size(), " reserved");
    backward_slot(slot, accumulate, input_gradient, done);
  }

  // The fp32 master weights. (Handing them out marks the rounded copy a
  // reduced precision computes with as stale.)
  std::span<T> parameters() {
    weights_stale_ = true;
    return params_;
  }
  std::span<const T> parameters() const { return params_; }

  // The precision forward and backward compute in: with bf16 or fp16 the
  // network's input, the weights each layer uses, its outputs, the loss
  // gradient and the gradients each layer passes back (of its input and of
  // its weights) are rounded to it, as the GPU's reduced-precision kernels
  // hold them; the parameters, their gradients' sums and the optimizer stay
  // fp32.
  void set_precision(Precision precision) {
    if (precision == precision_) return;
    precision_ = precision;
    compute_params_.assign(precision == Precision::fp32 ? 0 : params_.size(), T(0));
    grad_sums_.assign(precision == Precision::fp32 ? 0 : largest_layer_parameters(), T(0));
    weights_stale_ = true;
  }
  Precision precision() const { return precision_; }
  std::span<T> gradients() { return grads_; }
  std::span<const T> gradients() const { return grads_; }
  // Running statistics (BatchNorm's mean and variance), updated by training
  // forwards, read by evaluation ones.
  std::span<T> state() { return state_; }
  std::span<const T> state() const { return state_; }
  // A step that turns out non-finite is skipped: keep_state() at its start,
  // restore_state() then puts the running statistics back.
  void keep_state() { std::ranges::copy(state_, kept_state_.begin()); }
  void restore_state() { std::ranges::copy(kept_state_, state_.begin()); }

  // Whether every weight gradient is finite: one pass over gradients(),
  // what a healthy step pays for the check.
  bool gradients_finite() const { return detail::all_finite(grads_.data(), grads_.size()); }

  // Diagnosis of a step gone non-finite (run only then): the first
  // non-finite value of the last forward through `slot`, in its input
  // (with `input`: a pipeline's later stages get theirs from the stage
  // before, which looks at it), then layer by layer in forward order in the
  // layer's weights and its output (a block's layers' outputs before the
  // block's own).
  NonFiniteSpot find_nonfinite_output(std::size_t slot, bool input = true) {
    NonFiniteSpot spot;
    const Slot& s = slots_.at(slot);
    if (s.batch == 0) return spot;
    const auto look = [&](NonFiniteSpot::Where where, std::size_t layer, std::size_t block,
                          const T* values, std::size_t per_sample) {
      const std::size_t at = detail::first_nonfinite(values, s.batch * per_sample);
      if (at == s.batch * per_sample) return false;
      spot = {where,      layer, block, at % per_sample, per_sample,
              s.pass.first_sample + at / per_sample, static_cast<float>(values[at])};
      return true;
    };
    if (input && look(NonFiniteSpot::Where::input, 0, 0, s.input, in_size_)) return spot;
    bool found = false;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (found || !in_range(i)) return;
      spot = weight_spot<i>();
      if (spot) {
        found = true;
        return;
      }
      if constexpr (detail::BoundBlock<L>)
        found = L::visit_body_outputs(
            layer_input<i>(s), context<i>(s), s.batch,
            [&](std::size_t layer, const T* values, std::size_t per_sample) {
              return look(NonFiniteSpot::Where::output, layer, L::index, values, per_sample);
            });
      if constexpr (!L::in_place)
        if (!found)
          found = look(NonFiniteSpot::Where::output, L::index, L::index, layer_output<i>(s),
                       L::output_shape::size);
    });
    return spot;
  }

  // The first layer in forward order whose weights hold a non-finite value
  // (find_nonfinite_output looks at them too, between the outputs): for a
  // device whose outputs are gone, with the weights gathered here.
  NonFiniteSpot find_nonfinite_weight() const {
    NonFiniteSpot spot;
    static_for<layer_count>([&](auto i) {
      if (!spot && in_range(i)) spot = weight_spot<i>();
    });
    return spot;
  }

  // The first layer in backward order (the last layer first) whose weight
  // gradient holds a non-finite value.
  NonFiniteSpot find_nonfinite_gradient() {
    NonFiniteSpot spot;
    const auto look = [&](std::size_t layer, std::size_t block, const T* values,
                          std::size_t count) {
      const std::size_t at = detail::first_nonfinite(values, count);
      if (at == count) return false;
      spot = {NonFiniteSpot::Where::gradient, layer, block, at, count, 0,
              static_cast<float>(values[at])};
      return true;
    };
    bool found = false;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (L::param_count > 0) {
        if (found || !in_range(i)) return;
        if constexpr (detail::BoundBlock<L>)
          found = L::visit_body_gradients(
              layer_grads<i>(), [&](std::size_t layer, const T* values, std::size_t count) {
                return look(layer, L::index, values, count);
              });
        else
          found = look(L::index, L::index, layer_grads<i>(), L::param_count);
      }
    });
    return spot;
  }

 private:
  // Layer I's first non-finite master weight (a reduced precision's copy is
  // rounded from them), if any.
  template <std::size_t I>
  NonFiniteSpot weight_spot() const {
    using L = type_at_t<I, executed>;
    if constexpr (L::param_count > 0) {
      const T* weights = params_.data() + (offsets::param_offsets[I] - param_base_);
      const std::size_t at = detail::first_nonfinite(weights, L::param_count);
      if (at < L::param_count)
        return {NonFiniteSpot::Where::weight, L::index, L::index, at, L::param_count, 0,
                static_cast<float>(weights[at])};
    }
    return {};
  }

  std::size_t largest_layer_parameters() const {
    std::size_t most = 0;
    static_for<layer_count>([&](auto i) {
      if (in_range(i)) most = std::max(most, type_at_t<i, executed>::param_count);
    });
    return most;
  }

  // Whether user layer I is followed by a ReLU (He rather than Glorot init).
  template <std::size_t I>
  static constexpr bool relu_follows() {
    using user_layers = typename Net::layers;
    if constexpr (I + 1 < user_layers::size)
      return type_at_t<I + 1, user_layers>::is_relu;
    else
      return false;
  }

  using offsets = detail::list_info<executed>;

  static LayerRange checked(LayerRange range) {
    LOOM_CHECK(range.first < range.last && range.last <= layer_count, "Model: layers [",
               range.first, ", ", range.last, ") are no range of the network's ", layer_count,
               " executed layers");
    return range;
  }
  bool in_range(std::size_t i) const { return i >= range_.first && i < range_.last; }
  // Whether [at, at + count) of the network's flat buffer lies in a range's
  // [base, base + size).
  static bool within(std::size_t at, std::size_t count, std::size_t base, std::size_t size) {
    return at >= base && at - base + count <= size;
  }

  void check_batch(std::size_t n, const char* what) {
    LOOM_CHECK(n > 0, "Model::", what, ": empty batch");
    if (n > capacity_) reserve(n);
  }

  // The weights layers compute with: the rounded copy in a reduced precision.
  template <std::size_t I>
  T* layer_params() {
    return (precision_ == Precision::fp32 ? params_.data() : compute_params_.data()) +
           (offsets::param_offsets[I] - param_base_);
  }
  template <std::size_t I>
  T* layer_grads() {
    return grads_.data() + (offsets::param_offsets[I] - param_base_);
  }
  // Per micro-batch in flight: its input, pass, every layer's output and
  // what layers saved for backward.
  struct Slot {
    const T* input = nullptr;
    std::size_t batch = 0;
    Pass pass;
    std::array<T*, layer_count> outputs{};
    std::array<T*, layer_count> saved{};
    std::vector<T> rounded_input;  // a reduced precision's copy of the input
    // Sequences: the samples' lengths after each layer that changes them
    // (frames_rules of them, capacity each), in the network's order.
    std::vector<std::int32_t> frames;
  };

  // Per executed layer: how many layers before it change the samples'
  // lengths (layers/layer.hpp's ChangesFrames), so which lengths it reads.
  static constexpr std::array<std::size_t, layer_count + 1> frames_rules_before = [] {
    std::array<std::size_t, layer_count + 1> before{};
    static_for<layer_count>([&](auto i) {
      before[i + 1] = before[i] + (ChangesFrames<type_at_t<i, executed>> ? 1 : 0);
    });
    return before;
  }();
  static constexpr std::size_t frames_rules = frames_rules_before[layer_count];

  // The samples' lengths at executed layer `layer`'s input (layer_count:
  // the network's output), or null when the slot's pass has none.
  const std::int32_t* frames_at(const Slot& s, std::size_t layer) const {
    if (s.pass.frames == nullptr) return nullptr;
    const std::size_t rules = frames_rules_before[layer];
    return rules == 0 ? s.pass.frames : s.frames.data() + (rules - 1) * capacity_;
  }
  // Maps the pass's lengths through every layer that changes them, up to
  // the range's end (those before the range too: the pass holds the
  // network's input lengths).
  void map_frames(Slot& s) {
    if constexpr (frames_rules > 0) {
      if (s.pass.frames == nullptr) return;
      static_for<layer_count>([&](auto i) {
        using L = type_at_t<i, executed>;
        if constexpr (ChangesFrames<L>) {
          if (i >= range_.last) return;
          const std::int32_t* in = frames_at(s, i);
          std::int32_t* out = s.frames.data() + frames_rules_before[i] * capacity_;
          for (std::size_t k = 0; k < s.batch; ++k)
            out[k] = static_cast<std::int32_t>(L::frames_out(static_cast<std::size_t>(in[k])));
        }
      });
    }
  }

  template <std::size_t I>
  LayerContext<T> context(const Slot& s) {
    return {s.pass, state_.data() + (offsets::state_offsets[I] - state_base_), s.saved[I],
            precision_, frames_at(s, I)};
  }

  template <class OnLayerDone>
  void backward_slot(std::size_t slot, bool accumulate, T* input_gradient, OnLayerDone&& done) {
    LOOM_CHECK(!slots_.empty() && slots_[slot].batch > 0, "Model::backward called before forward");
    const Slot& s = slots_[slot];
    // The loss gradient, as bf16 logits would get it (a later stage's is
    // rounded already: rounding again changes nothing).
    if (precision_ != Precision::fp32)
      round_to(precision_, grad_buffers_[0], s.batch * out_size_);
    int current = 0;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if (!in_range(i)) return;
      const T* dy = grad_buffers_[current];
      T* dx = i == range_.first ? input_gradient : grad_buffers_[1 - current];
      // In a reduced precision a layer's weight gradients come out of its
      // GEMMs rounded, and are added to the earlier micro-batches' in fp32:
      // the sum so far waits in grad_sums_ while the layer writes its own.
      const bool reduced = precision_ != Precision::fp32;
      T* grads = layer_grads<i>();
      if (reduced && accumulate) std::copy_n(grads, L::param_count, grad_sums_.data());
      detail::run_backward<L, T>(layer_params<i>(), layer_input<i>(s), layer_output<i>(s), dy, dx,
                                 grads, workspace_, s.batch, accumulate && !reduced,
                                 context<i>(s));
      if (reduced) {
        round_to(precision_, grads, L::param_count);
        if constexpr (L::param_count > 0)
          if (accumulate)
            for (std::size_t k = 0; k < L::param_count; ++k) grads[k] += grad_sums_[k];
        if constexpr (!L::in_place)
          if (dx != nullptr) round_to(precision_, dx, s.batch * L::input_shape::size);
      }
      if (!L::in_place) current = 1 - current;
      done(i - range_.first);
    });
    // An in-place first layer (Flatten) passes the gradient through unchanged.
    if (first_in_place_ && input_gradient != nullptr)
      std::copy_n(grad_buffers_[current], s.batch * in_size_, input_gradient);
  }

  template <std::size_t I>
  const T* layer_input(const Slot& s) const {
    return detail::range_input<executed, I>(s.outputs, const_cast<T*>(s.input), range_);
  }
  template <std::size_t I>
  T* layer_output(const Slot& s) const {
    return detail::range_output<executed, I>(s.outputs, const_cast<T*>(s.input), range_);
  }

  LayerRange range_;
  std::size_t param_base_ = 0, state_base_ = 0;  // where the range's begin in the network's
  std::size_t in_size_ = 0, out_size_ = 0;
  bool first_in_place_ = false;  // the range begins with an in-place layer
  std::vector<T> params_;
  std::vector<T> compute_params_;  // params_ rounded to precision_ (empty in fp32)
  std::vector<T> grad_sums_;       // a layer's accumulated gradients, meanwhile (reduced precisions)
  Precision precision_ = Precision::fp32;
  bool weights_stale_ = true;  // params_ may have changed since compute_params_ was made
  std::vector<T> grads_;
  std::vector<T> state_;
  std::vector<T> kept_state_;
  Arena<T> arena_;
  std::size_t capacity_ = 0;
  std::vector<Slot> slots_;
  T* workspace_ = nullptr;
  std::array<T*, 2> grad_buffers_{};
};

}  // namespace loom
