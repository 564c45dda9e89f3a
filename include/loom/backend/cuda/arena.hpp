// One device allocation, carved into the buffers its owner needs (the
// layers': parameters, gradients, optimizer state, activations, workspaces;
// a step's: its scalars, flags and input slots), sized from the
// compile-time memory plan: no cudaMalloc inside a step.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "memory.hpp"

namespace loom::gpu {

class DeviceArena {
 public:
  // 256 bytes: cudaMalloc's own alignment, which cuBLASLt and cuDNN expect
  // for their fastest paths.
  static constexpr std::size_t alignment = 256;

  DeviceArena(std::size_t bytes, std::string owner)
      : owner_(std::move(owner)), storage_(bytes, owner_), capacity_(bytes) {}

  // Room needed for n elements of T, padded to the alignment.
  template <class T>
  static constexpr std::size_t padded_bytes(std::size_t n) {
    return (n * sizeof(T) + alignment - 1) / alignment * alignment;
  }

  template <class T>
  T* take(std::size_t n) {
    const std::size_t bytes = padded_bytes<T>(n);
    LOOM_CHECK(used_ + bytes <= capacity_, owner_, ": device memory plan exceeded (", used_ + bytes,
               " bytes requested, ", capacity_, " planned)");
    T* buffer = reinterpret_cast<T*>(storage_.data() + used_);
    used_ += bytes;
    return buffer;
  }

  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return used_; }

 private:
  std::string owner_;
  DeviceBuffer<unsigned char> storage_;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
};

// The arena for the buffers `lay_out(take)` names, each as take(pointer,
// count): run once to size the arena, once to hand the buffers out, so the
// plan and the buffers cannot disagree.
template <class LayOut>
std::unique_ptr<DeviceArena> make_arena(LayOut&& lay_out, std::string owner) {
  std::size_t bytes = 0;
  lay_out([&]<class T>(T*&, std::size_t count) { bytes += DeviceArena::padded_bytes<T>(count); });
  auto arena = std::make_unique<DeviceArena>(bytes, std::move(owner));
  lay_out([&]<class T>(T*& p, std::size_t count) { p = arena->template take<T>(count); });
  return arena;
}

}  // namespace loom::gpu
