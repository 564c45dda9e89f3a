// Convolution lowering for the CPU backend: im2col gathers every receptive
// field of the whole batch into one column matrix, so a layer's convolution is
// one large GEMM (OpenBLAS is fastest on large shapes) instead of N small ones.
//
// Layouts: x is N x C x H x W; col is (C*K*K) x (N*OH*OW), row (c, ki, kj),
// column (n, oh, ow). Zero padding reads as 0 and receives no gradient.
#pragma once

#include <cstddef>


namespace loom::cpu {

struct ConvGeometry {
  std::size_t batch, channels, height, width;
  std::size_t kernel, stride, pad;
  std::size_t out_height, out_width;

  std::size_t plane() const { return out_height * out_width; }
  std::size_t rows() const { return channels * kernel * kernel; }
  std::size_t cols() const { return batch * plane(); }
};

template <class T>
void im2col(const ConvGeometry& g, const T* x, T* col) {
  for (std::size_t r = 0; r < g.rows(); ++r) {
    const std::size_t c = r / (g.kernel * g.kernel);
    const std::size_t ki = r / g.kernel % g.kernel;
    const std::size_t kj = r % g.kernel;
    T* out = col + r * g.cols();
    for (std::size_t n = 0; n < g.batch; ++n) {
      const T* image = x + (n * g.channels + c) * g.height * g.width;
      for (std::size_t oh = 0; oh < g.out_height; ++oh) {
        // Signed arithmetic: with padding the window may start above row 0.
        const long h = static_cast<long>(oh * g.stride + ki) - static_cast<long>(g.pad);
        const bool row_inside = h >= 0 && h < static_cast<long>(g.height);
        for (std::size_t ow = 0; ow < g.out_width; ++ow) {
          const long w = static_cast<long>(ow * g.stride + kj) - static_cast<long>(g.pad);
          const bool inside = row_inside && w >= 0 && w < static_cast<long>(g.width);
          *out++ = inside ? image[static_cast<std::size_t>(h) * g.width + static_cast<std::size_t>(w)]
                          : T(0);
        }
      }
    }
  }
}

// dx = col2im(dcol): every column entry is added back to the pixel it came
// from.
template <class T>
void col2im(const ConvGeometry& g, const T* col, T* dx) {
  for (std::size_t c = 0; c < g.channels; ++c) {
    for (std::size_t n = 0; n < g.batch; ++n) {
      T* image = dx + (n * g.channels + c) * g.height * g.width;
      for (std::size_t i = 0; i < g.height * g.width; ++i) image[i] = T(0);
    }
    for (std::size_t ki = 0; ki < g.kernel; ++ki) {
      for (std::size_t kj = 0; kj < g.kernel; ++kj) {
        const T* in = col + ((c * g.kernel + ki) * g.kernel + kj) * g.cols();
        for (std::size_t n = 0; n < g.batch; ++n) {
          T* image = dx + (n * g.channels + c) * g.height * g.width;
          for (std::size_t oh = 0; oh < g.out_height; ++oh) {
            const long h = static_cast<long>(oh * g.stride + ki) - static_cast<long>(g.pad);
            const bool row_inside = h >= 0 && h < static_cast<long>(g.height);
            for (std::size_t ow = 0; ow < g.out_width; ++ow, ++in) {
              const long w = static_cast<long>(ow * g.stride + kj) - static_cast<long>(g.pad);
              if (row_inside && w >= 0 && w < static_cast<long>(g.width))
                image[static_cast<std::size_t>(h) * g.width + static_cast<std::size_t>(w)] += *in;
            }
          }
        }
      }
    }
  }
}

}  // namespace loom::cpu
