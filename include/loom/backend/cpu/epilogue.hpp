// What runs after a GEMM: bias + activation forward, and the backward
// (activation derivative, then the bias gradient from it).
// Both layouts are covered: "rows" (N x Out, Linear) and "cols" (Out x N*P,
// the convolution GEMM's output, transposed to N x Out x P on the way).
#pragma once

#include <algorithm>
#include <cstddef>

#include "../../core/activation.hpp"
#include "../../core/host_device.hpp"

namespace loom::cpu {

template <Act A, class T>
LOOM_HOST_DEVICE inline T activate(T v) {
  // Written so that NaN passes through (as in PyTorch) and the NaN-loss check sees it.
  if constexpr (A == Act::relu)
    return v < T(0) ? T(0) : v;
  else
    return v;
}

// The derivative expressed through the activation's output y, so backward
// needs only what forward stored: relu'(z) = [z > 0] = [y > 0].
template <Act A, class T>
LOOM_HOST_DEVICE inline T activate_grad(T dy, T y) {
  if constexpr (A == Act::relu)
    return y > T(0) ? dy : T(0);
  else
    return dy;
}

// y[n, o] = act(y[n, o] + bias[o]) in place, after y = x * W^T.
template <Act A, class T>
LOOM_CPU_KERNEL void bias_act_rows(T* y, const T* bias, std::size_t batch, std::size_t out) {
  for (std::size_t n = 0; n < batch; ++n) {
    T* row = y + n * out;
    for (std::size_t o = 0; o < out; ++o) row[o] = activate<A>(row[o] + bias[o]);
  }
}

// db[o] (+)= the sum over n of m[n, o], for m of `rows` x `cols` in row-major
// order. Each column is summed from row 0 down, as a column-at-a-time loop
// sums it (so the bits are the same), but a block of columns at a time,
// reading along the rows: a column-at-a-time loop strode `cols` floats per
// read and missed the cache on each (half of a GPT MLP's backward, 2,048
// rows of 512).
template <class T>
LOOM_CPU_KERNEL void column_sums(const T* m, T* db, std::size_t rows, std::size_t cols,
                                 bool accumulate) {
  constexpr std::size_t block = 256;
  T sums[block];
  for (std::size_t first = 0; first < cols; first += block) {
    const std::size_t width = std::min(block, cols - first);
    for (std::size_t o = 0; o < width; ++o) sums[o] = T(0);
    for (std::size_t n = 0; n < rows; ++n) {
      const T* row = m + n * cols + first;
      for (std::size_t o = 0; o < width; ++o) sums[o] += row[o];
    }
    for (std::size_t o = 0; o < width; ++o)
      db[first + o] = accumulate ? db[first + o] + sums[o] : sums[o];
  }
}

// dz = act'(dy), db (+)= column sums of dz. Sums run over n in order for
// every o: the result does not depend on how the batch is laid out in memory.
template <Act A, class T>
LOOM_CPU_KERNEL void bias_act_backward_rows(const T* dy, const T* y, T* dz, T* db,
                                            std::size_t batch, std::size_t out, bool accumulate) {
  for (std::size_t i = 0; i < batch * out; ++i) dz[i] = activate_grad<A>(dy[i], y[i]);
  column_sums(dz, db, batch, out, accumulate);
}

// A Linear's backward epilogue: dZ = act'(dY) in `work` and db (+)= its
// column sums, returning dZ; without an activation dZ is dY itself, not
// copied (the copy was a pass over every output gradient for nothing).
template <Act A, class T>
const T* linear_dz(const T* dy, const T* y, T* work, T* db, std::size_t batch, std::size_t out,
                   bool accumulate) {
  if constexpr (A == Act::identity) {
    column_sums(dy, db, batch, out, accumulate);
    return dy;
  } else {
    bias_act_backward_rows<A>(dy, y, work, db, batch, out, accumulate);
    return work;
  }
}

// y[n, o, p] = act(cols[o, n * plane + p] + bias[o]).
template <Act A, class T>
void bias_act_cols(const T* cols, const T* bias, T* y, std::size_t batch, std::size_t out,
                   std::size_t plane) {
  for (std::size_t n = 0; n < batch; ++n) {
    for (std::size_t o = 0; o < out; ++o) {
      const T* in = cols + o * batch * plane + n * plane;
      T* dst = y + (n * out + o) * plane;
      for (std::size_t p = 0; p < plane; ++p) dst[p] = activate<A>(in[p] + bias[o]);
    }
  }
}

// dcols[o, n * plane + p] = act'(dy[n, o, p]); db[o] (+)= sum over n, p.
template <Act A, class T>
void bias_act_backward_cols(const T* dy, const T* y, T* dcols, T* db, std::size_t batch,
                            std::size_t out, std::size_t plane, bool accumulate) {
  for (std::size_t o = 0; o < out; ++o) {
    T sum = T(0);
    for (std::size_t n = 0; n < batch; ++n) {
      const T* g = dy + (n * out + o) * plane;
      const T* v = y + (n * out + o) * plane;
      T* dst = dcols + o * batch * plane + n * plane;
      for (std::size_t p = 0; p < plane; ++p) {
        dst[p] = activate_grad<A>(g[p], v[p]);
        sum += dst[p];
      }
    }
    db[o] = accumulate ? db[o] + sum : sum;
  }
}

// Standalone activation layers (unfused networks).
template <Act A, class T>
LOOM_CPU_KERNEL void activation_forward(const T* x, T* y, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) y[i] = activate<A>(x[i]);
}

template <Act A, class T>
LOOM_CPU_KERNEL void activation_backward(const T* dy, const T* y, T* dx, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dx[i] = activate_grad<A>(dy[i], y[i]);
}

}  // namespace loom::cpu
