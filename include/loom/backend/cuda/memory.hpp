// Device memory: an owning buffer whose allocation failure says how much was
// asked for, how much the device had free, and which device it was.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "check.hpp"

namespace loom::gpu {

// Enqueues copying `count` values on `stream`, in the direction `kind` names
// (nothing for none).
template <class T>
void copy_async(T* to, const T* from, std::size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  if (count > 0) LOOM_CUDA_CHECK(cudaMemcpyAsync(to, from, count * sizeof(T), kind, stream));
}

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::size_t count, const std::string& owner) : count_(count) {
    if (count == 0) return;
    const std::size_t bytes = count * sizeof(T);
    void* raw = nullptr;
    const cudaError_t status = cudaMalloc(&raw, bytes);
    if (status != cudaSuccess) {
      cudaGetLastError();  // resets the last-error state so later checks do not report it again
      std::size_t free_bytes = 0, total_bytes = 0;
      const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
      if (status == cudaErrorMemoryAllocation)
        LOOM_FAIL("out of GPU memory on cuda:", detail::current_device(), ": ", owner, " needs ",
                  bytes, " bytes but ", known ? std::to_string(free_bytes) : std::string("?"),
                  " of ", known ? std::to_string(total_bytes) : std::string("?"),
                  " bytes are free; use a smaller batch size");
      LOOM_FAIL("cudaMalloc of ", bytes, " bytes for ", owner,
                " failed on cuda:", detail::current_device(), ": ", cudaGetErrorName(status), " (",
                cudaGetErrorString(status), ")");
    }
    data_ = static_cast<T*>(raw);
  }

  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) LOOM_CUDA_RELEASE(cudaFree(data_));
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace loom::gpu
