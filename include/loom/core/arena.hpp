// A memory arena: one aligned allocation, carved into buffers up front, so a
// training step never allocates. Sized from the network's compile-time plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>

#include "error.hpp"

namespace loom {

template <class T>
class Arena {
 public:
  // 64 bytes: a cache line, and the widest vector load the CPU backend issues.
  static constexpr std::size_t alignment = 64;

  Arena() = default;
  Arena(std::size_t capacity, std::string owner) : owner_(std::move(owner)) { reserve(capacity); }

  // Drops every carved buffer and makes room for `capacity` elements.
  void reserve(std::size_t capacity) {
    used_ = 0;
    if (capacity <= capacity_) return;
    const std::size_t padded = capacity + alignment / sizeof(T);
    try {
      storage_.reset(new T[padded]());
    } catch (const std::bad_alloc&) {
      LOOM_FAIL("out of host memory: ", owner_, " needs ", padded * sizeof(T),
                " bytes; use a smaller batch size");
    }
    capacity_ = capacity;
  }

  // A buffer of n elements, aligned; throws instead of overrunning the plan.
  T* take(std::size_t n) {
    const std::size_t step = alignment / sizeof(T);
    const std::size_t start = (used_ + step - 1) / step * step;
    LOOM_CHECK(start + n <= capacity_, owner_, ": memory plan exceeded (", start + n,
               " elements requested, ", capacity_, " planned)");
    used_ = start + n;
    return aligned_base() + start;
  }

  std::size_t capacity() const { return capacity_; }

  // Room needed to carve buffers of the given sizes with take().
  static constexpr std::size_t padded_size(std::size_t n) {
    const std::size_t step = alignment / sizeof(T);
    return (n + step - 1) / step * step;
  }

 private:
  T* aligned_base() {
    auto address = reinterpret_cast<std::uintptr_t>(storage_.get());
    const std::uintptr_t aligned = (address + alignment - 1) / alignment * alignment;
    return reinterpret_cast<T*>(aligned);
  }

  std::string owner_ = "arena";
  std::unique_ptr<T[]> storage_;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
};

}  // namespace loom
