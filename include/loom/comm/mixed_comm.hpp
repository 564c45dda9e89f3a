// MixedComm: ranks that are threads spread over processes, e.g. 2 processes
// x 2 worker threads = 4 ranks of one grid (rank = process * threads +
// thread). Between the threads of a process it works like LocalComm (it
// holds one per process); between processes it goes through the processes'
// own communicator, a type-erased Comm (an MpiComm, or in tests a LocalComm
// standing in for processes), called by one leader thread per process.
//
// A group made by split() may sit unevenly on the processes (a pipeline's
// stages in one process, a stage's replicas one thread in each), so a
// MixedComm is in general a list of members (process, thread), and each
// process's part of it holds:
// - a LocalComm over the members in this process, by rank;
// - a Comm over the processes that hold members (their leaders meet there);
// - for each ordered (sender thread, receiver thread) pair that lies on two
//   processes, a duplicate of that Comm, so that the messages of different
//   thread pairs between two processes never match each other.
//
// Reductions are deterministic: within each process in thread (local rank)
// order, then across processes by the leaders, then shared within each
// process. Over MPI the processes' communicators are called from several
// threads of a process at once (different pairs' send/recv, the leaders of
// different groups), which needs MPI_THREAD_MULTIPLE: dist::Environment asks
// for it.
//
// A failing call cancels its group (the local group and every process-level
// communicator of it) before it raises, so that a timeout or a cancel on one
// rank wakes the others rather than leaving them waiting: over LocalComm the
// other processes' leaders raise and cancel their own threads; over MPI,
// whose cancel cannot wake another process, the others raise at their
// timeout or when mpirun ends the job, as with MpiComm.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "communicator.hpp"
#include "local_comm.hpp"

namespace loom::comm {

namespace detail {

// One rank of a MixedComm, numbered as in MixedComm::create.
struct MixedMember {
  int process = 0;
  int thread = 0;
};

// What the threads of one process share in one MixedComm group. Written by
// one thread before the others use it (create, or the leader in split
// before a local barrier), read-only after that except `made`.
struct MixedSite {
  std::vector<MixedMember> members;  // by rank
  std::vector<int> process_of;       // each member's rank in `processes`
  std::vector<int> local_of;         // each member's rank in `local`, -1 if elsewhere
  std::vector<LocalComm> local;      // this process's members, by local rank
  Comm processes;                    // over the processes holding members
  std::map<std::pair<int, int>, Comm> pairs;  // (sender thread, receiver thread)
  int grid_processes = 1;  // of create(), for describe()
  int grid_threads = 1;
  Timeout timeout{};
  Timeout report_after{};
  // The groups a split made for this process, by color: written by the
  // leader, read by the other threads after a local barrier.
  std::map<int, std::shared_ptr<MixedSite>> made;
};

}  // namespace detail

class MixedComm {
 public:
  // This process's `threads` ranks (element t: thread t), of a grid of
  // processes.size() processes x `threads`. Collective over `processes`:
  // every process calls it once, with the same `threads`. A call waits at
  // most `timeout` for the other threads of its process (the processes'
  // Comm has its own), and reports whom it waits for past `report_after`.
  static std::vector<MixedComm> create(Comm processes, int threads,
                                       Timeout timeout = collective_timeout(),
                                       Timeout report_after = collective_report_after()) {
    LOOM_CHECK(static_cast<bool>(processes),
               "MixedComm::create: the processes' communicator is empty");
    const int process = processes.rank();
    const int process_count = processes.size();
    // Agreed before any check, so that every process raises, none waits.
    const double mine = threads;
    const std::vector<double> counts = gather_rows(processes, std::span<const double>(&mine, 1));
    for (int p = 0; p < process_count; ++p)
      LOOM_CHECK(counts[static_cast<std::size_t>(p)] == mine, "MixedComm::create on process ",
                 process, " of ", process_count, ": this process gives ", threads,
                 " thread(s) but process ", p, " gives ", counts[static_cast<std::size_t>(p)],
                 "; every process must give the same count");
    LOOM_CHECK(threads >= 1, "MixedComm::create(", threads,
               "): a process needs at least one thread");

    auto site = std::make_shared<detail::MixedSite>();
    site->grid_processes = process_count;
    site->grid_threads = threads;
    site->timeout = timeout;
    site->report_after = report_after;
    for (int p = 0; p < process_count; ++p)
      for (int t = 0; t < threads; ++t) {
        site->members.push_back({p, t});
        site->process_of.push_back(p);
        site->local_of.push_back(p == process ? t : -1);
      }
    site->local = LocalComm::create(threads, timeout, report_after);
    // Its own duplicate: the program's calls on `processes` never meet ours.
    site->processes = processes.split(0, process);
    if (process_count > 1)
      for (int s = 0; s < threads; ++s)
        for (int r = 0; r < threads; ++r)
          site->pairs[{s, r}] = site->processes.split(0, process);
    std::vector<MixedComm> ranks;
    for (int t = 0; t < threads; ++t) ranks.push_back(MixedComm(site, process * threads + t));
    return ranks;
  }

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(site_->members.size()); }
  std::string describe() const {
    const auto& me = site_->members[static_cast<std::size_t>(rank_)];
    return "MixedComm rank " + std::to_string(rank_) + " of " + std::to_string(size()) +
           " (process " + std::to_string(me.process) + " thread " + std::to_string(me.thread) +
           " of a " + std::to_string(site_->grid_processes) + " x " +
           std::to_string(site_->grid_threads) + " grid)";
  }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    guarded("all_reduce", [&] { reduce(data, op); });
  }

  // float and uint64_t: what the processes' Comm broadcasts.
  template <Element T>
    requires(std::same_as<T, float> || std::same_as<T, std::uint64_t>)
  void broadcast(std::span<T> data, int root) {
    guarded("broadcast", [&] {
      check_peer(root);
      detail::MixedSite& site = *site_;
      LocalComm& here = local();
      const int root_local = site.local_of[static_cast<std::size_t>(root)];
      if (root_local >= 0 && here.size() > 1) here.broadcast(data, root_local);
      if (site.processes.size() > 1) {
        if (here.rank() == 0)
          site.processes.broadcast(data, site.process_of[static_cast<std::size_t>(root)]);
        if (root_local < 0 && here.size() > 1) here.broadcast(data, 0);
      }
    });
  }

  // Within a process buffered (LocalComm); between processes as the
  // processes' Comm sends (MpiComm: may wait for the receiver, as MPI_Send).
  void send(std::span<const float> data, int peer) {
    guarded("send", [&] {
      check_peer(peer);
      const int peer_local = site_->local_of[static_cast<std::size_t>(peer)];
      if (peer_local >= 0)
        local().send(data, peer_local);
      else
        pair(rank_, peer).send(data, site_->process_of[static_cast<std::size_t>(peer)]);
    });
  }
  void recv(std::span<float> data, int peer) {
    guarded("recv", [&] {
      check_peer(peer);
      const int peer_local = site_->local_of[static_cast<std::size_t>(peer)];
      if (peer_local >= 0)
        local().recv(data, peer_local);
      else
        pair(peer, rank_).recv(data, site_->process_of[static_cast<std::size_t>(peer)]);
    });
  }

  void barrier() {
    guarded("barrier", [&] {
      LocalComm& here = local();
      if (here.size() > 1) here.barrier();
      if (site_->processes.size() == 1) return;
      if (here.rank() == 0) site_->processes.barrier();
      if (here.size() > 1) here.barrier();
    });
  }

  // Ranks calling with the same color form a new group, ranked by (key,
  // rank). The colors are agreed by a gather; then each process's leader
  // makes the process-level communicators the new groups need, every
  // process the same ones in the same order (color order), since each
  // split of a Comm is collective over its processes.
  MixedComm split(int color, int key) {
    return guarded("split", [&] {
      const double mine[2] = {static_cast<double>(color), static_cast<double>(key)};
      std::vector<double> all(2 * static_cast<std::size_t>(size()));
      gather(std::span<const double>(mine), std::span<double>(all));
      std::map<int, std::vector<std::tuple<int, int>>> groups;  // color -> (key, rank)
      for (int r = 0; r < size(); ++r)
        groups[static_cast<int>(all[2 * static_cast<std::size_t>(r)])].emplace_back(
            static_cast<int>(all[2 * static_cast<std::size_t>(r) + 1]), r);
      for (auto& [c, members] : groups) std::sort(members.begin(), members.end());
      LocalComm& here = local();
      if (here.rank() == 0) site_->made = make_groups(groups);
      if (here.size() > 1) here.barrier();
      const auto& members = groups.at(color);
      const int new_rank = static_cast<int>(
          std::find(members.begin(), members.end(), std::tuple{key, rank_}) - members.begin());
      return MixedComm(site_->made.at(color), new_rank);
    });
  }

  // Makes every pending and later call of the group, on every rank of this
  // process (and over LocalComm, of every process) raise a loom::Error that
  // carries `why`.
  void cancel(const std::string& why) {
    local().cancel(why);
    site_->processes.cancel(why);
    for (auto& [threads, comm] : site_->pairs) comm.cancel(why);
  }

  // Every rank gives `data` of size() * n elements; rank r receives in `out`
  // (n elements) the reduction (op) over the ranks of their slice r. Built
  // from all_reduce: the whole buffer travels, not a slice, but slice r is
  // the same bits all_reduce gives, in its fixed order.
  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    guarded("reduce_scatter", [&] {
      check_slices(data.size(), out.size());
      std::vector<T> reduced(data.begin(), data.end());
      reduce(std::span<T>(reduced), op);
      const auto at = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank_) * out.size());
      std::copy(reduced.begin() + at, reduced.begin() + at + static_cast<std::ptrdiff_t>(out.size()),
                out.begin());
    });
  }

  // Every rank gives `mine` (n elements); `all` (size() * n elements)
  // receives rank r's at slice r, on every rank. Built from all_reduce
  // (gather below), exactly.
  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    guarded("all_gather", [&] { gather(mine, all); });
  }

 private:
  MixedComm(std::shared_ptr<detail::MixedSite> site, int rank)
      : site_(std::move(site)), rank_(rank) {}

  // all_reduce, unguarded: the calls that build on it are guarded once.
  template <Element T>
  void reduce(std::span<T> data, ReduceOp op) {
    static_assert(!std::same_as<T, std::int32_t>,
                  "MixedComm: float, double or uint64_t (the processes' Comm carries no int32)");
    detail::MixedSite& site = *site_;
    LocalComm& here = local();
    if (here.size() > 1) here.all_reduce(data, ReduceOp::sum);
    if (site.processes.size() > 1) {
      if (here.rank() == 0) site.processes.all_reduce(data, ReduceOp::sum);
      if (here.size() > 1) here.broadcast(data, 0);
    }
    if (op == ReduceOp::average)
      for (T& x : data) x /= static_cast<T>(size());
  }

  // Each rank writes its slice into a buffer of -0.0 (0 for integers) and
  // one sum gathers them, exactly, since x + -0.0 is x for every x, the
  // zeros' signs included.
  template <Element T>
  void gather(std::span<const T> mine, std::span<T> all) {
    check_slices(all.size(), mine.size());
    std::fill(all.begin(), all.end(), std::is_floating_point_v<T> ? T(-0.0) : T(0));
    std::copy(mine.begin(), mine.end(),
              all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank_) * mine.size()));
    reduce(all, ReduceOp::sum);
  }

  LocalComm& local() const {
    return site_->local[static_cast<std::size_t>(site_->local_of[static_cast<std::size_t>(rank_)])];
  }

  // The communicator of sender `from`'s thread to receiver `to`'s thread.
  Comm& pair(int from, int to) const {
    const auto& members = site_->members;
    return site_->pairs.at({members[static_cast<std::size_t>(from)].thread,
                            members[static_cast<std::size_t>(to)].thread});
  }

  // Runs `call`; if it raises, cancels the group first, so that no other
  // rank waits for this one, and says which rank and call failed.
  template <class Call>
  auto guarded(const char* op, Call&& call) -> decltype(call()) {
    try {
      return call();
    } catch (const std::exception& error) {
      cancel(describe() + ", " + op + ": " + error.what());
      LOOM_FAIL(describe(), ", ", op, ": ", error.what());
    }
  }

  // The leader's part of split: this process's part of each new group that
  // has members here. First each group's processes' Comm (a split of ours,
  // collective over all our processes, so every process makes one for
  // every group), then each group's pair duplicates (collective over that
  // group's processes).
  std::map<int, std::shared_ptr<detail::MixedSite>> make_groups(
      const std::map<int, std::vector<std::tuple<int, int>>>& groups) {
    const detail::MixedSite& site = *site_;
    const int process = site.process_of[static_cast<std::size_t>(rank_)];
    std::map<int, std::shared_ptr<detail::MixedSite>> made;
    for (const auto& [color, members] : groups) {
      // Our processes holding members, in order: their ranks in the new Comm.
      std::vector<int> processes;
      for (const auto& [key, r] : members) processes.push_back(site.process_of[static_cast<std::size_t>(r)]);
      std::sort(processes.begin(), processes.end());
      processes.erase(std::unique(processes.begin(), processes.end()), processes.end());
      const bool held = std::binary_search(processes.begin(), processes.end(), process);
      Comm sub = site_->processes.split(held ? 0 : 1, site_->processes.rank());
      if (!held) continue;
      auto group = std::make_shared<detail::MixedSite>();
      group->grid_processes = site.grid_processes;
      group->grid_threads = site.grid_threads;
      group->timeout = site.timeout;
      group->report_after = site.report_after;
      int locals = 0;
      for (const auto& [key, r] : members) {
        const auto i = static_cast<std::size_t>(r);
        group->members.push_back(site.members[i]);
        group->process_of.push_back(static_cast<int>(
            std::lower_bound(processes.begin(), processes.end(), site.process_of[i]) -
            processes.begin()));
        group->local_of.push_back(site.process_of[i] == process ? locals++ : -1);
      }
      group->local = LocalComm::create(locals, site.timeout, site.report_after);
      group->processes = std::move(sub);
      made[color] = std::move(group);
    }
    for (auto& [color, group] : made) {
      if (group->processes.size() == 1) continue;
      std::set<std::pair<int, int>> threads;  // (sender, receiver) on two processes
      for (std::size_t a = 0; a < group->members.size(); ++a)
        for (std::size_t b = 0; b < group->members.size(); ++b)
          if (group->process_of[a] != group->process_of[b])
            threads.insert({group->members[a].thread, group->members[b].thread});
      for (const auto& sender_receiver : threads)
        group->pairs[sender_receiver] = group->processes.split(0, group->processes.rank());
    }
    return made;
  }

  void check_peer(int peer) const {
    LOOM_CHECK(peer >= 0 && peer < size(), "rank ", peer, " does not exist (the group has ", size(),
               ")");
  }
  void check_slices(std::size_t whole, std::size_t slice) const {
    LOOM_CHECK(whole == slice * static_cast<std::size_t>(size()),
               "the buffer of all slices needs size() x the slice's elements (", size(), " x ",
               slice, " = ", slice * static_cast<std::size_t>(size()), ") but has ", whole);
  }

  std::shared_ptr<detail::MixedSite> site_;
  int rank_;
};

static_assert(Communicator<MixedComm>);

}  // namespace loom::comm
