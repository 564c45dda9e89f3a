// callbacks::StopOnSignal: SIGINT (Ctrl-C), SIGTERM (sent by Slurm,
// Kubernetes and mpirun before they kill a job) and SIGUSR1 (Slurm's
// --signal=USR1@T warning) end a fit cleanly, at the end of an optimizer
// step, on every process at the same step; a Checkpoint callback given to
// the same fit then saves, and the program may leave with exit_status().
//
// Opt-in: loom installs no handler of its own. While a StopOnSignal lives,
// its handler only records the first signal; a second one ends the program
// at once, as the signal would have without a handler. Each process
// compares the record with the others after every step, at the fit's
// start and at every epoch's end (one small collective), so a signal that
// reached one process only stops them all at the same step and none is
// left waiting in a collective for the others.
#pragma once

#include <signal.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <sstream>

#include "../core/error.hpp"
#include "../core/stop_signals.hpp"
#include "trainer_core.hpp"

namespace loom {
namespace detail {

// The first signal a StopOnSignal's handler took (0: none yet), and
// whether one is installed (one at a time: the handlers are the process's).
inline std::atomic<int> stop_signal_received{0};
inline std::atomic<bool> stop_signal_installed{false};
static_assert(std::atomic<int>::is_always_lock_free,
              "a signal handler may only touch lock-free atomics");

inline void on_stop_signal(int signal) {
  int none = 0;
  if (stop_signal_received.compare_exchange_strong(none, signal)) return;
  // The second: the signal's own action (sigaction and raise are
  // async-signal-safe), which ends the process as if no handler were there.
  struct sigaction plain {};
  plain.sa_handler = SIG_DFL;
  sigemptyset(&plain.sa_mask);
  ::sigaction(signal, &plain, nullptr);
  ::raise(signal);
}

}  // namespace detail

namespace callbacks {

class StopOnSignal {
 public:
  struct Options {
    // A line when the processes agree to stop (give rank 0's console).
    std::ostream* out = nullptr;
  };

  StopOnSignal() : StopOnSignal(Options{}) {}
  // Installs the handler for SIGINT, SIGTERM and SIGUSR1 (the ones it
  // replaces come back when it is destroyed). Make it early: a signal
  // during start-up (reading the data, loading a checkpoint) then stops
  // the fit before its first step.
  explicit StopOnSignal(Options options) : options_(options) {
    LOOM_CHECK(!loom::detail::stop_signal_installed.exchange(true),
               "callbacks::StopOnSignal: another "
               "one is alive; a process has one set of signal handlers: share that one");
    loom::detail::stop_signal_received.store(0);
    struct sigaction action {};
    action.sa_handler = loom::detail::on_stop_signal;
    sigemptyset(&action.sa_mask);
    // System calls the signal interrupts (reading a file, waiting) go on.
    action.sa_flags = SA_RESTART;
    for (std::size_t k = 0; k < stop_signals.size(); ++k) {
      if (sigaction(stop_signals[k], &action, &replaced_[k]) != 0) {
        for (std::size_t j = 0; j < k; ++j) sigaction(stop_signals[j], &replaced_[j], nullptr);
        loom::detail::stop_signal_installed.store(false);
        LOOM_FAIL("callbacks::StopOnSignal: sigaction(", signal_name(stop_signals[k]),
                  ") failed: ", std::strerror(errno));
      }
    }
  }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  ~StopOnSignal() {
    for (std::size_t k = 0; k < stop_signals.size(); ++k)
      sigaction(stop_signals[k], &replaced_[k], nullptr);
    loom::detail::stop_signal_installed.store(false);
  }

  // The signal this process received (0: none), from any thread, at any time.
  int received() const { return loom::detail::stop_signal_received.load(); }
  // The signal the processes stopped on (0: none stopped them): the
  // largest number any of them received.
  int stopped_by() const { return stopped_by_; }
  // What a shell reports for a program the signal ended, 128 + its
  // number (130 for SIGINT, 143 for SIGTERM); 0 when no signal stopped the fit.
  int exit_status() const { return stopped_by_ != 0 ? 128 + stopped_by_ : 0; }
  // The trainer's optimizer steps when the processes agreed to stop.
  std::uint64_t stopped_after_step() const { return stopped_after_; }

  // A signal during start-up: the fit ends before its first step.
  template <class T>
  void on_fit_begin(const FitInfo&, T& trainer) {
    agree(trainer, true);
  }
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    agree(trainer, false);
  }
  // After the epoch's evaluation when listed after callbacks::Evaluate: a
  // signal during it stops the fit before another step.
  template <class T>
  void on_epoch_end(const EpochInfo&, T& trainer) {
    agree(trainer, false);
  }

 private:
  // Collective: every process calls it at the same hooks. Once they agreed
  // they skip it alike.
  template <class T>
  void agree(T& trainer, bool before_first_step) {
    if (stopped_by_ == 0) {
      stopped_by_ = static_cast<int>(trainer.max_over_processes(received()));
      if (stopped_by_ != 0) {
        stopped_after_ = trainer.steps();
        if (options_.out != nullptr) {
          std::ostringstream text;
          text << signal_name(stopped_by_) << ": stopping ";
          if (before_first_step)
            text << "before the fit's first step";
          else
            text << "after step " << stopped_after_;
          text << (trainer.process_count() > 1 ? " on every process" : "")
               << "; a second signal ends the program at once\n";
          *options_.out << text.str();
          options_.out->flush();
        }
      }
    }
    if (stopped_by_ != 0) trainer.stop();
  }

  Options options_;
  std::array<struct sigaction, stop_signals.size()> replaced_{};
  int stopped_by_ = 0;
  std::uint64_t stopped_after_ = 0;
};

}  // namespace callbacks
}  // namespace loom
