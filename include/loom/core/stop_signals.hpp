// The signals a program may turn into a clean stop (callbacks::StopOnSignal):
// SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and mpirun send before
// they kill) and SIGUSR1 (Slurm's --signal=USR1@T early warning). The
// threads loom starts (the Loader's prefetch thread, CPU worker devices,
// their gradient reducers, a pipeline's send thread) block them from birth,
// so the kernel hands such a signal to a thread of the program's own, and
// a handler never runs between a worker's steps.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <array>
#include <string>
#include <thread>
#include <utility>

#include "error.hpp"

namespace loom {

inline constexpr std::array<int, 3> stop_signals{SIGINT, SIGTERM, SIGUSR1};

// "SIGINT", "SIGTERM", "SIGUSR1", else "signal N".
inline std::string signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "signal " + std::to_string(signal);
  }
}

namespace detail {

// Starts a thread with the stop signals blocked (set while the thread is
// made, so there is no moment at which it could take one), named `name`
// for debuggers, top and /proc (at most 15 characters).
template <class F>
std::thread start_quiet_thread(const char* name, F&& body) {
  sigset_t blocked, before;
  sigemptyset(&blocked);
  for (const int s : stop_signals) sigaddset(&blocked, s);
  const int masked = pthread_sigmask(SIG_BLOCK, &blocked, &before);
  LOOM_CHECK(masked == 0, "pthread_sigmask failed (error ", masked, ") starting thread ", name);
  std::thread thread;
  try {
    thread = std::thread(std::forward<F>(body));
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &before, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  // A name is for people only: a failure to set it changes nothing.
  pthread_setname_np(thread.native_handle(), name);
  return thread;
}

}  // namespace detail
}  // namespace loom
