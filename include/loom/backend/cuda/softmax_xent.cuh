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
    // Not a negation, which would give a NaN loss the sign bit ("-nan").
    row_loss[row] = static_cast<double>(best + log_total - x[label]);
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

// What the loss steps since the last reset added up to, kept on the device
// so that a step never waits for the host. `halted` is sticky: once set, the
// steps after it add nothing and the SGD update skips (it reads the flag).
struct LossTotals {
  double loss = 0.0;  // sum of per-sample losses
  unsigned long long correct = 0;
  unsigned long long samples = 0;
  unsigned long long steps = 0;
  int halted = 0;  // a Halt
  int bad_label = 0;
  unsigned long long bad_row = 0;  // within the batch that halted
  double halt_loss = 0.0;          // that batch's loss sum
  // Skipping non-finite steps (rather than halting): the current optimizer
  // step's update is skipped because its loss or gradients went non-finite
  // (a Skipped), and the sum of its non-finite batch losses (as non-finite
  // as the step's whole sum). Cleared at each step's first batch; a
  // non-finite batch loss is not added to `loss`, its hits and samples are.
  int skipped = 0;
  double nonfinite_loss = 0.0;
};

// Why the current step's update is skipped (LossTotals::skipped).
enum Skipped : int {
  skipped_none = 0,
  skipped_loss = 1,       // a batch's loss is not finite
  skipped_gradients = 2,  // the loss is finite, the summed gradients are not
};

// halt_gradient_overflow: fp16's scaled gradients overflowed at the
// minimum loss scale (loss_scaling.cuh), where backing off cannot help.
// halt_nonfinite_gradients: fp32's or bf16's summed gradients are not
// finite under a finite loss.
enum Halt : int {
  halt_none = 0,
  halt_nonfinite_loss = 1,
  halt_bad_label = 2,
  halt_gradient_overflow = 3,
  halt_nonfinite_gradients = 4,
};

namespace kernels {

// A training batch's non-finite loss: marks the step skipped when
// *skip_nonfinite is set (its samples still count), else halts the totals.
// True when the loss is finite.
inline __device__ bool take_loss(double loss, const int* skip_nonfinite, LossTotals* totals) {
  if (isfinite(loss)) return true;
  if (skip_nonfinite != nullptr && *skip_nonfinite != 0) {
    const bool earlier = totals->skipped == skipped_loss;  // a batch before this one
    totals->nonfinite_loss = earlier ? totals->nonfinite_loss + loss : loss;
    totals->skipped = skipped_loss;
    return false;
  }
  totals->halted = halt_nonfinite_loss;
  totals->halt_loss = loss;
  return false;
}

// One thread: folds a batch's sums into the totals, or halts them.
// skip_nonfinite (device memory, may be null): see take_loss.
inline __global__ void accumulate_loss(const double* loss, const int* hits,
                                       const unsigned long long* bad_row,
                                       const std::int32_t* labels, std::size_t batch,
                                       bool stop_on_nonfinite, const int* skip_nonfinite,
                                       LossTotals* totals) {
  if (totals->halted != halt_none) return;
  if (*bad_row != ~0ull) {
    totals->halted = halt_bad_label;
    totals->bad_row = *bad_row;
    totals->bad_label = labels[*bad_row];
    return;
  }
  if (stop_on_nonfinite && !take_loss(*loss, skip_nonfinite, totals)) {
    if (totals->halted != halt_none) return;
    totals->correct += static_cast<unsigned long long>(*hits);
    totals->samples += batch;
    totals->steps += 1;
    return;
  }
  totals->loss += *loss;
  totals->correct += static_cast<unsigned long long>(*hits);
  totals->samples += batch;
  totals->steps += 1;
}

// Data parallelism: this rank's loss sum, correct count and "a label was
// bad" (0 or 1) as doubles, to be summed over the ranks. A rank with no
// samples this step contributes zeros.
inline __global__ void local_loss_stats(const double* loss, const int* hits,
                                        const unsigned long long* bad_row, bool has_samples,
                                        double* stats) {
  stats[0] = has_samples ? *loss : 0.0;
  stats[1] = has_samples ? static_cast<double>(*hits) : 0.0;
  stats[2] = has_samples && *bad_row != ~0ull ? 1.0 : 0.0;
}

// Folds the ranks' summed stats into the totals: every rank sees the same
// sums, so all halt or none does. The bad row and label are this rank's
// when it had one (else bad_row stays all ones: another rank had it).
inline __global__ void accumulate_global_loss(const double* stats,
                                              const unsigned long long* bad_row,
                                              const std::int32_t* labels, bool has_samples,
                                              std::size_t global_batch, bool stop_on_nonfinite,
                                              const int* skip_nonfinite, LossTotals* totals) {
  if (totals->halted != halt_none) return;
  if (stats[2] > 0.0) {
    totals->halted = halt_bad_label;
    const bool mine = has_samples && *bad_row != ~0ull;
    totals->bad_row = mine ? *bad_row : ~0ull;
    totals->bad_label = mine ? labels[*bad_row] : 0;
    return;
  }
  if (stop_on_nonfinite && !take_loss(stats[0], skip_nonfinite, totals)) {
    if (totals->halted != halt_none) return;
    totals->correct += static_cast<unsigned long long>(stats[1]);
    totals->samples += global_batch;
    totals->steps += 1;
    return;
  }
  totals->loss += stats[0];
  totals->correct += static_cast<unsigned long long>(stats[1]);
  totals->samples += global_batch;
  totals->steps += 1;
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

// Folds the last softmax_xent_async into `totals` (see LossTotals).
// skip_nonfinite: see kernels::take_loss.
inline void accumulate_loss(const SoftmaxXentWorkspace& ws, const std::int32_t* labels,
                            std::size_t batch, bool stop_on_nonfinite, LossTotals* totals,
                            cudaStream_t stream, const int* skip_nonfinite = nullptr) {
  kernels::accumulate_loss<<<1, 1, 0, stream>>>(ws.loss_sum(), ws.correct(), ws.bad_row(), labels,
                                                batch, stop_on_nonfinite, skip_nonfinite, totals);
  LOOM_CUDA_LAUNCH_CHECK("accumulate_loss");
}

// softmax_xent_async, then waits for `stream` and returns the sums: for
// tests and callers that want the loss of one batch now.
template <class T>
cpu::LossSums softmax_xent(const T* logits, const std::int32_t* labels, std::size_t batch,
                           std::size_t classes, std::size_t global_batch, T* dlogits,
                           SoftmaxXentWorkspace& ws, cudaStream_t stream) {
  if (batch == 0) return {};
  softmax_xent_async(logits, labels, batch, classes, global_batch, dlogits, ws, stream);
  double loss = 0.0;
  int hits = 0;
  unsigned long long bad_row = 0;
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&loss, ws.loss_sum(), sizeof loss, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&hits, ws.correct(), sizeof hits, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&bad_row, ws.bad_row(), sizeof bad_row, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad_row != ~0ull) {
    std::int32_t label = 0;
    LOOM_CUDA_CHECK(cudaMemcpy(&label, labels + bad_row, sizeof label, cudaMemcpyDeviceToHost));
    LOOM_FAIL("label ", label, " of sample ", bad_row, " is outside the network's ", classes,
              " classes");
  }
  return {loss, static_cast<std::size_t>(hits)};
}

}  // namespace loom::gpu
