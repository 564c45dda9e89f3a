// 2-D max and average pooling on the GPU: one thread per output (forward) or
// per input pixel (backward, which gathers instead of scattering, so no
// atomics and a fixed summation order). Same rules as the CPU backend: no
// padding, floor-mode sizes, the first maximum of a window takes the
// gradient, NaN wins the maximum.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "../cpu/pool.hpp"
#include "check.hpp"
#include "launch.hpp"

namespace loom::gpu {

namespace kernels {

template <bool Max, class T>
__global__ void pool_forward(cpu::PoolGeometry g, const T* x, T* y) {
  const std::size_t outputs = g.planes * g.out_height * g.out_width;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t o = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < outputs;
       o += stride) {
    const std::size_t plane = o / (g.out_height * g.out_width);
    const std::size_t oh = o / g.out_width % g.out_height, ow = o % g.out_width;
    y[o] = cpu::pool_window<Max>(
        x + plane * g.height * g.width + oh * g.stride * g.width + ow * g.stride, g.width,
        g.kernel);
  }
}

// dx at one input pixel: the sum over the windows that contain it of their
// share (average) or of their gradient if this pixel is their first maximum.
template <bool Max, class T>
__global__ void pool_backward(cpu::PoolGeometry g, const T* x, const T* dy, T* dx) {
  const std::size_t inputs = g.planes * g.height * g.width;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t p = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < inputs;
       p += stride) {
    const std::size_t plane = p / (g.height * g.width);
    const long h = static_cast<long>(p / g.width % g.height), w = static_cast<long>(p % g.width);
    const long k = static_cast<long>(g.kernel), s = static_cast<long>(g.stride);
    // Windows (oh, ow) with oh*s <= h < oh*s + k.
    const long oh_lo = h - k + 1 <= 0 ? 0 : (h - k + 1 + s - 1) / s;
    const long oh_hi =
        h / s < static_cast<long>(g.out_height) ? h / s : static_cast<long>(g.out_height) - 1;
    const long ow_lo = w - k + 1 <= 0 ? 0 : (w - k + 1 + s - 1) / s;
    const long ow_hi =
        w / s < static_cast<long>(g.out_width) ? w / s : static_cast<long>(g.out_width) - 1;
    const T* in = x + plane * g.height * g.width;
    const T* grad = dy + plane * g.out_height * g.out_width;
    T sum = T(0);
    for (long oh = oh_lo; oh <= oh_hi; ++oh)
      for (long ow = ow_lo; ow <= ow_hi; ++ow) {
        const T g_out = grad[oh * static_cast<long>(g.out_width) + ow];
        if constexpr (Max) {
          const auto base = static_cast<std::size_t>(oh * s * static_cast<long>(g.width) + ow * s);
          const std::size_t best = cpu::window_argmax(in, base, g.width, g.kernel);
          if (best == static_cast<std::size_t>(h * static_cast<long>(g.width) + w)) sum += g_out;
        } else {
          sum += g_out * (T(1) / static_cast<T>(k * k));
        }
      }
    dx[p] = sum;
  }
}

}  // namespace kernels

template <bool Max, class T>
void pool_forward(const cpu::PoolGeometry& g, const T* x, T* y, cudaStream_t stream) {
  const std::size_t outputs = g.planes * g.out_height * g.out_width;
  if (outputs == 0) return;
  kernels::pool_forward<Max, T><<<grid_blocks(outputs), block_threads, 0, stream>>>(g, x, y);
  LOOM_CUDA_LAUNCH_CHECK("pool_forward");
}

template <bool Max, class T>
void pool_backward(const cpu::PoolGeometry& g, const T* x, const T* dy, T* dx,
                   cudaStream_t stream) {
  const std::size_t inputs = g.planes * g.height * g.width;
  if (inputs == 0) return;
  kernels::pool_backward<Max, T><<<grid_blocks(inputs), block_threads, 0, stream>>>(g, x, dy, dx);
  LOOM_CUDA_LAUNCH_CHECK("pool_backward");
}

}  // namespace loom::gpu
