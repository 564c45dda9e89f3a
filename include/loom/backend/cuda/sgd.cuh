// The SGD update on the GPU: one grid-stride pass over the flat parameter
// buffer, the same arithmetic as cpu::sgd_update (PyTorch's semantics).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "check.hpp"
#include "launch.hpp"

namespace loom::gpu {

namespace kernels {

// lr_on_device and halted, when given, are read on the device: a captured
// step then follows learning-rate changes, and skips once the loss halted it.
template <class T>
__global__ void sgd_update(T* weights, const T* grads, T* velocity, std::size_t count, T lr,
                           T momentum, T weight_decay, bool nesterov, const T* lr_on_device,
                           const int* halted) {
  if (halted != nullptr && *halted != 0) return;
  if (lr_on_device != nullptr) lr = *lr_on_device;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    T g = grads[i] + weight_decay * weights[i];
    if (momentum != T(0)) {
      velocity[i] = momentum * velocity[i] + g;
      g = nesterov ? g + momentum * velocity[i] : velocity[i];
    }
    weights[i] -= lr * g;
  }
}

template <class T>
__global__ void add_into(T* destination, const T* source, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    destination[i] += source[i];
}

}  // namespace kernels

// destination += source, elementwise (gradient accumulation).
template <class T>
void add_into(T* destination, const T* source, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  kernels::add_into<T><<<grid_blocks(count), block_threads, 0, stream>>>(destination, source, count);
  LOOM_CUDA_LAUNCH_CHECK("add_into");
}

template <class T>
void sgd_update(T* weights, const T* grads, T* velocity, std::size_t count, T lr, T momentum,
                T weight_decay, bool nesterov, cudaStream_t stream,
                const T* lr_on_device = nullptr, const int* halted = nullptr) {
  if (count == 0) return;
  kernels::sgd_update<T><<<grid_blocks(count), block_threads, 0, stream>>>(
      weights, grads, velocity, count, lr, momentum, weight_decay, nesterov, lr_on_device,
      halted);
  LOOM_CUDA_LAUNCH_CHECK("sgd_update");
}

}  // namespace loom::gpu
