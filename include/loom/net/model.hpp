// Model<Net, T>: one instance of a network on the CPU backend: the flat
// parameter and gradient buffers (offsets fixed at compile time) and an arena
// for activations sized from the memory plan, so forward and backward never
// allocate.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/arena.hpp"
#include "../core/error.hpp"
#include "../core/meta.hpp"
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
  static constexpr std::size_t input_size = Net::input_shape::size;
  static constexpr std::size_t output_size = Net::output_shape::size;

  explicit Model(std::uint64_t seed = 0, std::size_t max_batch = 0)
      : params_(parameter_count), grads_(parameter_count), arena_(0, "Model activations") {
    initialize(seed);
    if (max_batch > 0) reserve(max_batch);
  }

  // Seeded weights: the same seed gives the same weights for any backend,
  // policy, or fused/unfused form of the network.
  void initialize(std::uint64_t seed) {
    using user_layers = typename Net::layers;
    static_for<user_layers::size>([&](auto i) {
      using L = type_at_t<i, user_layers>;
      L::init(params_.data() + detail::list_info<user_layers>::param_offsets[i], seed,
              relu_follows<i>());
    });
  }

  // Sizes the activation arena for batches of up to max_batch samples.
  void reserve(std::size_t max_batch) {
    LOOM_CHECK(max_batch > 0, "Model::reserve: batch size must be positive");
    if (max_batch <= capacity_) return;
    constexpr auto plan = Net::memory_plan;
    using Pad = Arena<T>;
    std::size_t total = Pad::padded_size(plan.workspace_elements(max_batch)) +
                        2 * Pad::padded_size(plan.activation_gradients / 2 * max_batch);
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!L::in_place) total += Pad::padded_size(L::output_shape::size * max_batch);
    });
    arena_.reserve(total);
    workspace_ = arena_.take(plan.workspace_elements(max_batch));
    grad_buffers_[0] = arena_.take(plan.activation_gradients / 2 * max_batch);
    grad_buffers_[1] = arena_.take(plan.activation_gradients / 2 * max_batch);
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (L::in_place)
        outputs_[i] = nullptr;
      else
        outputs_[i] = arena_.take(L::output_shape::size * max_batch);
    });
    capacity_ = max_batch;
  }

  std::size_t capacity() const { return capacity_; }

  // Runs the network on n samples (n x input_size, NCHW). Returns the
  // outputs (n x output_size), valid until the next forward.
  const T* forward(const T* input, std::size_t n) {
    check_batch(n, "forward");
    input_ = input;
    batch_ = n;
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      L::template forward<T>(layer_params<i>(), layer_input<i>(), layer_output<i>(), workspace_, n);
    });
    return layer_output<layer_count - 1>();
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
    LOOM_CHECK(batch_ > 0, "Model::backward called before forward");
    int current = 0;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      const T* dy = grad_buffers_[current];
      T* dx = i == 0 ? nullptr : grad_buffers_[1 - current];
      L::template backward<T>(layer_params<i>(), layer_input<i>(), layer_output<i>(), dy, dx,
                              layer_grads<i>(), workspace_, batch_, accumulate);
      if (!L::in_place) current = 1 - current;
      done(std::size_t{i});
    });
  }

  std::span<T> parameters() { return params_; }
  std::span<const T> parameters() const { return params_; }
  std::span<T> gradients() { return grads_; }
  std::span<const T> gradients() const { return grads_; }

 private:
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

  template <std::size_t I>
  T* layer_params() {
    return params_.data() + detail::list_info<executed>::param_offsets[I];
  }
  template <std::size_t I>
  T* layer_grads() {
    return grads_.data() + detail::list_info<executed>::param_offsets[I];
  }
  template <std::size_t I>
  const T* layer_input() const {
    if constexpr (I == 0)
      return input_;
    else
      return layer_output<I - 1>();
  }
  // In-place layers write nothing: their "output" is an earlier buffer.
  template <std::size_t I>
  T* layer_output() const {
    constexpr int owner = detail::list_info<executed>::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<T*>(input_);
    else
      return outputs_[owner];
  }

  std::vector<T> params_;
  std::vector<T> grads_;
  Arena<T> arena_;
  std::size_t capacity_ = 0;
  std::size_t batch_ = 0;
  const T* input_ = nullptr;
  T* workspace_ = nullptr;
  std::array<T*, 2> grad_buffers_{};
  std::array<T*, layer_count> outputs_{};
};

}  // namespace loom
