// Callbacks for Trainer::fit. A callback implements any of on_fit_begin(FitInfo),
// on_step(StepInfo), on_epoch_end(EpochInfo[, Trainer&]); the trainer calls
// the ones that exist, in the order the callbacks were given.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "../data/data.hpp"
#include "trainer.hpp"

namespace loom::callbacks {

namespace detail {

inline std::string clock(double seconds) {
  const long s = seconds < 0 ? 0 : static_cast<long>(seconds + 0.5);
  std::ostringstream out;
  out << s / 60 << ':' << std::setw(2) << std::setfill('0') << s % 60;
  return out.str();
}

}  // namespace detail

// Progress: on a terminal, one bar per epoch redrawn in place; otherwise
// (logs, CI) plain lines, about `lines_per_epoch` per epoch.
class Progress {
 public:
  // automatic: the bar when `out` is std::cout and stdout is a terminal.
  enum class Style { automatic, bar, lines };

  struct Options {
    std::ostream* out = &std::cout;
    Style style = Style::automatic;
    int lines_per_epoch = 10;
    int bar_width = 24;
  };

  Progress() : Progress(Options{}) {}
  explicit Progress(Options options)
      : options_(options),
        terminal_(options.style == Style::bar ||
                  (options.style == Style::automatic && options.out == &std::cout &&
                   ::isatty(STDOUT_FILENO) == 1)) {}

  void on_fit_begin(const FitInfo& info) {
    *options_.out << "training: " << info.samples_per_epoch << " samples, " << info.epochs
                  << " epoch(s) of " << info.steps_per_epoch << " steps, batch " << info.batch_size
                  << '\n';
    if (info.placement.size() > 1)
      *options_.out << "placement (" << info.policy << "):\n" << describe_placement(info.placement);
    options_.out->flush();
  }

  void on_step(const StepInfo& step) {
    const auto now = std::chrono::steady_clock::now();
    const std::size_t every = std::max<std::size_t>(
        1, step.steps / static_cast<std::size_t>(std::max(1, options_.lines_per_epoch)));
    const bool last = step.step == step.steps;
    if (terminal_) {
      // Redraws cost a terminal write; ten a second reads as smooth.
      if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      *options_.out << '\r' << line(step, true) << "\x1b[K";
      if (last) *options_.out << '\n';
      options_.out->flush();
    } else if (step.step % every == 0 || last) {
      *options_.out << line(step, false) << '\n';
      options_.out->flush();
    }
  }

  void on_epoch_end(const EpochInfo& epoch) {
    // Formatted apart, so the caller's stream keeps its own precision flags.
    std::ostringstream text;
    text << "epoch " << epoch.epoch << '/' << epoch.epochs << " done: loss " << std::fixed
         << std::setprecision(4) << epoch.loss << ", accuracy " << std::setprecision(2)
         << 100.0 * epoch.accuracy << "%, " << std::setprecision(0)
         << rate(epoch.samples, epoch.seconds) << " samples/s, " << std::setprecision(1)
         << epoch.seconds << " s\n";
    *options_.out << text.str();
    options_.out->flush();
  }

 private:
  static double rate(std::size_t samples, double seconds) {
    return seconds > 0 ? static_cast<double>(samples) / seconds : 0.0;
  }

  std::string line(const StepInfo& step, bool bar) const {
    std::ostringstream out;
    out << "epoch " << step.epoch << '/' << step.epochs << ' ';
    if (bar) {
      const auto filled =
          static_cast<int>(options_.bar_width * step.step / std::max<std::size_t>(1, step.steps));
      out << '[' << std::string(static_cast<std::size_t>(filled), '=')
          << std::string(static_cast<std::size_t>(options_.bar_width - filled), ' ') << "] ";
    }
    const double per_step = step.step ? step.seconds / static_cast<double>(step.step) : 0.0;
    const double eta = per_step * static_cast<double>(step.steps - step.step);
    out << "step " << step.step << '/' << step.steps << " loss " << std::fixed
        << std::setprecision(4) << step.loss << " acc " << std::setprecision(2)
        << 100.0 * step.accuracy << "% " << std::setprecision(0) << rate(step.samples, step.seconds)
        << " samples/s ETA " << detail::clock(eta);
    return out.str();
  }

  Options options_;
  bool terminal_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

// Evaluate: measures a held-out dataset at the end of every epoch and keeps
// the results (`last`, `history`) for the caller.
class Evaluate {
 public:
  explicit Evaluate(const data::Dataset& dataset, std::ostream* out = &std::cout)
      : dataset_(&dataset), out_(out) {}
  // The callback keeps a pointer: a temporary dataset would be gone by then.
  Evaluate(const data::Dataset&&, std::ostream* = &std::cout) = delete;

  template <class TrainerT>
  void on_epoch_end(const EpochInfo& epoch, TrainerT& trainer) {
    last = trainer.evaluate(*dataset_);
    history.push_back(last);
    if (out_ != nullptr) {
      std::ostringstream text;
      text << "epoch " << epoch.epoch << '/' << epoch.epochs << ' ' << dataset_->name << ": loss "
           << std::fixed << std::setprecision(4) << last.loss << ", accuracy "
           << std::setprecision(2) << 100.0 * last.accuracy << "%\n";
      *out_ << text.str();
      out_->flush();
    }
  }

  EvalResult last{};
  std::vector<EvalResult> history;

 private:
  const data::Dataset* dataset_;
  std::ostream* out_;
};

// MultiStepLR: multiplies the learning rate by `factor` after each epoch
// listed in `milestones` (PyTorch's MultiStepLR). A constant rate leaves the
// last epochs' test accuracy swinging by about 1 %; a late drop settles it.
struct MultiStepLR {
  std::vector<int> milestones;
  float factor = 0.1f;
  std::ostream* out = &std::cout;

  template <class TrainerT>
  void on_epoch_end(const EpochInfo& epoch, TrainerT& trainer) {
    if (std::find(milestones.begin(), milestones.end(), epoch.epoch) == milestones.end()) return;
    auto& optimizer = trainer.optimizer();
    optimizer.set_lr(optimizer.options().lr * factor);
    if (out != nullptr && epoch.epoch < epoch.epochs) {
      std::ostringstream text;
      text << "learning rate " << optimizer.options().lr << " from epoch " << epoch.epoch + 1
           << '\n';
      *out << text.str();
      out->flush();
    }
  }
};

}  // namespace loom::callbacks
