// RAII for CUDA streams and events, every call checked.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "check.hpp"

namespace loom::gpu {

class Stream {
 public:
  // Non-blocking: work on it does not wait for the legacy default stream.
  Stream() { LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    std::swap(stream_, other.stream_);
    return *this;
  }
  ~Stream() {
    if (stream_ != nullptr) LOOM_CUDA_RELEASE(cudaStreamDestroy(stream_));
  }

  cudaStream_t get() const { return stream_; }
  void synchronize() const { LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  // Without timing: cheaper to record, and all the ordering needs.
  Event() { LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    std::swap(event_, other.event_);
    return *this;
  }
  ~Event() {
    if (event_ != nullptr) LOOM_CUDA_RELEASE(cudaEventDestroy(event_));
  }

  void record(cudaStream_t stream) { LOOM_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  // Makes later work on `stream` wait for what was recorded, without blocking the host.
  void wait_on(cudaStream_t stream) const {
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }
  void synchronize() const { LOOM_CUDA_CHECK(cudaEventSynchronize(event_)); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace loom::gpu
