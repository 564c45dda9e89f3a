// How fit() calls its callbacks: each hook a callback defines, with the
// trainer or without, and all of one fit's callbacks behind
// detail::FitEvents, so that the fit loop itself is no template.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>

#include "agreement.hpp"
#include "trainer_core.hpp"

namespace loom::detail {

// The callbacks of one fit() of trainer T.
template <class T, class... Callbacks>
class CallbackEvents final : public FitEvents {
 public:
  explicit CallbackEvents(T& trainer, Callbacks&... callbacks)
      : trainer_(trainer), callbacks_(callbacks...) {}

  void fit_prepare(const FitInfo& info, Fingerprint& fingerprint) override {
    each([&](auto& c) {
      if constexpr (requires { c.on_fit_prepare(info, fingerprint, trainer_); })
        c.on_fit_prepare(info, fingerprint, trainer_);
      else if constexpr (requires { c.on_fit_prepare(info, fingerprint); })
        c.on_fit_prepare(info, fingerprint);
    });
  }
  void fit_end() override {
    each([&](auto& c) {
      if constexpr (requires { c.on_fit_end(trainer_); })
        c.on_fit_end(trainer_);
      else if constexpr (requires { c.on_fit_end(); })
        c.on_fit_end();
    });
  }
  void fit_begin(const FitInfo& info) override {
    each([&](auto& c) {
      if constexpr (requires { c.on_fit_begin(info, trainer_); })
        c.on_fit_begin(info, trainer_);
      else if constexpr (requires { c.on_fit_begin(info); })
        c.on_fit_begin(info);
    });
  }
  void step_begin(const StepBegin& info) override {
    each([&](auto& c) {
      if constexpr (requires { c.on_step_begin(info, trainer_); })
        c.on_step_begin(info, trainer_);
      else if constexpr (requires { c.on_step_begin(info); })
        c.on_step_begin(info);
    });
  }
  void step(const StepInfo& info) override {
    each([&](auto& c) {
      if constexpr (requires { c.on_step(info, trainer_); })
        c.on_step(info, trainer_);
      else if constexpr (requires { c.on_step(info); })
        c.on_step(info);
    });
  }
  void epoch_end(const EpochInfo& info) override {
    each([&](auto& c) {
      if constexpr (requires { c.on_epoch_end(info, trainer_); })
        c.on_epoch_end(info, trainer_);
      else if constexpr (requires { c.on_epoch_end(info); })
        c.on_epoch_end(info);
    });
  }
  // Whether a callback's on_step after optimizer step `steps` reads or
  // saves the trainer's state: a GPU must then not have begun the next step.
  bool needs_state_at_step(std::uint64_t steps) override {
    bool needs = false;
    each([&](auto& c) {
      if constexpr (requires { std::as_const(c).needs_state_at_step(steps); })
        needs = needs || std::as_const(c).needs_state_at_step(steps);
    });
    return needs;
  }

 private:
  template <class F>
  void each(F&& f) {
    std::apply([&](auto&... c) { (f(c), ...); }, callbacks_);
  }
  T& trainer_;
  std::tuple<Callbacks&...> callbacks_;
};

}  // namespace loom::detail
