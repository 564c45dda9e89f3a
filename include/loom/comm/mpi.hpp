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
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
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
  static MpiComm world() {
    return MpiComm(std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_WORLD),
                                             [](MPI_Comm* comm) { delete comm; }));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string describe() const {
    return "MpiComm rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    for_chunks(data, [&](T* chunk, int count) {
      check(MPI_Allreduce(MPI_IN_PLACE, chunk, count, detail::mpi_type<T>(), MPI_SUM, *comm_),
            "MPI_Allreduce");
    });
    if (op == ReduceOp::average)
      for (T& x : data) x /= static_cast<T>(size_);
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    check_peer(root, "MPI_Bcast");
    for_chunks(data, [&](T* chunk, int count) {
      check(MPI_Bcast(chunk, count, detail::mpi_type<T>(), root, *comm_), "MPI_Bcast");
    });
  }

  template <Element T>
  void send(std::span<const T> data, int peer) {
    check_peer(peer, "MPI_Send");
    check(MPI_Send(data.data(), to_count(data.size(), "MPI_Send"), detail::mpi_type<T>(), peer,
                   tag, *comm_),
          "MPI_Send");
  }
  template <Element T>
  void recv(std::span<T> data, int peer) {
    check_peer(peer, "MPI_Recv");
    MPI_Status status{};
    check(MPI_Recv(data.data(), to_count(data.size(), "MPI_Recv"), detail::mpi_type<T>(), peer,
                   tag, *comm_, &status),
          "MPI_Recv");
    int received = 0;
    check(MPI_Get_count(&status, detail::mpi_type<T>(), &received), "MPI_Get_count");
    LOOM_CHECK(static_cast<std::size_t>(received) == data.size(), "MPI_Recv on rank ", rank_,
               " of ", size_, ": rank ", peer, " sent ", received, " values but ", data.size(),
               " were expected");
  }

  void barrier() { check(MPI_Barrier(*comm_), "MPI_Barrier"); }

  MpiComm split(int color, int key) {
    auto made = std::shared_ptr<MPI_Comm>(new MPI_Comm(MPI_COMM_NULL), detail::MpiCommFree{});
    check(MPI_Comm_split(*comm_, color, key, made.get()), "MPI_Comm_split");
    return MpiComm(std::move(made));
  }

  // MPI cannot wake a rank waiting in a collective; the failing rank ends its
  // program with an error status, and mpirun ends the others.
  void cancel(const std::string&) {}

  MPI_Comm get() const { return *comm_; }

 private:
  static constexpr int tag = 7;

  explicit MpiComm(std::shared_ptr<MPI_Comm> comm) : comm_(std::move(comm)) {
    check(MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(*comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(*comm_, &size_), "MPI_Comm_size");
  }

  void check(int code, const char* call) const {
    if (code != MPI_SUCCESS)
      LOOM_FAIL(call, " failed on rank ", rank_, " of ", size_, ": ", detail::mpi_error_text(code));
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
  int rank_ = -1;
  int size_ = 0;
};

static_assert(Communicator<MpiComm>);

}  // namespace loom::comm

namespace loom::dist {

// MPI for the life of the object: started if the program has not started it
// (and then finalized at the end), with the thread support loom's
// communication threads need. Works without mpirun too: one rank of one.
class Environment {
 public:
  Environment(int& argc, char**& argv) {
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
    world_ = comm::MpiComm::world();
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
    if (owned_ && !finalized) MPI_Finalize();
  }

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int local_rank() const { return local_rank_; }  // among the ranks on this node
  int local_size() const { return local_size_; }
  comm::MpiComm world() const { return *world_; }

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
  std::optional<comm::MpiComm> world_;  // set once MPI runs
  int local_rank_ = 0;
  int local_size_ = 1;
};

}  // namespace loom::dist
