// Softmax + cross-entropy on the GPU, forward and backward in one kernel (one
// warp per row: rows are short, 10 classes for LeNet), then the loss and
// correct-count sums with CUB. cpu::softmax_xent's formulas, in its order
// within a row; CUDA's exp and log, the warp's sum of the exponentials and
// CUB's sum over the rows differ from the CPU's by ULPs.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_reduce.cuh>

#include "../cpu/softmax_xent.hpp"
#include "check.hpp"
#include "memory.hpp"

namespace loom::gpu {

namespace kernels {

constexpr unsigned full_mask = 0xffffffffu;

template <class T>
__global__ void softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                             std::size_t classes, T global_batch, const float* loss_scale,
                             T* dlogits, double* row_loss, int* row_correct,
                             unsigned long long* first_bad_row) {
  const std::size_t warps = blockDim.x / 32;
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * warps + threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (row >= batch) return;
  const T* x = logits + row * classes;

  // Arg-max, first maximum winning as on the CPU: each lane scans its classes
  // in order, then lanes merge preferring the larger value, then the lower index.
  T best = x[0];
  std::size_t best_index = 0;
  for (std::size_t c = lane; c < classes; c += 32)
    if (x[c] > best) {
      best = x[c];
      best_index = c;
    }
  for (unsigned offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_down_sync(full_mask, best, offset);
    const auto other_index = __shfl_down_sync(full_mask, best_index, offset);
    if (other > best || (other == best && other_index < best_index)) {
      best = other;
      best_index = other_index;
    }
  }
  best = __shfl_sync(full_mask, best, 0);
  best_index = __shfl_sync(full_mask, best_index, 0);

  T total = T(0);
  for (std::size_t c = lane; c < classes; c += 32) total += exp(x[c] - best);
  for (unsigned offset = 16; offset > 0; offset /= 2)
    total += __shfl_xor_sync(full_mask, total, offset);
  const T log_total = log(total);

  const std::int32_t label = labels[row];
  if (label < 0 || static_cast<std::size_t>(label) >= classes) {
    if (lane == 0) atomicMin(first_bad_row, static_cast<unsigned long long>(row));
    return;
  }
  if (lane == 0) {
    // The CPU's order (0 - (x - top - log total): a confident row keeps
    // log_total's digits); a subtraction, not a negation, which would give
    // a NaN loss the sign bit ("-nan").
    row_loss[row] = 0.0 - static_cast<double>(x[label] - best - log_total);
    row_correct[row] = best_index == static_cast<std::size_t>(label) ? 1 : 0;
  }
  if (dlogits == nullptr) return;
  // cpu::softmax_xent's factor, loss_scale / global_batch, in T.
  const T grad_scale = (loss_scale != nullptr ? T(*loss_scale) : T(1)) / global_batch;
  for (std::size_t c = lane; c < classes; c += 32) {
    const T p = exp(x[c] - best - log_total);
    dlogits[row * classes + c] =
        (p - (c == static_cast<std::size_t>(label) ? T(1) : T(0))) * grad_scale;
  }
}

}  // namespace kernels

class SoftmaxXentWorkspace;

// Enqueues the kernel and the reductions only (no host wait, nothing copied
// from the host), so a CUDA graph can capture it: the sums land in
// ws.loss_sum()/ws.correct(), a label outside [0, classes) in ws.bad_row().
// dlogits (optional) receives d(mean loss over global_batch)/d(logits),
// times *loss_scale when that device scalar is given (fp16's loss scaling:
// read when the kernel runs, so a captured step takes each step's scale).
template <class T>
void softmax_xent_async(const T* logits, const std::int32_t* labels, std::size_t batch,
                        std::size_t classes, std::size_t global_batch, T* dlogits,
                        SoftmaxXentWorkspace& ws, cudaStream_t stream,
                        const float* loss_scale = nullptr);

// Buffers for up to `max_batch` rows, allocated once, so a step allocates nothing.
class SoftmaxXentWorkspace {
 public:
  explicit SoftmaxXentWorkspace(std::size_t max_batch)
      : max_batch_(max_batch),
        row_loss_(max_batch, "softmax cross-entropy row losses"),
        row_correct_(max_batch, "softmax cross-entropy row hits"),
        sums_(1, "softmax cross-entropy loss sum"),
        hits_(1, "softmax cross-entropy correct count"),
        bad_row_(1, "softmax cross-entropy label check") {
    std::size_t loss_bytes = 0, hit_bytes = 0;
    LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, loss_bytes, row_loss_.data(), sums_.data(),
                                           static_cast<int>(max_batch)));
    LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, hit_bytes, row_correct_.data(), hits_.data(),
                                           static_cast<int>(max_batch)));
    temp_ = DeviceBuffer<unsigned char>(std::max(loss_bytes, hit_bytes), "CUB reduction scratch");
  }

  std::size_t max_batch() const { return max_batch_; }
  // The last batch's sums and the first row whose label was out of range
  // (all ones when none), on the device.
  const double* loss_sum() const { return sums_.data(); }
  const int* correct() const { return hits_.data(); }
  const unsigned long long* bad_row() const { return bad_row_.data(); }

  template <class T>
  friend void softmax_xent_async(const T*, const std::int32_t*, std::size_t, std::size_t,
                                 std::size_t, T*, SoftmaxXentWorkspace&, cudaStream_t,
                                 const float*);

 private:
  std::size_t max_batch_;
  DeviceBuffer<double> row_loss_;
  DeviceBuffer<int> row_correct_;
  DeviceBuffer<double> sums_;
  DeviceBuffer<int> hits_;
  DeviceBuffer<unsigned long long> bad_row_;
  DeviceBuffer<unsigned char> temp_;
};

template <class T>
void softmax_xent_async(const T* logits, const std::int32_t* labels, std::size_t batch,
                        std::size_t classes, std::size_t global_batch, T* dlogits,
                        SoftmaxXentWorkspace& ws, cudaStream_t stream, const float* loss_scale) {
  LOOM_CHECK(batch >= 1 && batch <= ws.max_batch_, "softmax_xent: ", batch,
             " rows but the workspace holds 1 to ", ws.max_batch_);
  // All ones: "no bad row" (atomicMin keeps the first bad one).
  LOOM_CUDA_CHECK(cudaMemsetAsync(ws.bad_row_.data(), 0xff, sizeof(unsigned long long), stream));
  constexpr unsigned threads = 256;  // 8 rows per block
  const auto blocks = static_cast<unsigned>((batch + threads / 32 - 1) / (threads / 32));
  kernels::softmax_xent<T><<<blocks, threads, 0, stream>>>(
      logits, labels, batch, classes, static_cast<T>(global_batch), loss_scale, dlogits,
      ws.row_loss_.data(), ws.row_correct_.data(), ws.bad_row_.data());
  LOOM_CUDA_LAUNCH_CHECK("softmax_xent");
  std::size_t bytes = ws.temp_.size();
  LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(ws.temp_.data(), bytes, ws.row_loss_.data(),
                                         ws.sums_.data(), static_cast<int>(batch), stream));
  bytes = ws.temp_.size();
  LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(ws.temp_.data(), bytes, ws.row_correct_.data(),
                                         ws.hits_.data(), static_cast<int>(batch), stream));
}

// The sums of the last softmax_xent_async on `stream`, read back once it
// has run (waits): the loss, the correct count and the first row whose
// label is outside the classes (all ones when none).
struct SoftmaxXentSums {
  double loss = 0.0;
  int correct = 0;
  unsigned long long bad_row = ~0ull;
};
inline SoftmaxXentSums read_sums(const SoftmaxXentWorkspace& ws, cudaStream_t stream) {
  SoftmaxXentSums sums;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&sums.loss, ws.loss_sum(), sizeof sums.loss,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&sums.correct, ws.correct(), sizeof sums.correct,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&sums.bad_row, ws.bad_row(), sizeof sums.bad_row,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return sums;
}

// softmax_xent_async, then waits for `stream` and returns the sums, or the
// CPU's error for a label outside the classes: for tests and callers that
// want the loss of one batch now.
template <class T>
cpu::LossSums softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                           std::size_t classes, std::size_t global_batch, T* dlogits,
                           SoftmaxXentWorkspace& ws, cudaStream_t stream) {
  if (batch == 0) return {};
  softmax_xent_async(logits, labels, batch, classes, global_batch, dlogits, ws, stream);
  const SoftmaxXentSums sums = read_sums(ws, stream);
  if (sums.bad_row != ~0ull) {
    std::int32_t label = 0;
    LOOM_CUDA_CHECK(
        cudaMemcpy(&label, labels + sums.bad_row, sizeof label, cudaMemcpyDeviceToHost));
    LOOM_FAIL("label ", label, " of sample ", sums.bad_row, " is outside the network's ", classes,
              " classes");
  }
  return {sums.loss, static_cast<std::size_t>(sums.correct)};
}

}  // namespace loom::gpu
