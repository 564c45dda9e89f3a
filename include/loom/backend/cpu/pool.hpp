// 2-D max and average pooling over N*C independent planes, no padding,
// floor-mode output size (as cuDNN and PyTorch by default).
#pragma once

#include <cstddef>

#include "../../core/host_device.hpp"

namespace loom::cpu {

// Whether v replaces best as a window's maximum: when larger, or when v is NaN
// and best is not, so a NaN input reaches the loss (and its check) instead of
// vanishing.
template <class T>
LOOM_HOST_DEVICE inline bool takes_max(T v, T best) {
  return v > best || (v != v && best == best);
}

// The helpers below are shared with the CUDA kernels (pool.cuh), so both
// backends reduce a window in the same order.

// Max or average of the k x k window starting at `window` in rows of `width`.
template <bool Max, class T>
LOOM_HOST_DEVICE inline T pool_window(const T* window, std::size_t width, std::size_t k) {
  T acc = Max ? window[0] : T(0);
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t j = 0; j < k; ++j) {
      const T v = window[i * width + j];
      if constexpr (Max)
        acc = takes_max(v, acc) ? v : acc;
      else
        acc += v;
    }
  return Max ? acc : acc * (T(1) / static_cast<T>(k * k));
}

// Offset (from the plane's start) of the first maximum, row-major, of the
// window whose top-left corner is at offset `base`.
template <class T>
LOOM_HOST_DEVICE inline std::size_t window_argmax(const T* plane, std::size_t base,
                                                  std::size_t width, std::size_t k) {
  std::size_t best = base;
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t j = 0; j < k; ++j)
      if (takes_max(plane[base + i * width + j], plane[best])) best = base + i * width + j;
  return best;
}

struct PoolGeometry {
  std::size_t planes;  // batch * channels
  std::size_t height, width, kernel, stride, out_height, out_width;
};

// Max or average over each window (Max chosen at compile time).
template <bool Max, class T>
void pool_forward(const PoolGeometry& g, const T* x, T* y) {
  for (std::size_t pl = 0; pl < g.planes; ++pl) {
    const T* in = x + pl * g.height * g.width;
    T* out = y + pl * g.out_height * g.out_width;
    for (std::size_t oh = 0; oh < g.out_height; ++oh)
      for (std::size_t ow = 0; ow < g.out_width; ++ow)
        out[oh * g.out_width + ow] =
            pool_window<Max>(in + oh * g.stride * g.width + ow * g.stride, g.width, g.kernel);
  }
}

// The gradient goes to the first maximum of each window (row-major), found
// again from x rather than stored: it costs K*K reads and saves a buffer.
template <class T>
void max_pool_backward(const PoolGeometry& g, const T* x, const T* dy, T* dx) {
  for (std::size_t pl = 0; pl < g.planes; ++pl) {
    const T* in = x + pl * g.height * g.width;
    const T* grad = dy + pl * g.out_height * g.out_width;
    T* out = dx + pl * g.height * g.width;
    for (std::size_t i = 0; i < g.height * g.width; ++i) out[i] = T(0);
    for (std::size_t oh = 0; oh < g.out_height; ++oh)
      for (std::size_t ow = 0; ow < g.out_width; ++ow) {
        const std::size_t best =
            window_argmax(in, oh * g.stride * g.width + ow * g.stride, g.width, g.kernel);
        out[best] += grad[oh * g.out_width + ow];
      }
  }
}

template <class T>
void avg_pool_backward(const PoolGeometry& g, const T* dy, T* dx) {
  const T scale = T(1) / static_cast<T>(g.kernel * g.kernel);
  for (std::size_t pl = 0; pl < g.planes; ++pl) {
    const T* grad = dy + pl * g.out_height * g.out_width;
    T* out = dx + pl * g.height * g.width;
    for (std::size_t i = 0; i < g.height * g.width; ++i) out[i] = T(0);
    for (std::size_t oh = 0; oh < g.out_height; ++oh)
      for (std::size_t ow = 0; ow < g.out_width; ++ow) {
        T* window = out + oh * g.stride * g.width + ow * g.stride;
        const T share = grad[oh * g.out_width + ow] * scale;
        for (std::size_t i = 0; i < g.kernel; ++i)
          for (std::size_t j = 0; j < g.kernel; ++j) window[i * g.width + j] += share;
      }
  }
}

}  // namespace loom::cpu
