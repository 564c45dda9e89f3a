// Communicators: a group of ranks that reduce, broadcast and exchange slices
// of flat buffers. The `Communicator` concept is what policies are written
// against; `Comm` holds any communicator behind one type, so a Trainer can
// take an in-process, MPI or NCCL group alike.
//
// The calls: all_reduce (sum or average, in place), broadcast from a root,
// send/recv between a pair, barrier, split into subgroups, cancel, and the
// two halves of an all-reduce that sharded state needs: reduce_scatter
// (every rank gives size() * n elements and gets the reduction of its slice
// of n: rank r the r-th) and all_gather (every rank gives n elements and gets
// all ranks' n, rank r's at slice r). Their n must be the same on every rank;
// the input and output buffers must not overlap.
//
// Every call is collective over the group (send/recv: over the pair) and
// blocks until this rank's part is done. A failure is a loom::Error naming
// the operation and the rank; a rank that fails calls cancel() so that the
// others' pending calls raise instead of waiting forever (LocalComm; MPI
// jobs are ended by mpirun when a rank exits). A rank that never comes is
// given up after a timeout, by every communicator; before that, LocalComm
// and MpiComm name the ranks they wait for on std::cerr.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"

namespace loom::comm {

// How long a call of a communicator (LocalComm, MpiComm, NcclComm) waits for
// the other ranks before it declares them lost and raises.
using Timeout = std::chrono::duration<double>;

namespace detail {

// The seconds in environment variable `name`, or `fallback` when unset.
inline Timeout seconds_from_env(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return Timeout(fallback);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  LOOM_CHECK(*end == '\0' && seconds > 0.0 && seconds < 1e9, name, "='", text,
             "' is not a number of seconds: give one above 0 and below 1e9 (the default is ",
             fallback, ")");
  return Timeout(seconds);
}

}  // namespace detail

// LOOM_COLLECTIVE_TIMEOUT (seconds) or 600 s: generous, since a rank may
// legitimately be busy for minutes between two collectives (loading data,
// writing a checkpoint the others wait for).
inline Timeout collective_timeout() {
  return detail::seconds_from_env("LOOM_COLLECTIVE_TIMEOUT", 600.0);
}

// LOOM_COLLECTIVE_REPORT (seconds) or 30 s: a call that has waited this long
// for other ranks prints one line on std::cerr naming the ranks that have
// not arrived, then keeps waiting up to the timeout, which stays the limit.
// A value at or above the timeout means never.
inline Timeout collective_report_after() {
  return detail::seconds_from_env("LOOM_COLLECTIVE_REPORT", 30.0);
}

// Calls done() until it returns true (completed: returns true) or `timeout`
// has passed (returns false; `waited` says how long it was), and
// waiting(waited so far) after every poll that found it not done. Polling
// starts busy, as MPI's and CUDA's own blocking waits do, then sleeps ever
// longer (up to a millisecond) so that a long wait leaves the core to the
// ranks and threads still computing.
template <class Done, class Waiting>
bool wait_until(Timeout timeout, Done&& done, Timeout& waited, Waiting&& waiting) {
  using clock = std::chrono::steady_clock;
  const auto begun = clock::now();
  auto pause = std::chrono::microseconds(0);
  for (int busy_polls = 0;;) {
    if (done()) return true;
    waited = clock::now() - begun;
    if (waited > timeout) return false;
    waiting(waited);
    if (busy_polls < 1000) {
      ++busy_polls;
    } else {
      pause = std::min(std::chrono::microseconds(1000),
                       std::max(std::chrono::microseconds(10), pause * 2));
      std::this_thread::sleep_for(pause);
    }
  }
}
template <class Done>
bool wait_until(Timeout timeout, Done&& done, Timeout& waited) {
  return wait_until(timeout, std::forward<Done>(done), waited, [](Timeout) {});
}

namespace detail {

// "2, 5": ranks for a message.
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (const int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

// " for rank(s) 2, which have not arrived (rank 1 is waiting too)": whom a
// collective waits for, given the ranks not in it (each with a note, maybe
// empty) and the other ranks in it.
inline std::string awaiting_ranks(const std::vector<std::pair<int, std::string>>& missing,
                                  const std::vector<int>& waiting) {
  std::string text;
  if (missing.empty()) {
    text = ", though every other rank has arrived";
  } else {
    text = " for rank(s) ";
    for (std::size_t i = 0; i < missing.size(); ++i)
      text += (i == 0 ? "" : ", ") + std::to_string(missing[i].first) + missing[i].second;
    text += ", which have not arrived";
  }
  if (!waiting.empty() && !missing.empty())
    text += waiting.size() == 1 ? " (rank " + rank_list(waiting) + " is waiting too)"
                                : " (ranks " + rank_list(waiting) + " are waiting too)";
  return text;
}

// The one line a wait prints once it has waited collective_report_after():
// "loom: rank 0 of 3 has waited 30.0 s in <call><whom>; the timeout is 600 s
// (LOOM_COLLECTIVE_TIMEOUT)".
inline std::string late_line(int rank, int size, Timeout waited, const std::string& call,
                             const std::string& whom, Timeout timeout) {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", waited.count());
  std::ostringstream line;
  line << "loom: rank " << rank << " of " << size << " has waited " << seconds << " s in " << call
       << whom << "; the timeout is " << timeout.count() << " s (LOOM_COLLECTIVE_TIMEOUT)\n";
  return line.str();
}

}  // namespace detail

enum class ReduceOp { sum, average };

inline const char* op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "average"; }

// The element types collectives carry: gradients (float, double) and
// bookkeeping (loss sums, counts, hashes).
template <class T>
concept Element = std::same_as<T, float> || std::same_as<T, double> ||
                  std::same_as<T, std::uint64_t> || std::same_as<T, std::int32_t>;

template <class C>
concept Communicator =
    requires(C& c, const C& cc, std::span<float> f, std::span<double> d,
             std::span<std::uint64_t> u, ReduceOp op, int peer, const std::string& why) {
      { cc.rank() } -> std::convertible_to<int>;
      { cc.size() } -> std::convertible_to<int>;
      c.all_reduce(f, op);
      c.all_reduce(d, op);
      c.all_reduce(u, op);
      c.reduce_scatter(std::span<const float>(f), f, op);
      c.reduce_scatter(std::span<const double>(d), d, op);
      c.all_gather(std::span<const float>(f), f);
      c.all_gather(std::span<const double>(d), d);
      c.broadcast(f, peer);
      c.broadcast(u, peer);
      c.send(std::span<const float>(f), peer);
      c.recv(f, peer);
      c.barrier();
      { c.split(peer, peer) } -> std::same_as<C>;
      c.cancel(why);
      { cc.describe() } -> std::convertible_to<std::string>;
    };

template <class T>
constexpr const char* element_name() {
  if constexpr (std::same_as<T, float>)
    return "float";
  else if constexpr (std::same_as<T, double>)
    return "double";
  else if constexpr (std::same_as<T, std::uint64_t>)
    return "uint64";
  else if constexpr (std::same_as<T, std::int32_t>)
    return "int32";
  else
    return "none";
}

// Any Communicator behind one type (shared: copies refer to the same group).
class Comm {
 public:
  Comm() = default;
  template <Communicator C>
    requires(!std::same_as<std::remove_cvref_t<C>, Comm>)
  explicit Comm(C communicator)
      : self_(std::make_shared<Model<C>>(std::move(communicator))) {}

  explicit operator bool() const { return self_ != nullptr; }
  int rank() const { return self_->rank(); }
  int size() const { return self_->size(); }
  std::string describe() const { return self_->describe(); }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    if constexpr (std::same_as<T, float>)
      self_->all_reduce_f(data, op);
    else if constexpr (std::same_as<T, double>)
      self_->all_reduce_d(data, op);
    else if constexpr (std::same_as<T, std::uint64_t>)
      self_->all_reduce_u(data, op);
    else
      static_assert(std::same_as<T, float>, "Comm::all_reduce: float, double or uint64_t");
  }
  // Rank r gets in `out` (n elements) the reduction of every rank's slice r
  // of `data` (size() * n elements).
  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    static_assert(carried<T>, "Comm::reduce_scatter: float, double or uint64_t");
    self_->reduce_scatter(data, out, op);
  }
  // Every rank gets in `all` (size() * n elements) rank r's `mine` (n) at
  // slice r.
  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    static_assert(carried<T>, "Comm::all_gather: float, double or uint64_t");
    self_->all_gather(mine, all);
  }
  void broadcast(std::span<float> data, int root) { self_->broadcast_f(data, root); }
  void broadcast(std::span<std::uint64_t> data, int root) { self_->broadcast_u(data, root); }
  void send(std::span<const float> data, int peer) { self_->send(data, peer); }
  void recv(std::span<float> data, int peer) { self_->recv(data, peer); }
  void barrier() { self_->barrier(); }
  Comm split(int color, int key) { return Comm(self_->split(color, key)); }
  void cancel(const std::string& why) { self_->cancel(why); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string describe() const = 0;
    virtual void all_reduce_f(std::span<float>, ReduceOp) = 0;
    virtual void all_reduce_d(std::span<double>, ReduceOp) = 0;
    virtual void all_reduce_u(std::span<std::uint64_t>, ReduceOp) = 0;
    // Overloads rather than a name per type: the templates above pick by
    // the span's type without a branch per call.
    virtual void reduce_scatter(std::span<const float>, std::span<float>, ReduceOp) = 0;
    virtual void reduce_scatter(std::span<const double>, std::span<double>, ReduceOp) = 0;
    virtual void reduce_scatter(std::span<const std::uint64_t>, std::span<std::uint64_t>,
                                ReduceOp) = 0;
    virtual void all_gather(std::span<const float>, std::span<float>) = 0;
    virtual void all_gather(std::span<const double>, std::span<double>) = 0;
    virtual void all_gather(std::span<const std::uint64_t>, std::span<std::uint64_t>) = 0;
    virtual void broadcast_f(std::span<float>, int) = 0;
    virtual void broadcast_u(std::span<std::uint64_t>, int) = 0;
    virtual void send(std::span<const float>, int) = 0;
    virtual void recv(std::span<float>, int) = 0;
    virtual void barrier() = 0;
    virtual std::shared_ptr<Concept> split(int, int) = 0;
    virtual void cancel(const std::string&) = 0;
  };

  template <class C>
  struct Model final : Concept {
    explicit Model(C c) : comm(std::move(c)) {}
    int rank() const override { return comm.rank(); }
    int size() const override { return comm.size(); }
    std::string describe() const override { return comm.describe(); }
    void all_reduce_f(std::span<float> d, ReduceOp op) override { comm.all_reduce(d, op); }
    void all_reduce_d(std::span<double> d, ReduceOp op) override { comm.all_reduce(d, op); }
    void all_reduce_u(std::span<std::uint64_t> d, ReduceOp op) override {
      comm.all_reduce(d, op);
    }
    void reduce_scatter(std::span<const float> d, std::span<float> out, ReduceOp op) override {
      comm.reduce_scatter(d, out, op);
    }
    void reduce_scatter(std::span<const double> d, std::span<double> out, ReduceOp op) override {
      comm.reduce_scatter(d, out, op);
    }
    void reduce_scatter(std::span<const std::uint64_t> d, std::span<std::uint64_t> out,
                        ReduceOp op) override {
      comm.reduce_scatter(d, out, op);
    }
    void all_gather(std::span<const float> d, std::span<float> all) override {
      comm.all_gather(d, all);
    }
    void all_gather(std::span<const double> d, std::span<double> all) override {
      comm.all_gather(d, all);
    }
    void all_gather(std::span<const std::uint64_t> d, std::span<std::uint64_t> all) override {
      comm.all_gather(d, all);
    }
    void broadcast_f(std::span<float> d, int root) override { comm.broadcast(d, root); }
    void broadcast_u(std::span<std::uint64_t> d, int root) override { comm.broadcast(d, root); }
    void send(std::span<const float> d, int peer) override { comm.send(d, peer); }
    void recv(std::span<float> d, int peer) override { comm.recv(d, peer); }
    void barrier() override { comm.barrier(); }
    std::shared_ptr<Concept> split(int color, int key) override {
      return std::make_shared<Model<C>>(comm.split(color, key));
    }
    void cancel(const std::string& why) override { comm.cancel(why); }
    C comm;
  };

  explicit Comm(std::shared_ptr<Concept> self) : self_(std::move(self)) {}

  // The element types Comm forwards (as all_reduce does): not int32.
  template <class T>
  static constexpr bool carried =
      std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::uint64_t>;

  std::shared_ptr<Concept> self_;
};

// Every rank's `mine` (all of one size), rank r's as row r, on every rank:
// each rank fills its own row of zeros and one sum gathers them (a single
// non-zero term a slot: exact). For small agreements, not for tensors.
inline std::vector<double> gather_rows(Comm& c, std::span<const double> mine) {
  std::vector<double> all(static_cast<std::size_t>(c.size()) * mine.size(), 0.0);
  std::copy(mine.begin(), mine.end(),
            all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(c.rank()) *
                                                      mine.size()));
  c.all_reduce(std::span<double>(all), ReduceOp::sum);
  return all;
}

}  // namespace loom::comm
