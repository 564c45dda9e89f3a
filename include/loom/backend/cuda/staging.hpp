// Host data to the device through pinned memory, which is what lets
// cudaMemcpyAsync run truly asynchronously: PinnedBuffer, and a step's
// scalars through ScalarStager.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "memory.hpp"
#include "stream.hpp"

namespace loom::gpu {

template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t count) : count_(count) {
    if (count == 0) return;
    void* raw = nullptr;
    LOOM_CUDA_CHECK(cudaMallocHost(&raw, count * sizeof(T)));
    data_ = static_cast<T*>(raw);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  ~PinnedBuffer() {
    if (data_ != nullptr) LOOM_CUDA_RELEASE(cudaFreeHost(data_));
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

// A step's small host values (its learning rate and number, the loss scale,
// Dropout's pass, a flag, a norm) copied to the device in a stream's order.
// From pageable memory the driver may synchronise with the stream to stage
// such a copy (CUDA Runtime API, "API synchronization behavior": "If
// pageable memory must first be staged to pinned memory, the driver may
// synchronize with the stream"): the host would wait for the step before
// and lose its one-step run-ahead. So each value goes through a slot of a
// ring of pinned slots, and a slot is written again only once the copy that
// read it has run (an event per slot): the host waits only when it is
// slots() copies ahead of the device. Made with the stream's device current
// (the events are that device's).
class ScalarStager {
 public:
  static constexpr std::size_t slot_bytes = 64;

  // 32: a pipeline stage copies a few values per micro-batch and step, and
  // the host runs one step ahead.
  explicit ScalarStager(std::size_t slots = 32)
      : pinned_(checked(slots) * slot_bytes), copied_(slots) {}
  ScalarStager(const ScalarStager&) = delete;
  ScalarStager& operator=(const ScalarStager&) = delete;
  // A copy in flight reads its slot: it finishes before the slots go.
  ~ScalarStager() {
    for (const Event& copied : copied_) LOOM_CUDA_RELEASE(cudaEventSynchronize(copied.get()));
  }

  // Enqueues *device = value on `stream`; `value` may change once this returns.
  template <class T>
  void copy(T* device, const T& value, cudaStream_t stream) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= slot_bytes,
                  "ScalarStager copies trivially copyable values of at most slot_bytes bytes");
    // A captured copy would read its slot at every replay, long after the
    // slot has taken later values.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LOOM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    LOOM_CHECK(capture == cudaStreamCaptureStatusNone,
               "ScalarStager: a copy of ", sizeof(T), " bytes onto a stream being captured into a "
               "CUDA graph; copy a step's scalars before its capture, into device memory the "
               "graph reads");
    Event& copied = copied_[next_];
    unsigned char* slot = pinned_.data() + next_ * slot_bytes;
    next_ = (next_ + 1) % copied_.size();
    copied.synchronize();  // the slot's last copy has read it (at once if none was recorded)
    std::memcpy(slot, &value, sizeof(T));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(device, slot, sizeof(T), cudaMemcpyHostToDevice, stream));
    copied.record(stream);
  }

  std::size_t slots() const { return copied_.size(); }

 private:
  static std::size_t checked(std::size_t slots) {
    LOOM_CHECK(slots >= 1, "ScalarStager: needs at least one pinned slot");
    return slots;
  }

  PinnedBuffer<unsigned char> pinned_;
  std::vector<Event> copied_;  // each slot's last copy
  std::size_t next_ = 0;
};

}  // namespace loom::gpu
