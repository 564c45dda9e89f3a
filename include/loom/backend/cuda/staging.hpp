// Batches to the device: the host batch is copied into pinned memory and on
// to the device on a copy stream of its own, so batch k+1's transfer runs
// while the compute stream trains on batch k (double buffering). Pinned
// memory is what lets cudaMemcpyAsync run truly asynchronously.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

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
  std::size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

struct DeviceBatch {
  const float* images = nullptr;
  const std::int32_t* labels = nullptr;
  std::size_t size = 0;
  int slot = 0;
};

// Where a staged batch goes on the device: two of these, used in turn.
struct StagingSlot {
  float* images = nullptr;
  std::int32_t* labels = nullptr;
};

class BatchStager {
 public:
  // Stages into device buffers of its own.
  BatchStager(std::size_t max_batch, std::size_t sample_size)
      : max_batch_(max_batch), sample_size_(sample_size) {
    for (auto& slot : slots_) {
      pin(slot);
      slot.own_images = DeviceBuffer<float>(max_batch * sample_size, "staged batch images");
      slot.own_labels = DeviceBuffer<std::int32_t>(max_batch, "staged batch labels");
      slot.device = {slot.own_images.data(), slot.own_labels.data()};
    }
  }

  // Stages into the caller's buffers (each holding max_batch samples), e.g.
  // the input slots a DeviceModel's captured steps read.
  BatchStager(std::size_t max_batch, std::size_t sample_size,
              const std::array<StagingSlot, 2>& destinations)
      : max_batch_(max_batch), sample_size_(sample_size) {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      pin(slots_[i]);
      slots_[i].device = destinations[i];
    }
  }

  BatchStager(const BatchStager&) = delete;
  BatchStager& operator=(const BatchStager&) = delete;
  // A copy in flight reads the pinned buffers: it finishes before they go.
  ~BatchStager() { LOOM_CUDA_RELEASE(cudaStreamSynchronize(copy_.get())); }

  // Starts copying a host batch to the device and returns where it will be.
  // Call consumed() once the step that reads it has been enqueued.
  DeviceBatch stage(const float* images, const std::int32_t* labels, std::size_t n) {
    LOOM_CHECK(n <= max_batch_, "BatchStager: a batch of ", n, " samples exceeds the planned ",
               max_batch_);
    const int index = next_;
    next_ = 1 - next_;
    Slot& slot = slots_[index];
    // The pinned buffer is reused only after its previous transfer finished.
    slot.copied.synchronize();
    std::memcpy(slot.host_images.data(), images, n * sample_size_ * sizeof(float));
    std::memcpy(slot.host_labels.data(), labels, n * sizeof(std::int32_t));
    // The device buffer is overwritten only after the step that read it.
    slot.consumed.wait_on(copy_.get());
    LOOM_CUDA_CHECK(cudaMemcpyAsync(slot.device.images, slot.host_images.data(),
                                    n * sample_size_ * sizeof(float), cudaMemcpyHostToDevice,
                                    copy_.get()));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(slot.device.labels, slot.host_labels.data(),
                                    n * sizeof(std::int32_t), cudaMemcpyHostToDevice, copy_.get()));
    slot.copied.record(copy_.get());
    return {slot.device.images, slot.device.labels, n, index};
  }

  // Makes `compute` wait until the batch is on the device.
  void ready(const DeviceBatch& batch, cudaStream_t compute) {
    slots_[batch.slot].copied.wait_on(compute);
  }

  // Marks the point on `compute` after which the batch's device memory may be reused.
  void consumed(const DeviceBatch& batch, cudaStream_t compute) {
    slots_[batch.slot].consumed.record(compute);
  }

 private:
  struct Slot {
    PinnedBuffer<float> host_images;
    PinnedBuffer<std::int32_t> host_labels;
    DeviceBuffer<float> own_images;
    DeviceBuffer<std::int32_t> own_labels;
    StagingSlot device;
    Event copied;
    Event consumed;
  };

  void pin(Slot& slot) const {
    slot.host_images = PinnedBuffer<float>(max_batch_ * sample_size_);
    slot.host_labels = PinnedBuffer<std::int32_t>(max_batch_);
  }

  std::size_t max_batch_;
  std::size_t sample_size_;
  Stream copy_;
  std::array<Slot, 2> slots_;
  int next_ = 0;
};

}  // namespace loom::gpu
