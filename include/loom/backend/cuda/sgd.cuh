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

// clip_gradients' factor for the squared global norm `squares` (1: leave
// the gradients as they are), computed in double as the CPU does.
__device__ inline float clip_factor(const double* squares, const float* max_norm) {
  if (squares == nullptr || max_norm == nullptr || *max_norm <= 0.0f) return 1.0f;
  const double norm = sqrt(*squares);
  const double coefficient = static_cast<double>(*max_norm) / (norm + 1e-6);
  if (!isfinite(norm) || !(coefficient < 1.0)) return 1.0f;
  return static_cast<float>(coefficient);
}

// The gradient an update uses, clipped and with L2 weight decay added,
// rounded as the CPU rounds it: nvcc would contract it into one FMA, and a
// gradient near zero then differs in its leading digits, which Adam's
// g / (|g| + eps) would magnify.
__device__ inline float decayed_gradient(float g, float factor, float l2, float w) {
  return __fadd_rn(__fmul_rn(g, factor), __fmul_rn(l2, w));
}
__device__ inline double decayed_gradient(double g, double factor, double l2, double w) {
  return __dadd_rn(__dmul_rn(g, factor), __dmul_rn(l2, w));
}

// lr_on_device and halted, when given, are read on the device: a captured
// step then follows learning-rate changes, and skips once the loss halted it.
// clip_squares and max_norm, when given, clip the gradients by global norm
// first (clip_factor).
template <class T>
__global__ void sgd_update(T* weights, const T* grads, T* velocity, std::size_t count, T lr,
                           T momentum, T weight_decay, bool nesterov, const T* lr_on_device,
                           const int* halted, const double* clip_squares, const float* max_norm) {
  if (halted != nullptr && *halted != 0) return;
  if (lr_on_device != nullptr) lr = *lr_on_device;
  const T factor = clip_factor(clip_squares, max_norm);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    T g = decayed_gradient(grads[i], factor, weight_decay, weights[i]);
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
                const T* lr_on_device = nullptr, const int* halted = nullptr,
                const double* clip_squares = nullptr, const float* max_norm = nullptr) {
  if (count == 0) return;
  kernels::sgd_update<T><<<grid_blocks(count), block_threads, 0, stream>>>(
      weights, grads, velocity, count, lr, momentum, weight_decay, nesterov, lr_on_device,
      halted, clip_squares, max_norm);
  LOOM_CUDA_LAUNCH_CHECK("sgd_update");
}

}  // namespace loom::gpu
