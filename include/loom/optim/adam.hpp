// Adam and AdamW over one flat buffer: the first and second moment of each
// parameter, updated with the weights in one pass (PyTorch's Adam and AdamW,
// including their default hyperparameters).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/cpu/adam.hpp"
#include "../core/error.hpp"

namespace loom {

namespace detail {

template <bool Decoupled>
struct AdamFamily {
  static constexpr const char* name = Decoupled ? "AdamW" : "Adam";
  static constexpr std::size_t buffers_per_parameter = 2;

  struct Options {
    float lr = 1e-3f;
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float eps = 1e-8f;
    float weight_decay = Decoupled ? 1e-2f : 0.0f;

    // What a checkpoint keeps and a resumed run must share: every option
    // but lr, which schedules change.
    auto hyperparameters() const {
      return std::to_array<std::pair<const char*, float>>(
          {{"beta1", beta1}, {"beta2", beta2}, {"eps", eps}, {"weight_decay", weight_decay}});
    }
  };

  template <class T>
  class State {
   public:
    State(Options options, std::size_t parameter_count)
        : options_(options), exp_avg_(parameter_count), exp_avg_sq_(parameter_count) {
      LOOM_CHECK(options.lr > 0.0f, name, ": learning rate must be positive, got ", options.lr);
      LOOM_CHECK(options.beta1 >= 0.0f && options.beta1 < 1.0f, name,
                 ": beta1 must be in [0, 1), got ", options.beta1);
      LOOM_CHECK(options.beta2 >= 0.0f && options.beta2 < 1.0f, name,
                 ": beta2 must be in [0, 1), got ", options.beta2);
      LOOM_CHECK(options.eps > 0.0f, name, ": eps must be positive, got ", options.eps);
      LOOM_CHECK(options.weight_decay >= 0.0f, name, ": weight decay must be >= 0, got ",
                 options.weight_decay);
    }

    void step(std::span<T> weights, std::span<const T> grads) {
      LOOM_CHECK(weights.size() == grads.size() && weights.size() == exp_avg_.size(), name,
                 "::step: ", weights.size(), " weights and ", grads.size(),
                 " gradients for a state of ", exp_avg_.size());
      ++steps_;
      cpu::adam_update<T>(weights.data(), grads.data(), exp_avg_.data(), exp_avg_sq_.data(),
                          weights.size(),
                          {.lr = options_.lr,
                           .beta1 = options_.beta1,
                           .beta2 = options_.beta2,
                           .eps = options_.eps,
                           .weight_decay = options_.weight_decay,
                           .decoupled = Decoupled,
                           .t = steps_});
    }

    const Options& options() const { return options_; }
    // A schedule may reach 0 (a warm-up's first step, a cosine's end).
    void set_lr(float lr) {
      LOOM_CHECK(lr >= 0.0f, name, ": learning rate must be >= 0, got ", lr);
      options_.lr = lr;
    }

    // What a checkpoint keeps: the moments (PyTorch's names) and the step
    // count, which the bias corrections depend on.
    std::size_t buffer_count() const { return 2; }
    std::string_view buffer_name(std::size_t i) const { return i == 0 ? "exp_avg" : "exp_avg_sq"; }
    std::span<T> buffer(std::size_t i) { return i == 0 ? exp_avg_ : exp_avg_sq_; }
    std::span<const T> buffer(std::size_t i) const { return i == 0 ? exp_avg_ : exp_avg_sq_; }
    std::uint64_t steps() const { return steps_; }
    void set_steps(std::uint64_t steps) { steps_ = steps; }

   private:
    Options options_;
    std::vector<T> exp_avg_, exp_avg_sq_;
    std::uint64_t steps_ = 0;
  };
};

}  // namespace detail

// Adam: weight decay is added to the gradient (L2 regularisation).
struct Adam : detail::AdamFamily<false> {};
// AdamW: weights decay by lr * weight_decay apart from the gradient.
struct AdamW : detail::AdamFamily<true> {};

}  // namespace loom
