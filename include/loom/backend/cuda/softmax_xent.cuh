// Softmax + cross-entropy on the GPU, forward and backward in one kernel (one
// warp per row: rows are short, 10 classes for LeNet), then the loss and
// correct-count sums with CUB. The same arithmetic as cpu::softmax_xent.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_reduce.cuh>

#include "../cpu/softmax_xent.hpp"
#include "check.hpp"
#include "memory.hpp"

namespace loom::cuda {

namespace kernels {

constexpr unsigned full_mask = 0xffffffffu;

template <class T>
__global__ void softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                             std::size_t classes, T grad_scale, T* dlogits, double* row_loss,
                             int* row_correct, unsigned long long* first_bad_row) {
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
    row_loss[row] = -static_cast<double>(x[label] - best - log_total);
    row_correct[row] = best_index == static_cast<std::size_t>(label) ? 1 : 0;
  }
  if (dlogits == nullptr) return;
  for (std::size_t c = lane; c < classes; c += 32) {
    const T p = exp(x[c] - best - log_total);
    dlogits[row * classes + c] =
        (p - (c == static_cast<std::size_t>(label) ? T(1) : T(0))) * grad_scale;
  }
}

}  // namespace kernels

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

  template <class T>
  friend cpu::LossSums softmax_xent(const T*, const std::int32_t*, std::size_t, std::size_t,
                                    std::size_t, T*, SoftmaxXentWorkspace&, cudaStream_t);

 private:
  std::size_t max_batch_;
  DeviceBuffer<double> row_loss_;
  DeviceBuffer<int> row_correct_;
  DeviceBuffer<double> sums_;
  DeviceBuffer<int> hits_;
  DeviceBuffer<unsigned long long> bad_row_;
  DeviceBuffer<unsigned char> temp_;
};

// logits and labels on the device; dlogits (optional) receives
// d(mean loss over global_batch)/d(logits). Synchronises `stream` to return
// the sums (the trainer needs the loss on the host to check it).
template <class T>
cpu::LossSums softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                           std::size_t classes, std::size_t global_batch, T* dlogits,
                           SoftmaxXentWorkspace& ws, cudaStream_t stream) {
  LOOM_CHECK(batch <= ws.max_batch_, "softmax_xent: ", batch, " rows but the workspace holds ",
             ws.max_batch_);
  if (batch == 0) return {};
  const unsigned long long none = ~0ull;
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(ws.bad_row_.data(), &none, sizeof none, cudaMemcpyHostToDevice, stream));
  constexpr unsigned threads = 256;  // 8 rows per block
  const auto blocks = static_cast<unsigned>((batch + threads / 32 - 1) / (threads / 32));
  kernels::softmax_xent<T><<<blocks, threads, 0, stream>>>(
      logits, labels, batch, classes, T(1) / static_cast<T>(global_batch), dlogits,
      ws.row_loss_.data(), ws.row_correct_.data(), ws.bad_row_.data());
  LOOM_CUDA_LAUNCH_CHECK("softmax_xent");
  std::size_t bytes = ws.temp_.size();
  LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(ws.temp_.data(), bytes, ws.row_loss_.data(),
                                         ws.sums_.data(), static_cast<int>(batch), stream));
  bytes = ws.temp_.size();
  LOOM_CUDA_CHECK(cub::DeviceReduce::Sum(ws.temp_.data(), bytes, ws.row_correct_.data(),
                                         ws.hits_.data(), static_cast<int>(batch), stream));
  double loss = 0.0;
  int hits = 0;
  unsigned long long bad_row = none;
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&loss, ws.sums_.data(), sizeof loss, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&hits, ws.hits_.data(), sizeof hits, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&bad_row, ws.bad_row_.data(), sizeof bad_row,
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad_row != none) {
    std::int32_t label = 0;
    LOOM_CUDA_CHECK(cudaMemcpy(&label, labels + bad_row, sizeof label, cudaMemcpyDeviceToHost));
    LOOM_FAIL("label ", label, " of sample ", bad_row, " is outside the network's ", classes,
              " classes");
  }
  return {loss, static_cast<std::size_t>(hits)};
}

}  // namespace loom::cuda
