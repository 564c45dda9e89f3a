// The convolution epilogue on the GPU, for when cuDNN's fused
// conv-bias-activation does not apply: bias + activation in place over
// N x C x H x W, and its backward (activation derivative + bias gradient) in
// one kernel. Same arithmetic as the CPU backend's epilogue, whose
// activations (host and device functions) it calls.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "../../core/activation.hpp"
#include "../cpu/epilogue.hpp"
#include "check.hpp"
#include "launch.hpp"

namespace loom::gpu {

namespace kernels {

template <Act A, class T>
__global__ void bias_act_nchw(T* y, const T* bias, std::size_t count, std::size_t channels,
                              std::size_t plane) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    y[i] = cpu::activate<A>(y[i] + bias[i / plane % channels]);
}

// One block per channel: it writes that channel's dz and reduces its bias
// gradient in a fixed order (thread-strided partial sums, then a tree), so
// the result does not vary from run to run.
template <Act A, class T, unsigned Threads>
__global__ void bias_act_backward_nchw(const T* dy, const T* y, T* dz, T* db, std::size_t batch,
                                       std::size_t channels, std::size_t plane, bool accumulate) {
  __shared__ T partial[Threads];
  const std::size_t c = blockIdx.x;
  T sum = T(0);
  for (std::size_t k = threadIdx.x; k < batch * plane; k += Threads) {
    const std::size_t i = (k / plane * channels + c) * plane + k % plane;
    dz[i] = cpu::activate_grad<A>(dy[i], y[i]);
    sum += dz[i];
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (unsigned half = Threads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[c] = accumulate ? db[c] + partial[0] : partial[0];
}

template <Act A, class T>
__global__ void activation_forward(const T* x, T* y, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    y[i] = cpu::activate<A>(x[i]);
}

template <Act A, class T>
__global__ void activation_backward(const T* dy, const T* y, T* dx, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    dx[i] = cpu::activate_grad<A>(dy[i], y[i]);
}

}  // namespace kernels

// Standalone activation layers (an activation the fusion pass left alone).
template <Act A, class T>
void activation_forward(const T* x, T* y, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  kernels::activation_forward<A, T><<<grid_blocks(count), block_threads, 0, stream>>>(x, y, count);
  LOOM_CUDA_LAUNCH_CHECK("activation_forward");
}

template <Act A, class T>
void activation_backward(const T* dy, const T* y, T* dx, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  kernels::activation_backward<A, T>
      <<<grid_blocks(count), block_threads, 0, stream>>>(dy, y, dx, count);
  LOOM_CUDA_LAUNCH_CHECK("activation_backward");
}

template <Act A, class T>
void bias_act_nchw(T* y, const T* bias, std::size_t batch, std::size_t channels, std::size_t plane,
                   cudaStream_t stream) {
  const std::size_t count = batch * channels * plane;
  if (count == 0) return;
  kernels::bias_act_nchw<A, T>
      <<<grid_blocks(count), block_threads, 0, stream>>>(y, bias, count, channels, plane);
  LOOM_CUDA_LAUNCH_CHECK("bias_act_nchw");
}

template <Act A, class T>
void bias_act_backward_nchw(const T* dy, const T* y, T* dz, T* db, std::size_t batch,
                            std::size_t channels, std::size_t plane, bool accumulate,
                            cudaStream_t stream) {
  if (channels == 0) return;
  constexpr unsigned threads = 256;
  kernels::bias_act_backward_nchw<A, T, threads>
      <<<static_cast<unsigned>(channels), threads, 0, stream>>>(dy, y, dz, db, batch, channels,
                                                                plane, accumulate);
  LOOM_CUDA_LAUNCH_CHECK("bias_act_backward_nchw");
}

}  // namespace loom::gpu
