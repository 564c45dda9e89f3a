// fp16's dynamic loss scaling (optim/loss_scaler.hpp) on the device. The
// host reads a step's loss late (a step never waits for it), so the scale
// cannot come from the host: it lives on the device, the loss gradient is
// multiplied by it when the loss kernel runs, and after backward (and the
// all-reduce) one pass divides the gradients by it again and flags an
// overflow, and one thread updates it as LossScaler::update does, with the
// same float arithmetic. An overflowed step's update is skipped; one at the
// minimum scale halts the totals (halt_gradient_overflow), as the CPU raises.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../optim/loss_scaler.hpp"
#include "check.hpp"
#include "launch.hpp"
#include "softmax_xent.cuh"

namespace loom::gpu {

// The scaler's state on the device; a snapshot after each step reaches the host.
struct LossScaleState {
  float scale = 1.0f;
  int overflowed = 0;  // the last update's unscaled gradients were not finite: it was skipped
  unsigned long long good_steps = 0;     // updates since the last overflow or growth
  unsigned long long skipped_steps = 0;  // updates skipped for an overflow, in all
};

namespace kernels {

// grads *= 1 / scale (the CPU's unscale_gradients: the same float
// reciprocal, then one product each); any non-finite result flags the step.
inline __global__ void unscale_gradients(float* grads, std::size_t count, LossScaleState* state) {
  const float inverse = 1.0f / state->scale;
  bool finite = true;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const float g = grads[i] * inverse;
    grads[i] = g;
    finite = finite && isfinite(g);
  }
  // Every writer writes 1: no race on the value.
  if (__syncthreads_or(finite ? 0 : 1) != 0 && threadIdx.x == 0) state->overflowed = 1;
}

// One thread, after unscale_gradients: whether the update is skipped (a
// halted step's, or an overflowed one's), and the next scale by `rule`
// (passed by value). A halted step leaves the scale alone (the CPU raises
// before updating it).
inline __global__ void update_loss_scale(LossScaleState* state, LossScaling rule,
                                         LossTotals* totals, int* skip) {
  if (totals->halted != halt_none) {
    state->overflowed = 0;
    *skip = 1;
    return;
  }
  *skip = state->overflowed;
  if (state->overflowed != 0) {
    if (state->scale <= rule.min_scale) {
      totals->halted = halt_gradient_overflow;
      state->overflowed = 0;
      return;
    }
    state->scale = fmaxf(state->scale * rule.backoff_factor, rule.min_scale);
    state->good_steps = 0;
    state->skipped_steps += 1;
  } else if (++state->good_steps >= rule.growth_interval) {
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
                               const LossScaling& rule, LossTotals* totals, int* skip,
                               cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(&state->overflowed, 0, sizeof(int), stream));
  if (count > 0) {
    kernels::unscale_gradients<<<grid_blocks(count), block_threads, 0, stream>>>(grads, count,
                                                                               state);
    LOOM_CUDA_LAUNCH_CHECK("unscale_gradients");
  }
  kernels::update_loss_scale<<<1, 1, 0, stream>>>(state, rule, totals, skip);
  LOOM_CUDA_LAUNCH_CHECK("update_loss_scale");
}

// Enqueues to[i] = from[i] for count floats when the device's *flag is set.
inline void copy_if_set(const int* flag, const float* from, float* to, std::size_t count,
                        cudaStream_t stream) {
  if (count == 0) return;
  kernels::copy_if_set<<<grid_blocks(count), block_threads, 0, stream>>>(flag, from, to, count);
  LOOM_CUDA_LAUNCH_CHECK("copy_if_set");
}

}  // namespace loom::gpu
