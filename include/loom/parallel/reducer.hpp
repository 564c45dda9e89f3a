// Reducer: a rank's communication thread. The compute thread posts slices
// of its gradient buffer as backward finishes them; the thread sums each
// over the communicator (all-reduce), in the order posted, so the reduction
// of late layers runs while earlier layers are still back-propagating.
// DataParallel's replicas and Hybrid's stage copies each own one.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/stop_signals.hpp"

namespace loom::detail {

class Reducer {
 public:
  using Clock = std::chrono::steady_clock;

  // `tags`: how many gradient slices a step posts (each timed by its tag).
  Reducer(comm::Comm comm, std::size_t tags)
      : comm_(std::move(comm)),
        posted_at_(tags),
        begun_(tags),
        ended_(tags),
        thread_(start_quiet_thread("loom-reducer", [this] { run(); })) {}
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  ~Reducer() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  comm::Comm& comm() { return comm_; }

  // Sums `data` over the ranks, in place (tag: which slice, for timing).
  void post(std::span<float> data, std::size_t tag) {
    posted_at_[tag] = Clock::now();
    push({data, {}, tag});
  }
  // Sums bookkeeping (a step's loss and correct count), untimed.
  void post(std::span<double> data) { push({{}, data, 0}); }

  // Waits until everything posted is reduced; raises the first failure
  // (the rest of the step's items are skipped once one failed).
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return done_ == posted_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // When each tag was last posted, and when its all-reduce began and ended
  // (from the call, so a wait for slower ranks counts in it).
  const std::vector<Clock::time_point>& posted() const { return posted_at_; }
  const std::vector<Clock::time_point>& begun() const { return begun_; }
  const std::vector<Clock::time_point>& ended() const { return ended_; }

 private:
  struct Item {
    std::span<float> floats;
    std::span<double> doubles;
    std::size_t tag = 0;
  };

  void push(Item item) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(item);
      ++posted_;
    }
    changed_.notify_all();
  }

  void run() {
    for (;;) {
      Item item;
      bool skip = false;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = queue_.front();
        queue_.pop_front();
        skip = error_ != nullptr;
      }
      if (!skip) {
        try {
          if (!item.doubles.empty()) {
            comm_.all_reduce(item.doubles, comm::ReduceOp::sum);
          } else {
            begun_[item.tag] = Clock::now();
            comm_.all_reduce(item.floats, comm::ReduceOp::sum);
            ended_[item.tag] = Clock::now();
          }
        } catch (const std::exception& error) {
          comm_.cancel(error.what());
          std::lock_guard lock(mutex_);
          error_ = std::current_exception();
        }
      }
      {
        std::lock_guard lock(mutex_);
        ++done_;
      }
      changed_.notify_all();
    }
  }

  comm::Comm comm_;
  std::vector<Clock::time_point> posted_at_;  // written by the posting thread
  std::vector<Clock::time_point> begun_, ended_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Item> queue_;
  std::size_t posted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace loom::detail
