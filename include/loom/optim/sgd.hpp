// SGD with momentum, Nesterov and weight decay, over one flat buffer.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/cpu/sgd.hpp"
#include "../core/error.hpp"

namespace loom {

struct SGD {
  static constexpr const char* name = "SGD";
  static constexpr std::size_t buffers_per_parameter = 1;  // the velocity, with momentum

  struct Options {
    float lr = 0.01f;
    float momentum = 0.0f;
    float weight_decay = 0.0f;
    bool nesterov = false;

    // What a checkpoint keeps and a resumed run must share: every option
    // but lr, which schedules change.
    auto hyperparameters() const {
      return std::to_array<std::pair<const char*, float>>({{"momentum", momentum},
                                                           {"weight_decay", weight_decay},
                                                           {"nesterov", nesterov ? 1.0f : 0.0f}});
    }
  };

  // Per-model optimizer state: one velocity per parameter.
  template <class T>
  class State {
   public:
    State(Options options, std::size_t parameter_count)
        : options_(options), velocity_(options.momentum != 0.0f ? parameter_count : 0) {
      LOOM_CHECK(options.lr > 0.0f, "SGD: learning rate must be positive, got ", options.lr);
      LOOM_CHECK(options.momentum >= 0.0f && options.momentum < 1.0f,
                 "SGD: momentum must be in [0, 1), got ", options.momentum);
      LOOM_CHECK(options.weight_decay >= 0.0f, "SGD: weight decay must be >= 0, got ",
                 options.weight_decay);
      LOOM_CHECK(!options.nesterov || options.momentum > 0.0f,
                 "SGD: Nesterov momentum needs momentum > 0");
    }

    void step(std::span<T> weights, std::span<const T> grads) {
      LOOM_CHECK(weights.size() == grads.size(), "SGD::step: ", weights.size(), " weights but ",
                 grads.size(), " gradients");
      ++steps_;
      cpu::sgd_update<T>(weights.data(), grads.data(),
                         velocity_.empty() ? nullptr : velocity_.data(), weights.size(),
                         T(options_.lr), T(options_.momentum), T(options_.weight_decay),
                         options_.nesterov);
    }

    const Options& options() const { return options_; }

    // For learning-rate schedules (callbacks::MultiStepLR).
    // A schedule may reach 0 (a warm-up's first step, a cosine's end).
    void set_lr(float lr) {
      LOOM_CHECK(lr >= 0.0f, "SGD: learning rate must be >= 0, got ", lr);
      options_.lr = lr;
    }
    std::span<const T> velocity() const { return velocity_; }

    // What a checkpoint keeps: the velocity, when there is momentum
    // (PyTorch's name), and the step count.
    std::size_t buffer_count() const { return velocity_.empty() ? 0 : 1; }
    std::string_view buffer_name(std::size_t) const { return "momentum_buffer"; }
    std::span<T> buffer(std::size_t) { return velocity_; }
    std::span<const T> buffer(std::size_t) const { return velocity_; }
    std::uint64_t steps() const { return steps_; }
    void set_steps(std::uint64_t steps) { steps_ = steps; }

   private:
    Options options_;
    std::vector<T> velocity_;
    std::uint64_t steps_ = 0;
  };
};

}  // namespace loom
