// fp16's dynamic loss scaling (optim/loss_scaler.hpp) on the device. The
// host reads a step's loss late (a step never waits for it), so under
// SingleDevice and DataParallel the scale cannot come from the host: it
// lives on the device, the loss gradient is multiplied by it when the loss
// kernel runs, and after backward (and the all-reduce) one pass divides
// the gradients by it again and flags an overflow, and one thread updates
// it as LossScaler::update does, with the same float arithmetic. (A
// pipeline's host reads every step's end: its stages take the trainer's
// scale and use only the unscaling pass, scan_gradients.) An overflowed step's update is skipped; one at the
// minimum scale halts the totals (halt_gradient_overflow), as the CPU
// raises, or is skipped as non-finite (Skipped) when such steps are.
// fp32 and bf16 check their gradients with the same scan, unscaled.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../core/precision.hpp"
#include "check.hpp"
#include "launch.hpp"
#include "softmax_xent.cuh"

namespace loom::gpu {

// The scaler's state on the device; a snapshot after each step reaches the host.
struct LossScaleState {
  float scale = 1.0f;
  // The last update was skipped because its unscaled gradients overflowed
  // and the scale backed off (not set for a step skipped as non-finite).
  int overflowed = 0;
  unsigned long long good_steps = 0;     // updates since the last overflow or growth
  unsigned long long skipped_steps = 0;  // updates skipped for an overflow, in all
};

namespace kernels {

// Sets *flag when any of `count` gradients is not finite; with Unscale,
// first multiplies each by 1 / state->scale (the CPU's unscale_gradients:
// the same float reciprocal, then one product each).
template <bool Unscale>
__global__ void scan_gradients(float* grads, std::size_t count, const LossScaleState* state,
                               int* flag) {
  float inverse = 1.0f;
  if constexpr (Unscale) inverse = 1.0f / state->scale;
  bool finite = true;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    float g = grads[i];
    if constexpr (Unscale) {
      g *= inverse;
      grads[i] = g;
    }
    finite = finite && isfinite(g);
  }
  // Every writer writes 1: no race on the value.
  if (__syncthreads_or(finite ? 0 : 1) != 0 && threadIdx.x == 0) *flag = 1;
}

// A step whose loss went non-finite while non-finite steps are skipped
// (LossTotals::skipped) or halted is skipped; so is one whose gradients
// are not finite, and it then halts the totals or, when
// *skip_nonfinite is set, is marked skipped for them (Skipped).
inline __device__ bool skip_for_nonfinite(bool gradients_bad, int halt, const int* skip_nonfinite,
                                          LossTotals* totals) {
  if (totals->halted != halt_none || totals->skipped != skipped_none) return true;
  if (!gradients_bad) return false;
  if (*skip_nonfinite != 0)
    totals->skipped = skipped_gradients;
  else
    totals->halted = halt;
  return true;
}

// One thread, after scan_gradients<false> (fp32, bf16): whether the update
// is skipped.
inline __global__ void decide_update(const int* bad, const int* skip_nonfinite,
                                     LossTotals* totals, int* skip) {
  *skip = skip_for_nonfinite(*bad != 0, halt_nonfinite_gradients, skip_nonfinite, totals) ? 1 : 0;
}

// One thread, after scan_gradients<true> (fp16): whether the update is
// skipped (a halted or non-finite step's, or an overflowed one's), and the
// next scale by `rule` (passed by value). A step halted or skipped as
// non-finite leaves the scale alone (the CPU raises or skips before
// updating it); so does an overflow at the minimum scale, which no smaller
// scale could avoid: the step's gradients count as non-finite.
inline __global__ void update_loss_scale(LossScaleState* state, LossScaling rule,
                                         const int* skip_nonfinite, LossTotals* totals,
                                         int* skip) {
  const bool overflowed = state->overflowed != 0;
  state->overflowed = 0;
  *skip = 1;
  if (skip_for_nonfinite(overflowed && state->scale <= rule.min_scale, halt_gradient_overflow,
                         skip_nonfinite, totals))
    return;
  if (overflowed) {
    state->overflowed = 1;
    state->scale = fmaxf(state->scale * rule.backoff_factor, rule.min_scale);
    state->good_steps = 0;
    state->skipped_steps += 1;
    return;
  }
  *skip = 0;
  if (++state->good_steps >= rule.growth_interval) {
    state->scale = fminf(state->scale * rule.growth_factor, rule.max_scale);
    state->good_steps = 0;
  }
}

// to[i] = from[i] when *flag is set: a skipped step's running statistics
// go back to those of its start.
inline __global__ void copy_if_set(const int* flag, const float* from, float* to,
                                   std::size_t count) {
  if (*flag == 0) return;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    to[i] = from[i];
}

}  // namespace kernels

// Enqueues unscaling `count` gradients by state->scale, flagging an
// overflow in state->overflowed, then the scale's update and *skip.
inline void unscale_and_update(float* grads, std::size_t count, LossScaleState* state,
                               const LossScaling& rule, const int* skip_nonfinite,
                               LossTotals* totals, int* skip, cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(&state->overflowed, 0, sizeof(int), stream));
  if (count > 0) {
    kernels::scan_gradients<true><<<grid_blocks(count), block_threads, 0, stream>>>(
        grads, count, state, &state->overflowed);
    LOOM_CUDA_LAUNCH_CHECK("scan_gradients<true>");
  }
  kernels::update_loss_scale<<<1, 1, 0, stream>>>(state, rule, skip_nonfinite, totals, skip);
  LOOM_CUDA_LAUNCH_CHECK("update_loss_scale");
}

// fp32 and bf16: enqueues checking `count` gradients (the CPU checks them
// before every update too) and deciding *skip (bad: one int of scratch).
inline void check_gradients(const float* grads, std::size_t count, int* bad,
                            const int* skip_nonfinite, LossTotals* totals, int* skip,
                            cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(int), stream));
  if (count > 0) {
    // Read only: Unscale = false never writes the gradients.
    kernels::scan_gradients<false><<<grid_blocks(count), block_threads, 0, stream>>>(
        const_cast<float*>(grads), count, nullptr, bad);
    LOOM_CUDA_LAUNCH_CHECK("scan_gradients<false>");
  }
  kernels::decide_update<<<1, 1, 0, stream>>>(bad, skip_nonfinite, totals, skip);
  LOOM_CUDA_LAUNCH_CHECK("decide_update");
}

// Enqueues to[i] = from[i] for count floats when the device's *flag is set.
inline void copy_if_set(const int* flag, const float* from, float* to, std::size_t count,
                        cudaStream_t stream) {
  if (count == 0) return;
  kernels::copy_if_set<<<grid_blocks(count), block_threads, 0, stream>>>(flag, from, to, count);
  LOOM_CUDA_LAUNCH_CHECK("copy_if_set");
}

}  // namespace loom::gpu
