// Plain loop implementations of each layer's forward pass, written for
// clarity only: the references the backend ops are tested against.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace loom::test {

struct ConvDims {
  std::size_t n, c, h, w, out, k, stride, pad;
  std::size_t oh() const { return (h + 2 * pad - k) / stride + 1; }
  std::size_t ow() const { return (w + 2 * pad - k) / stride + 1; }
};

// weight [out, c, k, k], bias [out]; x [n, c, h, w] -> y [n, out, oh, ow]
inline std::vector<double> conv_reference(const ConvDims& d, const std::vector<double>& x,
                                          const std::vector<double>& weight,
                                          const std::vector<double>& bias) {
  std::vector<double> y(d.n * d.out * d.oh() * d.ow());
  for (std::size_t b = 0; b < d.n; ++b)
    for (std::size_t o = 0; o < d.out; ++o)
      for (std::size_t i = 0; i < d.oh(); ++i)
        for (std::size_t j = 0; j < d.ow(); ++j) {
          double sum = bias[o];
          for (std::size_t c = 0; c < d.c; ++c)
            for (std::size_t ki = 0; ki < d.k; ++ki)
              for (std::size_t kj = 0; kj < d.k; ++kj) {
                const long r = static_cast<long>(i * d.stride + ki) - static_cast<long>(d.pad);
                const long s = static_cast<long>(j * d.stride + kj) - static_cast<long>(d.pad);
                if (r < 0 || s < 0 || r >= static_cast<long>(d.h) || s >= static_cast<long>(d.w))
                  continue;
                sum += weight[((o * d.c + c) * d.k + ki) * d.k + kj] *
                       x[((b * d.c + c) * d.h + static_cast<std::size_t>(r)) * d.w +
                         static_cast<std::size_t>(s)];
              }
          y[((b * d.out + o) * d.oh() + i) * d.ow() + j] = sum;
        }
  return y;
}

// x [n, in], weight [out, in], bias [out] -> y [n, out]
inline std::vector<double> linear_reference(std::size_t n, std::size_t in, std::size_t out,
                                            const std::vector<double>& x,
                                            const std::vector<double>& weight,
                                            const std::vector<double>& bias) {
  std::vector<double> y(n * out);
  for (std::size_t b = 0; b < n; ++b)
    for (std::size_t o = 0; o < out; ++o) {
      double sum = bias[o];
      for (std::size_t i = 0; i < in; ++i) sum += x[b * in + i] * weight[o * in + i];
      y[b * out + o] = sum;
    }
  return y;
}

// planes of h x w -> planes of oh x ow, window k, stride s
inline std::vector<double> pool_reference(bool max, std::size_t planes, std::size_t h,
                                          std::size_t w, std::size_t k, std::size_t s,
                                          const std::vector<double>& x) {
  const std::size_t oh = (h - k) / s + 1, ow = (w - k) / s + 1;
  std::vector<double> y(planes * oh * ow);
  for (std::size_t p = 0; p < planes; ++p)
    for (std::size_t i = 0; i < oh; ++i)
      for (std::size_t j = 0; j < ow; ++j) {
        double acc = max ? x[(p * h + i * s) * w + j * s] : 0.0;
        for (std::size_t a = 0; a < k; ++a)
          for (std::size_t b = 0; b < k; ++b) {
            const double v = x[(p * h + i * s + a) * w + j * s + b];
            acc = max ? std::max(acc, v) : acc + v;
          }
        y[(p * oh + i) * ow + j] = max ? acc : acc / static_cast<double>(k * k);
      }
  return y;
}

inline std::vector<double> relu_reference(std::vector<double> v) {
  for (auto& e : v) e = std::max(e, 0.0);
  return v;
}

}  // namespace loom::test
