// NcclComm: one rank per GPU, through NCCL. Several GPUs of one process
// (create_local: ncclCommInitAll; drive each rank from its own thread), or
// one GPU per process (create: rank 0's ncclUniqueId broadcast over another
// communicator, e.g. MpiComm, then ncclCommInitRank).
//
// Buffers are device memory on the rank's GPU. The Communicator calls
// enqueue on the rank's stream and wait for it (the concept's blocking
// meaning); the *_async forms only enqueue, for overlapping a bucket's
// reduction with backward on another stream. Every NCCL status is checked;
// a failure names the call, the rank and NCCL's last error text.
//
// reduce_scatter and all_gather check this rank's sizes (the whole buffer is
// size() * n) but not that every rank passes the same n: that would take
// another collective and a copy to the host per call. Ranks that differ
// wait until the timeout, or NCCL's own error, ends the call.
//
// A wait that lasts longer than the timeout (comm::collective_timeout():
// another rank died or hangs, and its NCCL kernels never complete) aborts
// the communicator with ncclCommAbort, which ends this rank's pending NCCL
// kernels, and raises a loom::Error instead of waiting for ever.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "../backend/cuda/check.hpp"
#include "../backend/cuda/memory.hpp"
#include "../backend/cuda/stream.hpp"
#include "../core/error.hpp"
#include "communicator.hpp"

namespace loom::comm {

namespace detail {

template <class T>
ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (std::is_same_v<T, std::uint64_t>)
    return ncclUint64;
  else
    return ncclInt32;
}

inline ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclAvg; }

}  // namespace detail

class NcclComm {
 public:
  // One rank per device in `devices` (CUDA ordinals), all in this process.
  static std::vector<NcclComm> create_local(const std::vector<int>& devices) {
    LOOM_CHECK(!devices.empty(), "NcclComm::create_local: no devices given");
    std::vector<ncclComm_t> raw(devices.size());
    const ncclResult_t status =
        ncclCommInitAll(raw.data(), static_cast<int>(devices.size()), devices.data());
    LOOM_CHECK(status == ncclSuccess, "ncclCommInitAll over ", devices.size(),
               " GPU(s) failed: ", ncclGetErrorString(status),
               " (NCCL refuses two ranks on one GPU: \"Duplicate GPU detected\")");
    std::vector<NcclComm> ranks;
    for (std::size_t i = 0; i < devices.size(); ++i) ranks.push_back(NcclComm(raw[i], devices[i]));
    return ranks;
  }

  // This process's rank on `device`, one of bootstrap.size() ranks: rank 0
  // makes the NCCL id and bootstrap broadcasts it.
  static NcclComm create(Comm& bootstrap, int device) {
    ncclUniqueId id{};
    static_assert(sizeof(id) % sizeof(std::uint64_t) == 0);
    std::vector<std::uint64_t> words(sizeof(id) / sizeof(std::uint64_t), 0);
    if (bootstrap.rank() == 0) {
      LOOM_NCCL_CHECK(ncclGetUniqueId(&id));
      std::memcpy(words.data(), &id, sizeof(id));
    }
    bootstrap.broadcast(std::span<std::uint64_t>(words), 0);
    std::memcpy(&id, words.data(), sizeof(id));
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    ncclComm_t raw = nullptr;
    const ncclResult_t status = ncclCommInitRank(&raw, bootstrap.size(), id, bootstrap.rank());
    LOOM_CHECK(status == ncclSuccess, "ncclCommInitRank for rank ", bootstrap.rank(), " of ",
               bootstrap.size(), " on cuda:", device, " failed: ", ncclGetErrorString(status));
    return NcclComm(raw, device);
  }

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  int device() const { return state_->device; }
  cudaStream_t stream() const { return state_->stream.get(); }
  ncclComm_t get() const { return state_->comm; }
  std::string describe() const {
    return "NcclComm rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
           " on cuda:" + std::to_string(device());
  }

  template <Element T>
  void all_reduce_async(T* data, std::size_t count, ReduceOp op, cudaStream_t stream) {
    LOOM_CHECK(!state_->aborted, describe(), ": the communicator was aborted");
    check(ncclAllReduce(data, data, count, detail::nccl_type<T>(), detail::nccl_op(op), get(),
                        stream),
          "ncclAllReduce");
  }
  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    on_device();
    all_reduce_async(data.data(), data.size(), op, stream());
    wait("ncclAllReduce");
  }

  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    check_parts(data.size(), out.size(), element_name<T>(), "ncclReduceScatter", "data", "out");
    on_device();
    check(ncclReduceScatter(data.data(), out.data(), out.size(), detail::nccl_type<T>(),
                            detail::nccl_op(op), get(), stream()),
          "ncclReduceScatter");
    wait("ncclReduceScatter");
  }

  // `count` elements of every rank's `mine`, rank r's at all + r x count,
  // enqueued on `stream`.
  template <Element T>
  void all_gather_async(const T* mine, T* all, std::size_t count, cudaStream_t stream) {
    LOOM_CHECK(!state_->aborted, describe(), ": the communicator was aborted");
    check(ncclAllGather(mine, all, count, detail::nccl_type<T>(), get(), stream), "ncclAllGather");
  }
  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    check_parts(all.size(), mine.size(), element_name<T>(), "ncclAllGather", "all", "mine");
    on_device();
    check(ncclAllGather(mine.data(), all.data(), mine.size(), detail::nccl_type<T>(), get(),
                        stream()),
          "ncclAllGather");
    wait("ncclAllGather");
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    check_peer(root, "ncclBroadcast");
    on_device();
    check(ncclBroadcast(data.data(), data.data(), data.size(), detail::nccl_type<T>(), root, get(),
                        stream()),
          "ncclBroadcast");
    wait("ncclBroadcast");
  }

  template <Element T>
  void send(std::span<const T> data, int peer) {
    check_peer(peer, "ncclSend");
    on_device();
    check(ncclSend(data.data(), data.size(), detail::nccl_type<T>(), peer, get(), stream()),
          "ncclSend");
    wait("ncclSend");
  }
  template <Element T>
  void recv(std::span<T> data, int peer) {
    check_peer(peer, "ncclRecv");
    on_device();
    check(ncclRecv(data.data(), data.size(), detail::nccl_type<T>(), peer, get(), stream()),
          "ncclRecv");
    wait("ncclRecv");
  }

  // Waits for `event` (recorded after this communicator's kernels, e.g. a
  // step's reductions) like cudaEventSynchronize, but gives up after the
  // timeout: the communicator is aborted and the call raises.
  void wait_event(cudaEvent_t event, const char* what) { wait_until_done(event, nullptr, what); }

  Timeout timeout() const { return state_->timeout; }
  void set_timeout(Timeout timeout) {
    LOOM_CHECK(timeout.count() > 0.0, describe(), ": the timeout must be positive, got ",
               timeout.count(), " s");
    state_->timeout = timeout;
  }

  // An all-reduce of one value in device memory: returns when every rank came.
  void barrier() {
    on_device();
    all_reduce_async(state_->token.data(), 1, ReduceOp::sum, stream());
    wait("barrier (ncclAllReduce of one value)");
  }

  // The mesh's groups are split from one root with shared resources
  // (splitShare): a rank's data, pipe and tensor groups reuse the root's
  // proxy threads and buffers instead of each setting up its own.
  NcclComm split(int color, int key) {
    on_device();
    ncclComm_t made = nullptr;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.splitShare = state_->share_on_split ? 1 : 0;
    check(ncclCommSplit(get(), color, key, &made, &config), "ncclCommSplit");
    LOOM_CHECK(made != nullptr, describe(), ": ncclCommSplit gave no communicator for color ",
               color);
    NcclComm part(made, device());
    part.set_timeout(timeout());
    part.set_share_on_split(state_->share_on_split);
    return part;
  }

  // Whether split() shares this communicator's resources with its parts
  // (above; the default), which inherit the choice. A GPU stage's links
  // do not: its outbox threads and its own thread drive them at once, and
  // nothing here relies on communicators that share resources running
  // concurrently.
  void set_share_on_split(bool share) { state_->share_on_split = share; }

  // Ends this rank's pending NCCL operations and frees the communicator;
  // every later call raises. (The other ranks are not told: under mpirun the
  // failing process's exit ends them.)
  void cancel(const std::string&) {
    if (!state_->aborted) {
      state_->aborted = true;
      LOOM_CUDA_RELEASE(ncclCommAbort(state_->comm));
      state_->comm = nullptr;
    }
  }

 private:
  struct State {
    ncclComm_t comm = nullptr;
    int rank = 0, size = 0, device = 0;
    bool aborted = false;
    bool share_on_split = true;
    Timeout timeout = collective_timeout();
    gpu::Stream stream;
    gpu::DeviceBuffer<std::int32_t> token;
    State(ncclComm_t c, int d) : comm(c), device(d), token(1, "NcclComm barrier token") {}
    ~State() {
      if (!aborted) LOOM_CUDA_RELEASE(ncclCommDestroy(comm));
    }
  };

  NcclComm(ncclComm_t comm, int device) {
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    state_ = std::make_shared<State>(comm, device);
    LOOM_NCCL_CHECK(ncclCommUserRank(comm, &state_->rank));
    LOOM_NCCL_CHECK(ncclCommCount(comm, &state_->size));
    LOOM_CUDA_CHECK(cudaMemset(state_->token.data(), 0, sizeof(std::int32_t)));
  }

  void on_device() const {
    LOOM_CHECK(!state_->aborted, describe(), ": the communicator was aborted");
    LOOM_CUDA_CHECK(cudaSetDevice(device()));
  }

  void check(ncclResult_t status, const char* call) const {
    if (status != ncclSuccess)
      LOOM_FAIL(call, " failed on ", describe(), ": ", ncclGetErrorString(status), " (",
                get() != nullptr ? ncclGetLastError(get()) : "aborted", ")");
  }
  void wait(const char* call) { wait_until_done(nullptr, stream(), call); }

  // Polls the event (or the stream) and NCCL's asynchronous error until the
  // work is done; past the timeout it aborts the communicator and raises.
  void wait_until_done(cudaEvent_t event, cudaStream_t stream, const char* call) {
    LOOM_CHECK(!state_->aborted, describe(), ": the communicator was aborted");
    Timeout waited{};
    const bool done = wait_until(state_->timeout, [&] {
      const cudaError_t status = event != nullptr ? cudaEventQuery(event) : cudaStreamQuery(stream);
      if (status != cudaSuccess && status != cudaErrorNotReady)
        LOOM_FAIL(call, " failed on ", describe(), ": ", cudaGetErrorString(status));
      ncclResult_t async = ncclSuccess;
      check(ncclCommGetAsyncError(get(), &async), "ncclCommGetAsyncError");
      check(async, call);
      return status == cudaSuccess;
    }, waited);
    if (done) return;
    const std::string who = describe();
    cancel("timeout");
    LOOM_FAIL(call, " on ", who, " timed out after ", waited.count(), " s (timeout ",
              state_->timeout.count(),
              " s): another rank died, hangs or made a different call. The communicator was "
              "aborted (ncclCommAbort). A rank that legitimately takes longer between "
              "collectives needs a larger timeout (LOOM_COLLECTIVE_TIMEOUT, in seconds)");
  }
  // This rank's sizes for reduce_scatter and all_gather (see the top comment).
  void check_parts(std::size_t whole, std::size_t part, const char* type, const char* call,
                   const char* whole_name, const char* part_name) const {
    const auto expected = static_cast<std::size_t>(size()) * part;
    LOOM_CHECK(whole == expected, call, " on ", describe(), ": ", whole_name, " has ", whole, " ",
               type, " and ", part_name, " ", part, "; ", whole_name, " must hold size() * ",
               part_name, ".size() = ", expected, " elements");
  }
  void check_peer(int peer, const char* call) const {
    LOOM_CHECK(peer >= 0 && peer < size(), call, " on ", describe(), ": rank ", peer,
               " does not exist");
  }

  std::shared_ptr<State> state_;
};

static_assert(Communicator<NcclComm>);

}  // namespace loom::comm
