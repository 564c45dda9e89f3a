// AnyOptimizer: SGD, Adam or AdamW chosen at run time. A program that
// offers each (the examples' --optimizer) builds one trainer per policy,
// Trainer<Net, Policy, AnyOptimizer>, instead of one per optimizer: an
// update is one call per step, so choosing it at run time costs nothing
// measurable, where a type per optimizer doubles what is compiled.
//
// Its state runs the chosen optimizer's state; its name, options, buffers
// and step count are the chosen one's, so checkpoints cross freely between
// Trainer<Net, Policy, AdamW> and a trainer that chose AdamW.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "adam.hpp"
#include "sgd.hpp"

namespace loom {

struct AnyOptimizer {
  static constexpr const char* name = "AnyOptimizer";
  static constexpr std::size_t buffers_per_parameter = 2;  // the most of the three (Adam's)

  struct Options {
    Options() = default;
    // Implicit: a trainer of AnyOptimizer takes any of the three's options.
    Options(SGD::Options o) : lr(o.lr), chosen_(o) {}    // NOLINT(google-explicit-constructor)
    Options(Adam::Options o) : lr(o.lr), chosen_(o) {}   // NOLINT(google-explicit-constructor)
    Options(AdamW::Options o) : lr(o.lr), chosen_(o) {}  // NOLINT(google-explicit-constructor)

    // The learning rate: this one counts (schedules change it), the
    // chosen options' own follows it.
    float lr = SGD::Options{}.lr;

    using Chosen = std::variant<SGD::Options, Adam::Options, AdamW::Options>;
    // The chosen optimizer's options, at `lr`. Read-only: a new choice is
    // a new Options (options = AdamW::Options{...}), so lr cannot go stale.
    Chosen chosen() const {
      Chosen at_lr = chosen_;
      std::visit([&](auto& o) { o.lr = lr; }, at_lr);
      return at_lr;
    }
    const char* optimizer() const {
      constexpr const char* names[] = {SGD::name, Adam::name, AdamW::name};  // Chosen's order
      return names[chosen_.index()];
    }
    // The chosen one's (every option but lr).
    std::vector<std::pair<const char*, float>> hyperparameters() const {
      return std::visit(
          [](const auto& o) {
            const auto all = o.hyperparameters();
            return std::vector<std::pair<const char*, float>>(all.begin(), all.end());
          },
          chosen_);
    }

   private:
    Chosen chosen_;
  };

  template <class T>
  class State {
   public:
    State(Options options, std::size_t parameter_count)
        : options_(options), state_(make(options_, parameter_count)) {}

    void step(std::span<T> weights, std::span<const T> grads) {
      std::visit([&](auto& s) { s.step(weights, grads); }, state_);
    }

    const Options& options() const { return options_; }
    const char* optimizer() const { return options_.optimizer(); }
    void set_lr(float lr) {
      std::visit([&](auto& s) { s.set_lr(lr); }, state_);
      options_.lr = lr;
    }

    std::size_t buffer_count() const {
      return std::visit([](const auto& s) { return s.buffer_count(); }, state_);
    }
    std::string_view buffer_name(std::size_t i) const {
      return std::visit([&](const auto& s) { return s.buffer_name(i); }, state_);
    }
    std::span<T> buffer(std::size_t i) {
      return std::visit([&](auto& s) { return s.buffer(i); }, state_);
    }
    std::span<const T> buffer(std::size_t i) const {
      return std::visit([&](const auto& s) { return s.buffer(i); }, state_);
    }
    std::uint64_t steps() const {
      return std::visit([](const auto& s) { return s.steps(); }, state_);
    }
    void set_steps(std::uint64_t steps) {
      std::visit([&](auto& s) { s.set_steps(steps); }, state_);
    }

   private:
    using Chosen = std::variant<SGD::State<T>, Adam::State<T>, AdamW::State<T>>;
    static Chosen make(const Options& options, std::size_t parameter_count) {
      return std::visit(
          [&](const auto& o) -> Chosen {
            using O = std::decay_t<decltype(o)>;
            if constexpr (std::is_same_v<O, SGD::Options>)
              return SGD::State<T>(o, parameter_count);
            else if constexpr (std::is_same_v<O, Adam::Options>)
              return Adam::State<T>(o, parameter_count);
            else
              return AdamW::State<T>(o, parameter_count);
          },
          options.chosen());
    }

    Options options_;
    Chosen state_;
  };
};

namespace detail {

// The name a checkpoint and the processes' agreement record: the chosen
// optimizer's for AnyOptimizer, else the type's.
template <class Optimizer, class State>
const char* optimizer_name(const State& state) {
  if constexpr (std::is_same_v<Optimizer, AnyOptimizer>)
    return state.optimizer();
  else
    return Optimizer::name;
}

}  // namespace detail
}  // namespace loom
