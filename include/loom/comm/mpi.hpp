// Several processes (and nodes) through MPI: dist::Environment starts MPI
// in a program launched by mpirun or srun and says which rank, of how many,
// on which node this process is; MpiComm carries the collectives between
// CPU ranks. Include this header (and link loom::mpi) to use them; loom.hpp
// includes it when the program links loom::mpi (LOOM_WITH_MPI).
//
// Every MPI call is checked: the communicators return errors
// (MPI_ERRORS_RETURN) instead of aborting the job, and a failure is a
// loom::Error naming the call, the rank and MPI's own message. A rank that
// fails should leave its program with an error status: mpirun then ends the
// other ranks, which may be waiting in a collective for it.
//
// A call that waits longer than the communicator's timeout for the other
// ranks (one died and mpirun did not end the job, one hangs, one makes
// another call) raises a loom::Error on this rank instead of waiting for
// ever. The communicator is then dead, and dist::Environment ends the job
// with MPI_Abort rather than MPI_Finalize, which would wait for the missing
// ranks too.
//
// Before that, a call that has waited collective_report_after() (30 s)
// prints one line on std::cerr naming the ranks it waits for. MPI cannot say
// who is missing from a collective, so each MpiComm has a side channel (a
// duplicate of its communicator) on which a late rank asks the others which
// collective they are in: a rank that waits in a call answers at its every
// poll; a rank that is computing, stuck or stopped does not.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <type_traits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/device.hpp"
#include "../core/error.hpp"
#include "communicator.hpp"

namespace loom::comm {

namespace detail {

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::uint64_t>)
    return MPI_UINT64_T;
  else
    return MPI_INT32_T;
}

// The first MPI call of this process that failed or timed out. After it
// every loom communicator is dead (the ranks may be in any call), and
// MPI_Finalize could wait for ranks that will never come: the Environment
// aborts the job instead.
class MpiFailure {
 public:
  static void record(const std::string& why) {
    std::lock_guard lock(mutex());
    if (text().empty()) text() = why;
    broken().store(true);
  }
  static bool happened() { return broken().load(); }
  static std::string why() {
    std::lock_guard lock(mutex());
    return text();
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::string& text() {
    static std::string t;
    return t;
  }
  static std::atomic<bool>& broken() {
    static std::atomic<bool> b{false};
    return b;
  }
};

// After MPI_Finalize no MPI call may be made, freeing included.
inline bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Frees a communicator loom made (split) while MPI is still running.
struct MpiCommFree {
  void operator()(MPI_Comm* comm) const {
    if (!mpi_finalized() && *comm != MPI_COMM_NULL) MPI_Comm_free(comm);
    delete comm;
  }
};

// A note on an MpiComm's side channel: the question "who is in collective
// #n?" ({token, n, 0}) or its answer "I wait in collective #m" ({token, n, m}).
struct MpiNote {
  std::uint64_t words[3] = {0, 0, 0};
  MPI_Request request = MPI_REQUEST_NULL;
};

// What the copies of one MpiComm share: the side channel (a duplicate of the
// communicator, so that notes never meet the collectives' messages or the
// program's own), its token (a number its ranks agreed on: a note that came
// late for a freed channel whose id MPI gave to a new one is not taken for
// the new one's), how many collectives were started on it (every rank makes
// the same ones, so the numbers agree), and the notes whose sends have not
// completed.
struct MpiSideChannel {
  MpiSideChannel() = default;
  MpiSideChannel(const MpiSideChannel&) = delete;
  MpiSideChannel& operator=(const MpiSideChannel&) = delete;
  ~MpiSideChannel() {
    if (mpi_finalized()) return;
    // No MPI call after a failure: the job is aborted, and MPI may be stuck.
    const bool usable = !MpiFailure::happened();
    for (auto& note : sending) {
      int complete = 0;
      if (usable && MPI_Test(&note->request, &complete, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
          complete != 0)
        continue;
      // A note to a rank that never takes it: MPI may read it until the
      // job ends, so it outlives this channel.
      if (usable) MPI_Request_free(&note->request);
      std::lock_guard lock(unsent_mutex());
      unsent().push_back(std::move(note));
    }
    if (usable && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  static std::mutex& unsent_mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::unique_ptr<MpiNote>>& unsent() {
    static std::vector<std::unique_ptr<MpiNote>> notes;
    return notes;
  }

  MPI_Comm comm = MPI_COMM_NULL;
  std::uint64_t token = 0;
  std::uint64_t collectives = 0;
  // A pipeline's send thread waits on a copy of the communicator while its
  // stage waits in a collective: their notes meet here.
  std::mutex sending_mutex;
  std::vector<std::unique_ptr<MpiNote>> sending;
};

}  // namespace detail

}  // namespace loom::comm

namespace loom::dist {
class Environment;
}  // namespace loom::dist

namespace loom::comm {

class MpiComm {
 public:
  // MPI_COMM_WORLD (MPI must be running: see dist::Environment). Collective:
  // every rank makes it (it duplicates the communicator for the side channel).
  // A call gives up after `timeout` and reports whom it waits for after
  // `report_after` (unless that is at or above the timeout).
  static MpiComm world(Timeout timeout = collective_timeout(),
                       Timeout report_after = collective_report_after()) {
    return MpiComm(std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_WORLD),
                                             [](MPI_Comm* comm) { delete comm; }),
                   timeout, report_after);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string describe() const {
    return "MpiComm rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  }
  Timeout timeout() const { return timeout_; }
  Timeout report_after() const { return report_after_; }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    for_chunks(data, [&](T* chunk, int count) {
      MPI_Request request = MPI_REQUEST_NULL;
      ++side_->collectives;
      start(MPI_Iallreduce(MPI_IN_PLACE, chunk, count, detail::mpi_type<T>(), MPI_SUM, *comm_,
                           &request),
            "MPI_Allreduce");
      wait(request, "MPI_Allreduce", data.size(), element_name<T>());
    });
    if (op == ReduceOp::average)
      for (T& x : data) x /= static_cast<T>(size_);
  }

  // One MPI_Ireduce_scatter_block after the ranks agree on n (agree_on_part).
  // n is MPI's int count; a slice of more elements is refused, not split.
  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    constexpr const char* call = "MPI_Reduce_scatter_block";
    const int n = agree_on_part(data.size(), out.size(), element_name<T>(), call, "data", "out");
    MPI_Request request = MPI_REQUEST_NULL;
    ++side_->collectives;
    start(MPI_Ireduce_scatter_block(data.data(), out.data(), n, detail::mpi_type<T>(), MPI_SUM,
                                    *comm_, &request),
          call);
    wait(request, call, data.size(), element_name<T>());
    if (op == ReduceOp::average)
      for (T& x : out) x /= static_cast<T>(size_);
  }

  // One MPI_Iallgather after the ranks agree on n (agree_on_part).
  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    constexpr const char* call = "MPI_Allgather";
    const int n = agree_on_part(all.size(), mine.size(), element_name<T>(), call, "all", "mine");
    MPI_Request request = MPI_REQUEST_NULL;
    ++side_->collectives;
    start(MPI_Iallgather(mine.data(), n, detail::mpi_type<T>(), all.data(), n,
                         detail::mpi_type<T>(), *comm_, &request),
          call);
    wait(request, call, all.size(), element_name<T>());
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    check_peer(root, "MPI_Bcast");
    for_chunks(data, [&](T* chunk, int count) {
      MPI_Request request = MPI_REQUEST_NULL;
      ++side_->collectives;
      start(MPI_Ibcast(chunk, count, detail::mpi_type<T>(), root, *comm_, &request), "MPI_Bcast");
      wait(request, "MPI_Bcast", data.size(), element_name<T>());
    });
  }

  template <Element T>
  void send(std::span<const T> data, int peer) {
    check_peer(peer, "MPI_Send");
    MPI_Request request = MPI_REQUEST_NULL;
    start(MPI_Isend(data.data(), to_count(data.size(), "MPI_Send"), detail::mpi_type<T>(), peer,
                    tag, *comm_, &request),
          "MPI_Send");
    wait(request, "MPI_Send", data.size(), element_name<T>(), peer);
  }
  template <Element T>
  void recv(std::span<T> data, int peer) {
    check_peer(peer, "MPI_Recv");
    MPI_Request request = MPI_REQUEST_NULL;
    start(MPI_Irecv(data.data(), to_count(data.size(), "MPI_Recv"), detail::mpi_type<T>(), peer,
                    tag, *comm_, &request),
          "MPI_Recv");
    const MPI_Status status = wait(request, "MPI_Recv", data.size(), element_name<T>(), peer);
    int received = 0;
    check(MPI_Get_count(&status, detail::mpi_type<T>(), &received), "MPI_Get_count");
    LOOM_CHECK(static_cast<std::size_t>(received) == data.size(), "MPI_Recv on rank ", rank_,
               " of ", size_, ": rank ", peer, " sent ", received, " values but ", data.size(),
               " were expected");
  }

  void barrier() {
    MPI_Request request = MPI_REQUEST_NULL;
    ++side_->collectives;
    start(MPI_Ibarrier(*comm_, &request), "MPI_Barrier");
    wait(request, "MPI_Barrier", 0, "none");
  }

  // MPI has no non-blocking split: it is made while setting up, when every
  // rank is there.
  MpiComm split(int color, int key) {
    check_usable("MPI_Comm_split");
    auto made = std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_NULL), detail::MpiCommFree{});
    check(MPI_Comm_split(*comm_, color, key, made.get()), "MPI_Comm_split");
    return MpiComm(std::move(made), timeout_, report_after_);
  }

  // MPI cannot wake a rank waiting in a collective; the failing rank ends its
  // program with an error status, and mpirun ends the others (or their
  // timeout does).
  void cancel(const std::string&) {}

  MPI_Comm get() const { return *comm_; }

 private:
  friend class loom::dist::Environment;

  static constexpr int tag = 7;
  // The side channel's tags.
  static constexpr int question_tag = 1;
  static constexpr int answer_tag = 2;
  // How long a late rank waits for the others' answers before it prints
  // what it has: a waiting rank answers within its next poll (at most 1 ms
  // apart), so a second is ample even on a loaded machine.
  static constexpr double answer_window_s = 1.0;

  MpiComm(std::shared_ptr<MPI_Comm> comm, Timeout timeout, Timeout report_after)
      : comm_(std::move(comm)),
        side_(std::make_shared<detail::MpiSideChannel>()),
        timeout_(timeout),
        report_after_(report_after) {
    LOOM_CHECK(timeout.count() > 0.0, "MpiComm: the timeout must be positive, got ",
               timeout.count(), " s");
    LOOM_CHECK(report_after.count() > 0.0, "MpiComm: the report time must be positive, got ",
               report_after.count(), " s");
    check(MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(*comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(*comm_, &size_), "MPI_Comm_size");
    check(MPI_Comm_dup(*comm_, &side_->comm), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(side_->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    std::random_device random;
    side_->token = (std::uint64_t{random()} << 32) ^ random();
    check(MPI_Allreduce(MPI_IN_PLACE, &side_->token, 1, MPI_UINT64_T, MPI_MAX, side_->comm),
          "MPI_Allreduce");
  }

  // The same communicator and side channel with another timeout.
  MpiComm with_timeout(Timeout timeout) const {
    LOOM_CHECK(timeout.count() > 0.0, "MpiComm: the timeout must be positive, got ",
               timeout.count(), " s");
    MpiComm copy = *this;
    copy.timeout_ = timeout;
    return copy;
  }

  void check(int code, const char* call) const {
    if (code == MPI_SUCCESS) return;
    const std::string why = std::string(call) + " failed on rank " + std::to_string(rank_) +
                            " of " + std::to_string(size_) + ": " + detail::mpi_error_text(code);
    detail::MpiFailure::record(why);
    LOOM_FAIL(why);
  }
  // After a failed or timed-out call no communicator is used again: the
  // ranks may be in any call, and waiting for them would take another
  // timeout each.
  void check_usable(const char* call) const {
    if (detail::MpiFailure::happened())
      LOOM_FAIL(call, " on rank ", rank_, " of ", size_,
                ": MPI is unusable in this process since an earlier call failed (",
                detail::MpiFailure::why(), ")");
  }
  void start(int code, const char* call) const {
    check_usable(call);
    check(code, call);
  }

  // Waits for a started call, testing it with MPI_Test (which also drives
  // MPI's progress), until it completes or the timeout passes. peer: the
  // rank a send or recv waits for; -1 for the collective just started.
  MPI_Status wait(MPI_Request& request, const char* call, std::size_t count, const char* type,
                  int peer = -1) const {
    MPI_Status status{};
    Timeout waited{};
    Lateness late{call, peer, peer >= 0 ? 0 : side_->collectives};
    const bool done = wait_until(timeout_, [&] {
      int complete = 0;
      check(MPI_Test(&request, &complete, &status), call);
      return complete != 0;
    }, waited, [&](Timeout so_far) { keep_account(late, so_far); });
    if (!done) {
      if (late.asked && !late.printed) print_late(late, waited);
      fail_timeout(call, count, type, peer, waited);
    }
    return status;
  }

  // One wait's account of whom it waits for.
  struct Lateness {
    const char* call;
    int peer;                 // a send's or recv's peer, else -1
    std::uint64_t collective; // the collective's number, 0 for a send or recv
    bool asked = false;       // the question went out (at `asked_at`)
    bool printed = false;
    Timeout asked_at{};
    int answered = 0;
    std::vector<std::uint64_t> answers{};  // each rank's collective, 0: no answer
  };

  // Between two polls of a wait: a collective's wait answers the questions
  // that came (and takes the answers to its own); once the wait has lasted
  // report_after_, a send or recv names its peer, and a collective asks
  // every other rank once where it is, then prints when all answered or
  // answer_window_s has passed.
  void keep_account(Lateness& late, Timeout waited) const {
    if (late.collective != 0) read_notes(late);
    drop_sent();
    if (late.printed || report_after_ >= timeout_ || waited < report_after_) return;
    if (late.collective == 0) {
      print_late(late, waited);
    } else if (!late.asked) {
      late.asked = true;
      late.asked_at = waited;
      late.answers.assign(static_cast<std::size_t>(size_), 0);
      for (int r = 0; r < size_; ++r)
        if (r != rank_) send_note(r, question_tag, late.collective, 0);
    } else if (late.answered == size_ - 1 || waited - late.asked_at >= Timeout(answer_window_s)) {
      print_late(late, waited);
    }
  }

  // Takes every note that has come: answers questions with this wait's
  // collective number, keeps the answers to this wait's question, and drops
  // answers to earlier questions (they are numbered).
  void read_notes(Lateness& late) const {
    for (;;) {
      int came = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status{};
      check(MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, side_->comm, &came, &message, &status),
            "MPI_Improbe");
      if (came == 0) return;
      int bytes = 0;
      check(MPI_Get_count(&status, MPI_BYTE, &bytes), "MPI_Get_count");
      std::uint64_t words[3] = {0, 0, 0};
      if (bytes != static_cast<int>(sizeof words)) {  // not a note: taken, then dropped
        std::vector<unsigned char> other(static_cast<std::size_t>(bytes));
        check(MPI_Mrecv(other.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
        continue;
      }
      check(MPI_Mrecv(words, 3, MPI_UINT64_T, &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
      const int from = status.MPI_SOURCE;
      if (words[0] != side_->token) continue;
      if (status.MPI_TAG == question_tag) {
        send_note(from, answer_tag, words[1], late.collective);
      } else if (late.asked && words[1] == late.collective &&
                 late.answers[static_cast<std::size_t>(from)] == 0) {
        late.answers[static_cast<std::size_t>(from)] = words[2];
        ++late.answered;
      }
    }
  }

  void send_note(int to, int note_tag, std::uint64_t first, std::uint64_t second) const {
    auto note = std::make_unique<detail::MpiNote>();
    note->words[0] = side_->token;
    note->words[1] = first;
    note->words[2] = second;
    check(MPI_Isend(note->words, 3, MPI_UINT64_T, to, note_tag, side_->comm, &note->request),
          "MPI_Isend");
    std::lock_guard lock(side_->sending_mutex);
    side_->sending.push_back(std::move(note));
  }

  // Forgets the notes whose sends completed.
  void drop_sent() const {
    std::lock_guard lock(side_->sending_mutex);
    auto& sending = side_->sending;
    for (std::size_t i = 0; i < sending.size();) {
      int complete = 0;
      check(MPI_Test(&sending[i]->request, &complete, MPI_STATUS_IGNORE), "MPI_Test");
      if (complete != 0) {
        sending[i] = std::move(sending.back());
        sending.pop_back();
      } else {
        ++i;
      }
    }
  }

  void print_late(Lateness& late, Timeout waited) const {
    late.printed = true;
    std::string call = late.call;
    std::string whom;
    if (late.collective == 0) {
      whom = " for rank " + std::to_string(late.peer);
    } else {
      call += " (collective #" + std::to_string(late.collective) + ")";
      std::vector<std::pair<int, std::string>> missing;
      std::vector<int> waiting;
      for (int r = 0; r < size_; ++r) {
        const std::uint64_t at = late.answers[static_cast<std::size_t>(r)];
        if (r == rank_) continue;
        if (at == late.collective)
          waiting.push_back(r);
        else
          missing.emplace_back(r, at == 0 ? "" : " (in collective #" + std::to_string(at) + ")");
      }
      whom = detail::awaiting_ranks(missing, waiting);
    }
    std::cerr << detail::late_line(rank_, size_, waited, call, whom, timeout_);
  }

  [[noreturn]] void fail_timeout(const char* call, std::size_t count, const char* type, int peer,
                                 Timeout waited) const {
    // The request stays pending: MPI can neither complete nor free it.
    const std::string what = std::string(call) + " of " + std::to_string(count) + " " + type +
                             " value(s)" +
                             (peer >= 0 ? " with rank " + std::to_string(peer) : "") +
                             " timed out on rank " + std::to_string(rank_) + " of " +
                             std::to_string(size_);
    detail::MpiFailure::record(what);
    LOOM_FAIL(what, " after ", waited.count(), " s (timeout ",
              timeout_.count(), " s): ",
              peer >= 0 ? "that rank" : "another rank",
              " died, hangs or made a different call. MPI is unusable in this process now; the "
              "job is aborted (MPI_Abort) when dist::Environment ends. A rank that legitimately takes "
              "longer between collectives needs a larger timeout (LOOM_COLLECTIVE_TIMEOUT, in "
              "seconds)");
  }

  // reduce_scatter's and all_gather's sizes: this rank's `whole` buffer must
  // hold size() * `part` (n) elements, and every rank must pass the same n.
  // MPI does not check that counts match across ranks (a mismatch truncates,
  // hangs or writes past a buffer, depending on the algorithm), so the ranks
  // first compare theirs in one small all-reduce of three words with
  // MPI_MAX: whether any rank's own sizes are wrong, the largest n and the
  // complement of the smallest. A rank with wrong sizes still takes part, so
  // that every rank raises and none waits for it. Returns n as MPI's count.
  int agree_on_part(std::size_t whole, std::size_t part, const char* type, const char* call,
                    const char* whole_name, const char* part_name) {
    const bool fits = whole == static_cast<std::size_t>(size_) * part;
    std::uint64_t words[3] = {fits ? 0u : 1u, part, ~static_cast<std::uint64_t>(part)};
    MPI_Request request = MPI_REQUEST_NULL;
    ++side_->collectives;
    // Named as the caller's call: it is the first half of it.
    start(MPI_Iallreduce(MPI_IN_PLACE, words, 3, MPI_UINT64_T, MPI_MAX, *comm_, &request), call);
    wait(request, call, whole, type);
    LOOM_CHECK(fits, call, " on rank ", rank_, " of ", size_, ": ", whole_name, " has ", whole, " ",
               type, " and ", part_name, " ", part, "; ", whole_name, " must hold size() * ",
               part_name, ".size() = ", static_cast<std::size_t>(size_) * part, " elements");
    LOOM_CHECK(words[0] == 0, call, " on rank ", rank_, " of ", size_,
               ": another rank passed buffers whose sizes do not fit (its error says which)");
    const std::uint64_t smallest = ~words[2];
    LOOM_CHECK(smallest == words[1], call, " on rank ", rank_, " of ", size_, ": the ranks pass ",
               part_name, " of ", smallest, " to ", words[1], " ", type, ", this rank ", part,
               "; every rank must pass the same n (", part_name, ".size())");
    return to_count(part, call);
  }

  void check_peer(int peer, const char* call) const {
    LOOM_CHECK(peer >= 0 && peer < size_, call, " on rank ", rank_, " of ", size_, ": rank ", peer,
               " does not exist");
  }
  int to_count(std::size_t n, const char* call) const {
    LOOM_CHECK(n <= static_cast<std::size_t>(INT_MAX), call, " on rank ", rank_, ": ", n,
               " values exceed MPI's int count");
    return static_cast<int>(n);
  }
  // MPI counts are ints: larger buffers go in pieces.
  template <class T, class F>
  static void for_chunks(std::span<T> data, F&& f) {
    constexpr std::size_t most = std::size_t{1} << 30;
    for (std::size_t at = 0; at < data.size(); at += most)
      f(data.data() + at, static_cast<int>(std::min(most, data.size() - at)));
  }

  std::shared_ptr<MPI_Comm> comm_;
  std::shared_ptr<detail::MpiSideChannel> side_;
  Timeout timeout_;
  Timeout report_after_;
  int rank_ = -1;
  int size_ = 0;
};

static_assert(Communicator<MpiComm>);

}  // namespace loom::comm

namespace loom::dist {

// MPI for the life of the object: started if the program has not started it
// (and then finalized at the end), with the thread support loom's
// communication threads need. Works without mpirun too: one rank of one.
//
// Collectives give up after comm::collective_timeout() (LOOM_COLLECTIVE_TIMEOUT
// in seconds, else 600) and report whom they wait for after
// comm::collective_report_after() (LOOM_COLLECTIVE_REPORT, else 30): see MpiComm. After a call
// failed or timed out, the destructor ends the whole job with MPI_Abort
// (exit status 1 from mpirun) instead of finalizing: the ranks missing
// from that call may be dead, and MPI_Finalize would wait for them.
class Environment {
 public:
  Environment(int& argc, char**& argv) {
    timeout_ = comm::collective_timeout();
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      const int code = MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
      LOOM_CHECK(code == MPI_SUCCESS, "MPI_Init_thread failed: ", comm::detail::mpi_error_text(code));
      owned_ = true;
    } else {
      MPI_Query_thread(&provided);
    }
    // Training threads call MPI one at a time (the communication thread
    // during a step, the main thread between steps).
    LOOM_CHECK(provided >= MPI_THREAD_SERIALIZED,
               "this MPI library provides thread level ", provided,
               ", below MPI_THREAD_SERIALIZED, which loom's communication thread needs");
    world_ = comm::MpiComm::world(timeout_);
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_->rank(), MPI_INFO_NULL,
                              &node),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(node, &local_rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(node, &local_size_), "MPI_Comm_size");
    check(MPI_Comm_free(&node), "MPI_Comm_free");
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;
  ~Environment() {
    if (comm::detail::mpi_finalized()) return;
    if (comm::detail::MpiFailure::happened()) {
      MPI_Abort(MPI_COMM_WORLD, 1);
    } else if (owned_) {
      world_.reset();  // frees its side channel, unless a copy outlives MPI
      MPI_Finalize();
    }
  }

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int local_rank() const { return local_rank_; }  // among the ranks on this node
  int local_size() const { return local_size_; }
  comm::MpiComm world() const { return *world_; }

  // For communicators made from world() from now on (the trainer makes its
  // own when it is constructed).
  void set_collective_timeout(comm::Timeout timeout) {
    world_ = world_->with_timeout(timeout);
    timeout_ = timeout;
  }
  comm::Timeout collective_timeout() const { return timeout_; }

  // This rank's device: GPU local_rank where there are GPUs (NCCL takes one
  // per rank), else the CPU with the node's cores shared among its ranks.
  std::vector<Device> devices() const {
    const auto gpus = devices::gpus();
    if (!gpus.empty()) {
      LOOM_CHECK(static_cast<std::size_t>(local_size_) <= gpus.size(), local_size_,
                 " ranks run on this node but it has ", gpus.size(),
                 " GPU(s); NCCL takes one GPU per rank: start at most that many here");
      return {gpus[static_cast<std::size_t>(local_rank_)]};
    }
    const int threads = std::max(1, devices::hardware_threads() / local_size_);
    return {Device{Device::Kind::cpu, local_rank_, threads}};
  }

 private:
  void check(int code, const char* call) const {
    LOOM_CHECK(code == MPI_SUCCESS, call, " failed on rank ", world_->rank(), ": ",
               comm::detail::mpi_error_text(code));
  }

  bool owned_ = false;
  comm::Timeout timeout_;
  std::optional<comm::MpiComm> world_;  // set once MPI runs
  int local_rank_ = 0;
  int local_size_ = 1;
};

}  // namespace loom::dist
