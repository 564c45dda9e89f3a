// Model<Net, T>: one instance of a network on the CPU backend: the flat
// parameter and gradient buffers (offsets fixed at compile time) and an arena
// for activations sized from the memory plan, so forward and backward never
// allocate.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/arena.hpp"
#include "../core/error.hpp"
#include "../core/meta.hpp"
#include "../core/precision.hpp"
#include "sequential.hpp"

namespace loom {

template <class Net_, class T_ = float>
class Model {
 public:
  using Net = Net_;
  using T = T_;
  using executed = typename Net::executed;
  static constexpr std::size_t layer_count = executed::size;
  static constexpr std::size_t parameter_count = Net::parameter_count;
  static constexpr std::size_t state_count = Net::state_count;
  static constexpr std::size_t input_size = Net::input_shape::size;
  static constexpr std::size_t output_size = Net::output_shape::size;

  explicit Model(std::uint64_t seed = 0, std::size_t max_batch = 0)
      : params_(parameter_count),
        grads_(parameter_count),
        state_(state_count),
        kept_state_(state_count),
        arena_(0, "Model activations") {
    initialize(seed);
    if (max_batch > 0) reserve(max_batch);
  }

  // Seeded weights: the same seed gives the same weights for any backend,
  // policy, or fused/unfused form of the network.
  void initialize(std::uint64_t seed) {
    weights_stale_ = true;
    using user_layers = typename Net::layers;
    static_for<user_layers::size>([&](auto i) {
      using L = type_at_t<i, user_layers>;
      L::init(params_.data() + detail::list_info<user_layers>::param_offsets[i], seed,
              relu_follows<i>());
      L::init_state(state_.data() + detail::list_info<user_layers>::state_offsets[i]);
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
    arena_.reserve(activation_elements(max_batch, slots));
    workspace_ = arena_.take(Net::memory_plan.workspace_elements(max_batch));
    grad_buffers_[0] = arena_.take(Net::memory_plan.activation_gradients / 2 * max_batch);
    grad_buffers_[1] = arena_.take(Net::memory_plan.activation_gradients / 2 * max_batch);
    slots_.assign(slots, Slot{});
    for (auto& slot : slots_)
      static_for<layer_count>([&](auto i) {
        using L = type_at_t<i, executed>;
        if constexpr (!L::in_place) slot.outputs[i] = arena_.take(L::output_shape::size * max_batch);
        if constexpr (L::saved > 0) slot.saved[i] = arena_.take(L::saved * max_batch);
      });
    capacity_ = max_batch;
  }

  // Elements reserve(max_batch, slots) carves: the activation memory plan,
  // with each buffer padded to the arena's alignment.
  static constexpr std::size_t activation_elements(std::size_t max_batch, std::size_t slots = 1) {
    constexpr auto plan = Net::memory_plan;
    using Pad = Arena<T>;
    std::size_t outputs = 0;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
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

  // Runs the network on n samples (n x input_size, NCHW). Returns the
  // outputs (n x output_size), valid until the next forward on that slot.
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
    if (precision_ != Precision::fp32 && weights_stale_) {
      std::ranges::copy(params_, compute_params_.begin());
      round_to(precision_, compute_params_.data(), compute_params_.size());
      weights_stale_ = false;
    }
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      detail::run_forward<L, T>(layer_params<i>(), layer_input<i>(s), layer_output<i>(s),
                                workspace_, n, context<i>(s));
      if constexpr (!L::in_place)
        round_to(precision_, layer_output<i>(s), n * L::output_shape::size);
    });
    return layer_output<layer_count - 1>(s);
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
  // final (layers in reverse order): data parallelism starts reducing them
  // while the layers before are still back-propagating.
  template <class OnLayerDone>
  void backward(bool accumulate, OnLayerDone&& done) {
    backward_slot(0, accumulate, nullptr, done);
  }

  // A pipeline stage's backward: the micro-batch that slot `slot` holds,
  // writing d(loss)/d(input) to input_gradient (n x input_size) for the
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
  // weights each layer uses, its outputs and the gradients it passes back
  // (of its input and of its weights) are rounded to it, as the GPU's
  // reduced-precision kernels store them; the parameters, their gradients'
  // sums and the optimizer stay fp32.
  void set_precision(Precision precision) {
    if (precision == precision_) return;
    precision_ = precision;
    compute_params_.assign(precision == Precision::fp32 ? 0 : parameter_count, T(0));
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

 private:
  static constexpr std::size_t largest_layer_parameters() {
    std::size_t most = 0;
    static_for<layer_count>(
        [&](auto i) { most = std::max(most, type_at_t<i, executed>::param_count); });
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

  void check_batch(std::size_t n, const char* what) {
    LOOM_CHECK(n > 0, "Model::", what, ": empty batch");
    if (n > capacity_) reserve(n);
  }

  // The weights layers compute with: the rounded copy in a reduced precision.
  template <std::size_t I>
  T* layer_params() {
    return (precision_ == Precision::fp32 ? params_.data() : compute_params_.data()) +
           detail::list_info<executed>::param_offsets[I];
  }
  template <std::size_t I>
  T* layer_grads() {
    return grads_.data() + detail::list_info<executed>::param_offsets[I];
  }
  // Per micro-batch in flight: its input, pass, every layer's output and
  // what layers saved for backward.
  struct Slot {
    const T* input = nullptr;
    std::size_t batch = 0;
    Pass pass;
    std::array<T*, layer_count> outputs{};
    std::array<T*, layer_count> saved{};
  };

  template <std::size_t I>
  LayerContext<T> context(const Slot& s) {
    return {s.pass, state_.data() + detail::list_info<executed>::state_offsets[I], s.saved[I]};
  }

  template <class OnLayerDone>
  void backward_slot(std::size_t slot, bool accumulate, T* input_gradient, OnLayerDone&& done) {
    LOOM_CHECK(!slots_.empty() && slots_[slot].batch > 0, "Model::backward called before forward");
    const Slot& s = slots_[slot];
    int current = 0;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      const T* dy = grad_buffers_[current];
      T* dx = i == 0 ? input_gradient : grad_buffers_[1 - current];
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
        if (accumulate)
          for (std::size_t k = 0; k < L::param_count; ++k) grads[k] += grad_sums_[k];
        if constexpr (!L::in_place)
          if (dx != nullptr) round_to(precision_, dx, s.batch * L::input_shape::size);
      }
      if (!L::in_place) current = 1 - current;
      done(std::size_t{i});
    });
    // An in-place first layer (Flatten) passes the gradient through unchanged.
    if constexpr (type_at_t<0, executed>::in_place)
      if (input_gradient != nullptr)
        std::copy_n(grad_buffers_[current], s.batch * input_size, input_gradient);
  }

  template <std::size_t I>
  static const T* layer_input(const Slot& s) {
    if constexpr (I == 0)
      return s.input;
    else
      return layer_output<I - 1>(s);
  }
  // In-place layers write nothing: their "output" is an earlier buffer.
  template <std::size_t I>
  static T* layer_output(const Slot& s) {
    constexpr int owner = detail::list_info<executed>::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<T*>(s.input);
    else
      return s.outputs[owner];
  }

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
