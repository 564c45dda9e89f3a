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
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <span>
#include <string>
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

// Frees a communicator loom made (split) while MPI is still running.
struct MpiCommFree {
  void operator()(MPI_Comm* comm) const {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && *comm != MPI_COMM_NULL) MPI_Comm_free(comm);
    delete comm;
  }
};

}  // namespace detail

class MpiComm {
 public:
  // MPI_COMM_WORLD (MPI must be running: see dist::Environment).
  static MpiComm world(Timeout timeout = collective_timeout()) {
    return MpiComm(std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_WORLD),
                                             [](MPI_Comm* comm) { delete comm; }),
                   timeout);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string describe() const {
    return "MpiComm rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  }
  Timeout timeout() const { return timeout_; }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    for_chunks(data, [&](T* chunk, int count) {
      MPI_Request request = MPI_REQUEST_NULL;
      start(MPI_Iallreduce(MPI_IN_PLACE, chunk, count, detail::mpi_type<T>(), MPI_SUM, *comm_,
                           &request),
            "MPI_Allreduce");
      wait(request, "MPI_Allreduce", data.size(), element_name<T>());
    });
    if (op == ReduceOp::average)
      for (T& x : data) x /= static_cast<T>(size_);
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    check_peer(root, "MPI_Bcast");
    for_chunks(data, [&](T* chunk, int count) {
      MPI_Request request = MPI_REQUEST_NULL;
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
    start(MPI_Ibarrier(*comm_, &request), "MPI_Barrier");
    wait(request, "MPI_Barrier", 0, "none");
  }

  // MPI has no non-blocking split: it is made while setting up, when every
  // rank is there.
  MpiComm split(int color, int key) {
    check_usable("MPI_Comm_split");
    auto made = std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_NULL), detail::MpiCommFree{});
    check(MPI_Comm_split(*comm_, color, key, made.get()), "MPI_Comm_split");
    return MpiComm(std::move(made), timeout_);
  }

  // MPI cannot wake a rank waiting in a collective; the failing rank ends its
  // program with an error status, and mpirun ends the others (or their
  // timeout does).
  void cancel(const std::string&) {}

  MPI_Comm get() const { return *comm_; }

 private:
  static constexpr int tag = 7;

  MpiComm(std::shared_ptr<MPI_Comm> comm, Timeout timeout)
      : comm_(std::move(comm)), timeout_(timeout) {
    LOOM_CHECK(timeout.count() > 0.0, "MpiComm: the timeout must be positive, got ",
               timeout.count(), " s");
    check(MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(*comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(*comm_, &size_), "MPI_Comm_size");
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
  // MPI's progress), until it completes or the timeout passes.
  MPI_Status wait(MPI_Request& request, const char* call, std::size_t count, const char* type,
                  int peer = -1) const {
    MPI_Status status{};
    Timeout waited{};
    const bool done = wait_until(timeout_, [&] {
      int complete = 0;
      check(MPI_Test(&request, &complete, &status), call);
      return complete != 0;
    }, waited);
    if (!done) fail_timeout(call, count, type, peer, waited);
    return status;
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
  Timeout timeout_;
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
// in seconds, else 600): see MpiComm. After a call
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
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (comm::detail::MpiFailure::happened())
      MPI_Abort(MPI_COMM_WORLD, 1);
    else if (owned_)
      MPI_Finalize();
  }

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int local_rank() const { return local_rank_; }  // among the ranks on this node
  int local_size() const { return local_size_; }
  comm::MpiComm world() const { return *world_; }

  // For communicators made from world() from now on (the trainer makes its
  // own when it is constructed).
  void set_collective_timeout(comm::Timeout timeout) {
    world_ = comm::MpiComm::world(timeout);
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
