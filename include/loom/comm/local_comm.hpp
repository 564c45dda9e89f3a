// LocalComm: ranks that are threads of one process (CPU worker devices).
// Collectives meet at a barrier, then work on each other's buffers in place:
// in all_reduce, rank r reduces the r-th slice of every rank's buffer in rank
// order 0, 1, ..., n-1 and writes the result back to all of them, so the
// result is the same bits on every rank and in every run, whatever the
// threads' timing. reduce_scatter is the same sum, each rank reducing its
// own slice into its `out`; in all_gather each rank copies every rank's
// `mine` into its own `all`. A second barrier ends the call, after which no
// rank's buffer is touched by another.
//
// A call that waits longer than the group's timeout (LOOM_COLLECTIVE_TIMEOUT,
// as between processes) for ranks that never come raises a loom::Error that
// names them, and aborts the group so that the others raise too: a rank
// thread that returned early or made fewer calls ends the run, not hangs it.
// Before that, a call that has waited the group's report time
// (LOOM_COLLECTIVE_REPORT, 30 s) prints once on std::cerr whom it waits for.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "communicator.hpp"

namespace loom::comm {

namespace detail {

// What the ranks of a LocalComm share.
class LocalGroup {
 public:
  LocalGroup(int size, Timeout timeout, Timeout report_after)
      : size_(size),
        timeout_(timeout),
        report_after_(report_after),
        slots_(static_cast<std::size_t>(size)),
        present_(static_cast<std::size_t>(size), false) {}

  struct Slot {
    void* data = nullptr;
    std::size_t count = 0;
    const char* type = "none";  // element_name<T>()
    const char* op = nullptr;
    int root = 0;   // broadcast root, or split color
    int key = 0;    // split key
    // reduce_scatter's and all_gather's n, the elements of one rank's slice
    // (then `count` is the whole buffer's size() * n, and `data` what the
    // other ranks read: reduce_scatter's data, all_gather's mine).
    std::size_t part = 0;
  };

  int size() const { return size_; }
  Timeout timeout() const { return timeout_; }
  Timeout report_after() const { return report_after_; }

  // Publishes this rank's slot and waits until every rank has published its
  // own for the same operation; returns all slots.
  const std::vector<Slot>& meet(int rank, const Slot& mine) {
    {
      std::lock_guard lock(mutex_);
      slots_[static_cast<std::size_t>(rank)] = mine;
    }
    wait_all(rank, mine.op);
    for (int r = 0; r < size_; ++r) {
      const Slot& other = slots_[static_cast<std::size_t>(r)];
      LOOM_CHECK(std::strcmp(other.op, mine.op) == 0, "LocalComm ", mine.op, " on rank ", rank,
                 " of ", size_, ": rank ", r, " called ", other.op,
                 " at the same time; every rank must make the same calls in the same order");
    }
    return slots_;
  }

  // A barrier; raises if a rank aborted the group.
  void wait_all(int rank, const char* op) {
    std::unique_lock lock(mutex_);
    throw_if_aborted(rank, op);
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      present_.assign(present_.size(), false);
      ++generation_;
      changed_.notify_all();
      return;
    }
    present_[static_cast<std::size_t>(rank)] = true;
    const auto missing = [&] {
      std::vector<int> ranks;
      for (int r = 0; r < size_; ++r)
        if (!present_[static_cast<std::size_t>(r)]) ranks.push_back(r);
      return ranks;
    };
    const auto awaiting = [&] {
      std::vector<std::pair<int, std::string>> absent;
      for (const int r : missing()) absent.emplace_back(r, "");
      std::vector<int> waiting;
      for (int r = 0; r < size_; ++r)
        if (r != rank && present_[static_cast<std::size_t>(r)]) waiting.push_back(r);
      return awaiting_ranks(absent, waiting);
    };
    if (!wait(lock, rank, op, [&] { return generation_ != generation || aborted_; }, awaiting))
      time_out(rank, op, "rank(s) " + rank_list(missing()));
    if (generation_ == generation) throw_if_aborted(rank, op);
  }

  // Point to point, buffered: the sender's data is copied into the pair's
  // queue and the call returns (like a small MPI_Send), so ranks that send
  // to each other at the same time do not wait for each other. The
  // receiver takes messages in the order sent. Buffers are reused.
  void send(int from, int to, const void* data, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    throw_if_aborted(from, "send");
    Pair& pair = pairs_[{from, to}];
    std::vector<unsigned char> message;
    if (!pair.spare.empty()) {
      message = std::move(pair.spare.back());
      pair.spare.pop_back();
    }
    message.resize(bytes);
    if (bytes > 0) std::memcpy(message.data(), data, bytes);
    pair.queue.push_back(std::move(message));
    changed_.notify_all();
  }
  void recv(int to, int from, void* data, std::size_t bytes) {
    std::unique_lock lock(mutex_);
    Pair& pair = pairs_[{from, to}];
    const auto message_of = [&] { return "rank " + std::to_string(from) + "'s message"; };
    if (!wait(lock, to, "recv", [&] { return !pair.queue.empty() || aborted_; },
              [&] { return " for " + message_of(); }))
      time_out(to, "recv", message_of());
    throw_if_aborted(to, "recv");
    auto& message = pair.queue.front();
    if (message.size() != bytes) {
      aborted_ = true;
      abort_message_ = "rank " + std::to_string(from) + " sent " +
                       std::to_string(message.size()) + " bytes to rank " + std::to_string(to) +
                       ", which expected " + std::to_string(bytes);
      changed_.notify_all();
      throw_if_aborted(to, "recv");
    }
    if (bytes > 0) std::memcpy(data, message.data(), bytes);
    pair.spare.push_back(std::move(message));
    pair.queue.pop_front();
  }

  void cancel(int rank, const std::string& why) {
    std::lock_guard lock(mutex_);
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = "rank " + std::to_string(rank) + " aborted the group: " + why;
    }
    changed_.notify_all();
  }

  // The group a split makes for `color`, made by its first member.
  std::shared_ptr<LocalGroup> split_group(std::uint64_t split, int color, int members) {
    std::lock_guard lock(mutex_);
    auto& group = splits_[{split, color}];
    if (!group) group = std::make_shared<LocalGroup>(members, timeout_, report_after_);
    return group;
  }
  std::uint64_t generation() {
    std::lock_guard lock(mutex_);
    return generation_;
  }

 private:
  struct Pair {
    std::deque<std::vector<unsigned char>> queue;  // sent, not yet received
    std::vector<std::vector<unsigned char>> spare;
  };

  // With the lock held: waits until ready() (returns true) or the timeout
  // (false). Past report_after_ it prints once, still holding the lock so
  // that the group's lines do not interleave, whom it waits for (whom()).
  template <class Ready, class Whom>
  bool wait(std::unique_lock<std::mutex>& lock, int rank, const char* op, Ready ready,
            Whom whom) {
    if (report_after_ >= timeout_) return changed_.wait_for(lock, timeout_, ready);
    const auto begun = std::chrono::steady_clock::now();
    if (changed_.wait_for(lock, report_after_, ready)) return true;
    const Timeout waited = std::chrono::steady_clock::now() - begun;
    std::cerr << late_line(rank, size_, waited, std::string("LocalComm ") + op, whom(), timeout_);
    return changed_.wait_for(lock, timeout_ - waited, ready);
  }

  // With the lock held: gives up on `awaited`, aborts the group, raises.
  [[noreturn]] void time_out(int rank, const char* op, const std::string& awaited) {
    const std::string what = "LocalComm " + std::string(op) + " on rank " + std::to_string(rank) +
                             " of " + std::to_string(size_) + " timed out";
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = "rank " + std::to_string(rank) + "'s " + op + " timed out waiting for " +
                       awaited;
      changed_.notify_all();
    }
    LOOM_FAIL(what, " after ", timeout_.count(), " s waiting for ", awaited,
              ": that rank's thread returned, hangs or made different calls. A rank that "
              "legitimately takes longer between collectives needs a larger timeout "
              "(LOOM_COLLECTIVE_TIMEOUT, in seconds)");
  }

  void throw_if_aborted(int rank, const char* op) const {
    if (aborted_)
      LOOM_FAIL("LocalComm ", op, " on rank ", rank, " of ", size_, " stopped: ", abort_message_);
  }

  int size_;
  Timeout timeout_;
  Timeout report_after_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Slot> slots_;
  std::vector<bool> present_;  // which ranks wait at the barrier now
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_message_;
  std::map<std::pair<int, int>, Pair> pairs_;
  std::map<std::pair<std::uint64_t, int>, std::shared_ptr<LocalGroup>> splits_;
};

}  // namespace detail

class LocalComm {
 public:
  // n communicators of one group, one per worker thread (rank i = element i).
  // A call waits at most `timeout` for the other ranks, and past
  // `report_after` (unless that is at or above the timeout) says once on
  // std::cerr which ranks it waits for.
  static std::vector<LocalComm> create(int n, Timeout timeout = collective_timeout(),
                                       Timeout report_after = collective_report_after()) {
    LOOM_CHECK(n >= 1, "LocalComm::create(", n, "): a group needs at least one rank");
    LOOM_CHECK(timeout.count() > 0.0, "LocalComm::create: the timeout must be positive, got ",
               timeout.count(), " s");
    LOOM_CHECK(report_after.count() > 0.0,
               "LocalComm::create: the report time must be positive, got ", report_after.count(),
               " s");
    auto group = std::make_shared<detail::LocalGroup>(n, timeout, report_after);
    std::vector<LocalComm> ranks;
    for (int r = 0; r < n; ++r) ranks.push_back(LocalComm(group, r));
    return ranks;
  }

  int rank() const { return rank_; }
  int size() const { return group_->size(); }
  Timeout timeout() const { return group_->timeout(); }
  Timeout report_after() const { return group_->report_after(); }
  std::string describe() const {
    return "LocalComm rank " + std::to_string(rank_) + " of " + std::to_string(size());
  }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    const auto& slots = group_->meet(rank_, slot(data.data(), data.size(), element_name<T>(), "all_reduce"));
    after_all_on_fault("all_reduce", [&] { check_same_buffers(slots, "all_reduce"); });
    const std::size_t n = data.size();
    const auto ranks = static_cast<std::size_t>(size());
    const std::size_t begin = n * static_cast<std::size_t>(rank_) / ranks;
    const std::size_t end = n * static_cast<std::size_t>(rank_ + 1) / ranks;
    for (std::size_t j = begin; j < end; ++j) {
      const T total = reduce_at<T>(slots, j, op);
      for (std::size_t r = 0; r < ranks; ++r) static_cast<T*>(slots[r].data)[j] = total;
    }
    group_->wait_all(rank_, "all_reduce");
  }

  // Rank r reduces slice r of every rank's `data` into its own `out`, in rank
  // order: the same bits as all_reduce gives there.
  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    const auto& slots = meet_parts(data.data(), data.size(), out.size(), element_name<T>(),
                                   "reduce_scatter", "data", "out");
    const std::size_t begin = out.size() * static_cast<std::size_t>(rank_);
    for (std::size_t j = 0; j < out.size(); ++j) out[j] = reduce_at<T>(slots, begin + j, op);
    group_->wait_all(rank_, "reduce_scatter");
  }

  // Each rank copies every rank's `mine` into its own `all`.
  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    const auto& slots = meet_parts(mine.data(), all.size(), mine.size(), element_name<T>(),
                                   "all_gather", "all", "mine");
    if (!mine.empty())
      for (std::size_t r = 0; r < slots.size(); ++r)
        std::memcpy(all.data() + r * mine.size(), slots[r].data, mine.size_bytes());
    group_->wait_all(rank_, "all_gather");
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    check_peer(root, "broadcast");
    Slot mine = slot(data.data(), data.size(), element_name<T>(), "broadcast");
    mine.root = root;
    const auto& slots = group_->meet(rank_, mine);
    after_all_on_fault("broadcast", [&] {
      check_same_buffers(slots, "broadcast");
      for (const auto& other : slots)
        LOOM_CHECK(other.root == root, "LocalComm broadcast on rank ", rank_, " of ", size(),
                   ": ranks name different roots (", root, " and ", other.root, ")");
    });
    if (rank_ != root && !data.empty())
      std::memcpy(data.data(), slots[static_cast<std::size_t>(root)].data, data.size_bytes());
    group_->wait_all(rank_, "broadcast");
  }

  template <Element T>
  void send(std::span<const T> data, int peer) {
    check_peer(peer, "send");
    group_->send(rank_, peer, data.data(), data.size_bytes());
  }
  template <Element T>
  void recv(std::span<T> data, int peer) {
    check_peer(peer, "recv");
    group_->recv(rank_, peer, data.data(), data.size_bytes());
  }

  void barrier() {
    group_->meet(rank_, slot(nullptr, 0, "none", "barrier"));
    group_->wait_all(rank_, "barrier");
  }

  // Ranks calling with the same color form a new group, ranked by (key, rank).
  LocalComm split(int color, int key) {
    const std::uint64_t split = group_->generation();
    Slot mine = slot(nullptr, 0, "none", "split");
    mine.root = color;
    mine.key = key;
    const auto slots = group_->meet(rank_, mine);  // a copy: the next meet reuses the slots
    std::vector<std::tuple<int, int>> members;  // (key, rank) of my color
    for (int r = 0; r < size(); ++r)
      if (slots[static_cast<std::size_t>(r)].root == color)
        members.emplace_back(slots[static_cast<std::size_t>(r)].key, r);
    std::sort(members.begin(), members.end());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::tuple{key, rank_}) - members.begin());
    auto group = group_->split_group(split, color, static_cast<int>(members.size()));
    group_->wait_all(rank_, "split");
    return LocalComm(std::move(group), new_rank);
  }

  // Makes every pending and later call of the group raise a loom::Error that
  // carries `why`, instead of waiting for this rank.
  void cancel(const std::string& why) { group_->cancel(rank_, why); }

 private:
  using Slot = detail::LocalGroup::Slot;

  LocalComm(std::shared_ptr<detail::LocalGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  static Slot slot(const void* data, std::size_t count, const char* type, const char* op) {
    Slot s;
    s.data = const_cast<void*>(data);
    s.count = count;
    s.type = type;
    s.op = op;
    return s;
  }

  void check_same_buffers(const std::vector<Slot>& slots, const char* op) const {
    const Slot& mine = slots[static_cast<std::size_t>(rank_)];
    for (int r = 0; r < size(); ++r) {
      const Slot& other = slots[static_cast<std::size_t>(r)];
      LOOM_CHECK(other.count == mine.count && std::strcmp(other.type, mine.type) == 0, "LocalComm ",
                 op, " on rank ", rank_, " of ", size(), ": rank ", r, " passed ", other.count, " ",
                 other.type, " but this rank ", mine.count, " ", mine.type,
                 "; every rank must pass a buffer of the same type and length");
    }
  }

  // Element j of every rank's buffer reduced in rank order 0, 1, ..., n-1.
  template <class T>
  static T reduce_at(const std::vector<Slot>& slots, std::size_t j, ReduceOp op) {
    T total = static_cast<const T*>(slots[0].data)[j];
    for (std::size_t r = 1; r < slots.size(); ++r) total += static_cast<const T*>(slots[r].data)[j];
    if (op == ReduceOp::average) total /= static_cast<T>(slots.size());
    return total;
  }

  // Meets the group for reduce_scatter or all_gather, publishing `shared`
  // (what the others read), the whole buffer's size and the part's (n), and
  // checks every rank's sizes, not only this one's: a rank that passed wrong
  // sizes would otherwise be read or written past its buffers by the others,
  // and every rank sees the same slots, so all raise together.
  const std::vector<Slot>& meet_parts(const void* shared, std::size_t whole, std::size_t part,
                                      const char* type, const char* op, const char* whole_name,
                                      const char* part_name) {
    Slot mine = slot(shared, whole, type, op);
    mine.part = part;
    const auto& slots = group_->meet(rank_, mine);
    after_all_on_fault(op, [&] { check_parts(slots, part, type, op, whole_name, part_name); });
    return slots;
  }
  void check_parts(const std::vector<Slot>& slots, std::size_t part, const char* type,
                   const char* op, const char* whole_name, const char* part_name) const {
    const auto ranks = static_cast<std::size_t>(size());
    for (int r = 0; r < size(); ++r) {
      const Slot& other = slots[static_cast<std::size_t>(r)];
      LOOM_CHECK(other.count == ranks * other.part, "LocalComm ", op, " on rank ", rank_, " of ",
                 size(), ": ", r == rank_ ? std::string("this rank") : "rank " + std::to_string(r),
                 " passed ", whole_name, " of ", other.count, " ", other.type, " and ", part_name,
                 " of ", other.part, "; ", whole_name, " must hold size() * ", part_name,
                 ".size() = ", ranks * other.part, " elements");
    }
    for (int r = 0; r < size(); ++r) {
      const Slot& other = slots[static_cast<std::size_t>(r)];
      LOOM_CHECK(other.part == part && std::strcmp(other.type, type) == 0, "LocalComm ", op,
                 " on rank ", rank_, " of ", size(), ": rank ", r, " passed ", part_name, " of ",
                 other.part, " ", other.type, " but this rank ", part, " ", type,
                 "; every rank must pass the same n (", part_name, ".size()) and type");
    }
  }

  // Runs `check` over the slots of a meeting. Every rank sees the same
  // slots, so every rank finds the same fault: before raising, each waits
  // until all have done so, since the next call's meeting overwrites the
  // slots the slower ones may still be reading.
  template <class Check>
  void after_all_on_fault(const char* op, Check&& check) {
    try {
      check();
    } catch (const Error&) {
      group_->wait_all(rank_, op);
      throw;
    }
  }

  void check_peer(int peer, const char* op) const {
    LOOM_CHECK(peer >= 0 && peer < size(), "LocalComm ", op, " on rank ", rank_, " of ", size(),
               ": rank ", peer, " does not exist");
  }

  std::shared_ptr<detail::LocalGroup> group_;
  int rank_;
};

static_assert(Communicator<LocalComm>);

}  // namespace loom::comm
