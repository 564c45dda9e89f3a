// HostStagedComm: a communicator over buffers in one GPU's memory for ranks
// that cannot use NCCL between them (several ranks on one GPU, which NCCL
// refuses): each call copies its device data to the host, makes the same
// call on a host communicator (LocalComm, MpiComm, MixedComm) and copies the
// result back. Correct and slow; where every rank has a GPU of its own, a
// GPU stage uses NcclComm instead (gpu/stage.cuh).
//
// Each copy runs on the communicator's own stream and is waited for, so the
// data is on the device before the call returns (a pageable
// cudaMemcpy may return before its copy lands, and loom's streams do not
// wait for the legacy default stream). The staging buffers are the
// communicator's: one thread calls it at a time, as NCCL's communicators
// are used (a GPU stage gives each of its links one of its own).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../backend/cuda/check.hpp"
#include "../backend/cuda/stream.hpp"
#include "../core/error.hpp"
#include "communicator.hpp"

namespace loom::comm {

class HostStagedComm {
 public:
  // Buffers are device memory of CUDA device `device`; `inner` carries them.
  HostStagedComm(Comm inner, int device)
      : inner_(std::move(inner)), staging_(std::make_shared<Staging>(device)) {
    LOOM_CHECK(static_cast<bool>(inner_), "HostStagedComm on cuda:", device,
               ": no host communicator to stage through");
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  int device() const { return staging_->device; }
  std::string describe() const {
    return inner_.describe() + ", staged through the host from cuda:" + std::to_string(device());
  }

  template <Element T>
  void all_reduce(std::span<T> data, ReduceOp op) {
    auto host = to_host(std::span<const T>(data), staging_->in);
    inner_.all_reduce(host, op);
    to_device(std::span<const T>(host), data);
  }

  template <Element T>
  void reduce_scatter(std::span<const T> data, std::span<T> out, ReduceOp op) {
    auto host = to_host(data, staging_->in);
    auto part = room<T>(out.size(), staging_->out);
    inner_.reduce_scatter(std::span<const T>(host), part, op);
    to_device(std::span<const T>(part), out);
  }

  template <Element T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    auto host = to_host(mine, staging_->in);
    auto gathered = room<T>(all.size(), staging_->out);
    inner_.all_gather(std::span<const T>(host), gathered);
    to_device(std::span<const T>(gathered), all);
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    auto host = to_host(std::span<const T>(data), staging_->in);
    inner_.broadcast(host, root);
    to_device(std::span<const T>(host), data);
  }

  void send(std::span<const float> data, int peer) {
    inner_.send(std::span<const float>(to_host(data, staging_->in)), peer);
  }
  void recv(std::span<float> data, int peer) {
    auto host = room<float>(data.size(), staging_->in);
    inner_.recv(host, peer);
    to_device(std::span<const float>(host), data);
  }

  void barrier() { inner_.barrier(); }

  // The same split of the host communicator, staged from the same device.
  HostStagedComm split(int color, int key) { return {inner_.split(color, key), device()}; }

  void cancel(const std::string& why) { inner_.cancel(why); }

 private:
  struct Staging {
    int device;
    gpu::Stream stream;  // made on `device` (see current())
    std::vector<unsigned char> in, out;
    explicit Staging(int d) : device(current(d)) {}
  };

  // Makes `device` current for what follows (the stream's creation, a copy
  // from a thread that never chose a device) and returns it.
  static int current(int device) {
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    return device;
  }

  // n elements of T in `buffer`, grown as needed (new[] storage is aligned
  // for every element type a communicator carries).
  template <class T>
  static std::span<T> room(std::size_t n, std::vector<unsigned char>& buffer) {
    if (buffer.size() < n * sizeof(T)) buffer.resize(n * sizeof(T));
    return {reinterpret_cast<T*>(buffer.data()), n};
  }

  template <class T>
  std::span<T> to_host(std::span<const T> data, std::vector<unsigned char>& buffer) {
    auto host = room<T>(data.size(), buffer);
    copy(host.data(), data.data(), data.size_bytes());
    return host;
  }

  template <class T>
  void to_device(std::span<const T> host, std::span<T> data) {
    copy(data.data(), host.data(), host.size_bytes());
  }

  void copy(void* to, const void* from, std::size_t bytes) {
    if (bytes == 0) return;
    current(device());
    LOOM_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, staging_->stream.get()));
    staging_->stream.synchronize();
  }

  Comm inner_;
  std::shared_ptr<Staging> staging_;
};

static_assert(Communicator<HostStagedComm>);

}  // namespace loom::comm
