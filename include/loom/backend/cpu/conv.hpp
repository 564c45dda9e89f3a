// Convolution lowering for the CPU backend: im2col gathers every receptive
// field of a chunk of samples into one column matrix, so a layer's
// convolution is one large GEMM per chunk (OpenBLAS is fastest on large
// shapes) instead of one small GEMM per sample.
//
// Layouts: x is N x C x H x W; col is (C*K*K) x (N*OH*OW), row (c, ki, kj),
// column (n, oh, ow). Zero padding reads as 0 and receives no gradient.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

namespace loom::cpu {

// Convolutions run over chunks of at most this many samples, so a chunk's
// column matrix stays in cache: LeNet's conv2 needs 8 MB at 64 samples but
// 32 MB at 256, and batch 256 trained ~15% slower per image unchunked
// (2 cores, OpenBLAS 0.3.21).
inline constexpr std::size_t conv_chunk = 64;

// A chunk also stops at 2 Mi column elements (8 MiB of floats): ResNet's
// first stage (16 channels, 3 x 3, 28 x 28) has 113 K per sample, so 18
// samples, not 64 (29 MiB): 4 % more images/s training ResNet-20 on one
// device (233 -> 243).
inline constexpr std::size_t conv_column_budget = std::size_t{2} << 20;

constexpr std::size_t conv_chunk_for(std::size_t columns_per_sample) {
  return std::clamp<std::size_t>(conv_column_budget / columns_per_sample, 1, conv_chunk);
}

struct ConvGeometry {
  std::size_t batch, channels, height, width;
  std::size_t kernel, stride, pad;
  std::size_t out_height, out_width;

  std::size_t plane() const { return out_height * out_width; }
  std::size_t rows() const { return channels * kernel * kernel; }
  std::size_t cols() const { return batch * plane(); }
};

// The output columns [lo, hi) whose window column kj lands inside the image
// (the rest read padding). Computed once per row so the copies below are
// straight runs: contiguous when the stride is 1.
inline std::pair<std::size_t, std::size_t> inside_columns(const ConvGeometry& g, std::size_t kj) {
  const long offset = static_cast<long>(kj) - static_cast<long>(g.pad);  // w = ow * stride + offset
  const long stride = static_cast<long>(g.stride);
  long lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  long hi = static_cast<long>(g.width) - 1 - offset < 0
                ? 0
                : (static_cast<long>(g.width) - 1 - offset) / stride + 1;
  hi = std::min(hi, static_cast<long>(g.out_width));
  lo = std::min(lo, hi);
  return {static_cast<std::size_t>(lo), static_cast<std::size_t>(hi)};
}

template <class T>
void im2col(const ConvGeometry& g, const T* x, T* col) {
  for (std::size_t r = 0; r < g.rows(); ++r) {
    const std::size_t c = r / (g.kernel * g.kernel);
    const std::size_t ki = r / g.kernel % g.kernel;
    const std::size_t kj = r % g.kernel;
    const auto [lo, hi] = inside_columns(g, kj);
    T* out = col + r * g.cols();
    for (std::size_t n = 0; n < g.batch; ++n) {
      const T* image = x + (n * g.channels + c) * g.height * g.width;
      for (std::size_t oh = 0; oh < g.out_height; ++oh, out += g.out_width) {
        // Signed arithmetic: with padding the window may start above row 0.
        const long h = static_cast<long>(oh * g.stride + ki) - static_cast<long>(g.pad);
        if (h < 0 || h >= static_cast<long>(g.height) || lo == hi) {
          std::fill(out, out + g.out_width, T(0));
          continue;
        }
        // Pixel of output column lo; w >= 0 there by the choice of lo.
        const T* src = image + static_cast<std::size_t>(h) * g.width + lo * g.stride + kj - g.pad;
        std::fill(out, out + lo, T(0));
        for (std::size_t ow = lo; ow < hi; ++ow) out[ow] = src[(ow - lo) * g.stride];
        std::fill(out + hi, out + g.out_width, T(0));
      }
    }
  }
}

// dx = col2im(dcol): every column entry is added back to the pixel it came
// from; padding positions are dropped.
template <class T>
void col2im(const ConvGeometry& g, const T* col, T* dx) {
  std::fill(dx, dx + g.batch * g.channels * g.height * g.width, T(0));
  for (std::size_t r = 0; r < g.rows(); ++r) {
    const std::size_t c = r / (g.kernel * g.kernel);
    const std::size_t ki = r / g.kernel % g.kernel;
    const std::size_t kj = r % g.kernel;
    const auto [lo, hi] = inside_columns(g, kj);
    const T* in = col + r * g.cols();
    for (std::size_t n = 0; n < g.batch; ++n) {
      T* image = dx + (n * g.channels + c) * g.height * g.width;
      for (std::size_t oh = 0; oh < g.out_height; ++oh, in += g.out_width) {
        const long h = static_cast<long>(oh * g.stride + ki) - static_cast<long>(g.pad);
        if (h < 0 || h >= static_cast<long>(g.height) || lo == hi) continue;
        T* dst = image + static_cast<std::size_t>(h) * g.width + lo * g.stride + kj - g.pad;
        for (std::size_t ow = lo; ow < hi; ++ow) dst[(ow - lo) * g.stride] += in[ow];
      }
    }
  }
}

}  // namespace loom::cpu
