// The optimizers a GPU stage updates with (SGD, Adam, AdamW), and
// gradient clipping by global norm, on the GPU. Each update is one
// grid-stride pass over the flat parameter buffer with the CPU backend's
// arithmetic: the per-step scalars (Adam's bias corrections, AdamW's decay)
// are computed on the host in double exactly as cpu::adam_update does, and
// the clip factor on the device from the squared norm as clip_gradients
// does; the clipped, decayed gradient is rounded as the CPU rounds it, and
// the moments and weights differ by the FMAs nvcc contracts them into.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_reduce.cuh>

#include "../cpu/adam.hpp"
#include "check.hpp"
#include "launch.hpp"
#include "sgd.cuh"

namespace loom::gpu {

// Which update a GPU stage applies, with its fixed options (lr is set per
// step: schedules change it). The rule is chosen at run time, so the
// layers' code serves every optimizer and a trainer does not multiply
// nvcc's work.
struct DeviceOptimizer {
  enum class Rule { sgd, adam };
  Rule rule = Rule::sgd;
  float lr = 0.01f;
  // SGD
  float momentum = 0.0f;
  bool nesterov = false;
  // Adam and AdamW (decoupled)
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  bool decoupled = false;
  float weight_decay = 0.0f;

  // Not an aggregate: `{.lr = 0.01f}` then means SGD::Options alone
  // wherever both are taken.
  DeviceOptimizer() = default;

  // Buffers per parameter: SGD's velocity; Adam's two moments.
  std::size_t buffers() const { return rule == Rule::adam ? 2 : 1; }
  const char* name() const { return rule == Rule::sgd ? "SGD" : decoupled ? "AdamW" : "Adam"; }

};

// What an update reads on the device, written before each optimizer step
// (a captured step replays with the values of its time).
struct UpdateScalars {
  float lr = 0.0f;
  float step_size = 0.0f;    // Adam: lr / (1 - beta1^t)
  float correction2 = 1.0f;  // Adam: 1 / sqrt(1 - beta2^t)
  float decay = 1.0f;        // AdamW: 1 - lr * weight_decay
  float max_norm = 0.0f;     // clipping's bound (0: none)

  bool operator==(const UpdateScalars&) const = default;
};

// The scalars of optimizer step t (from 1): cpu::adam_update's.
inline UpdateScalars update_scalars(const DeviceOptimizer& o, float lr, std::uint64_t t,
                                    float max_norm) {
  UpdateScalars s{.lr = lr, .max_norm = max_norm};
  if (o.rule == DeviceOptimizer::Rule::adam) {
    const cpu::AdamScalars k = cpu::adam_scalars({.lr = lr,
                                                  .beta1 = o.beta1,
                                                  .beta2 = o.beta2,
                                                  .weight_decay = o.weight_decay,
                                                  .decoupled = o.decoupled,
                                                  .t = t});
    s.step_size = static_cast<float>(k.step_size);
    s.correction2 = static_cast<float>(k.correction2);
    s.decay = static_cast<float>(k.decay);
  }
  return s;
}

namespace kernels {

// halted, when given, skips the update once the loss halted the step.
template <class T>
__global__ void adam_update(T* weights, const T* grads, T* exp_avg, T* exp_avg_sq,
                            std::size_t count, T beta1, T beta2, T one_minus_beta1,
                            T one_minus_beta2, T eps, T l2, const UpdateScalars* scalars,
                            const double* clip_squares, const int* halted) {
  if (halted != nullptr && *halted != 0) return;
  const float factor = clip_factor(clip_squares, &scalars->max_norm);
  const T step_size = scalars->step_size, correction2 = scalars->correction2;
  const T decay = scalars->decay;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const T g = decayed_gradient(grads[i], T(factor), l2, weights[i]);
    const T m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const T v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    weights[i] = weights[i] * decay - step_size * m / (sqrt(v) * correction2 + eps);
  }
}

struct Square {
  __host__ __device__ double operator()(float g) const {
    return static_cast<double>(g) * static_cast<double>(g);
  }
};

}  // namespace kernels

// The update of optimizer `o` over `count` parameters with buffers `first`
// (velocity or exp_avg) and `second` (exp_avg_sq); clip_squares, when
// given, holds the gradients' squared global norm and the update clips by
// scalars->max_norm first.
inline void optimizer_update(const DeviceOptimizer& o, float* weights, const float* grads,
                             float* first, float* second, std::size_t count,
                             const UpdateScalars* scalars, const double* clip_squares,
                             const int* halted, cudaStream_t stream) {
  if (count == 0) return;
  if (o.rule == DeviceOptimizer::Rule::sgd) {
    sgd_update(weights, grads, first, count, o.lr, o.momentum, o.weight_decay, o.nesterov, stream,
               &scalars->lr, halted, clip_squares, &scalars->max_norm);
    return;
  }
  const double b1 = o.beta1, b2 = o.beta2;
  kernels::adam_update<float><<<grid_blocks(count), block_threads, 0, stream>>>(
      weights, grads, first, second, count, o.beta1, o.beta2, static_cast<float>(1.0 - b1),
      static_cast<float>(1.0 - b2), o.eps, o.decoupled ? 0.0f : o.weight_decay, scalars,
      clip_squares, halted);
  LOOM_CUDA_LAUNCH_CHECK("adam_update");
}

// Device scratch that squared_norm needs for `count` gradients.
inline std::size_t squared_norm_bytes(std::size_t count) {
  std::size_t bytes = 0;
  LOOM_CUDA_CHECK(cub::DeviceReduce::TransformReduce(nullptr, bytes, static_cast<const float*>(nullptr),
                                                     static_cast<double*>(nullptr), count,
                                                     cuda::std::plus<double>{}, kernels::Square{},
                                                     0.0));
  return bytes;
}

// *out = the sum of the squares of `grads`, in double (enqueued; no
// allocation, so a graph can capture it).
inline void squared_norm(const float* grads, std::size_t count, double* out, void* temp,
                         std::size_t temp_bytes, cudaStream_t stream) {
  LOOM_CUDA_CHECK(cub::DeviceReduce::TransformReduce(temp, temp_bytes, grads, out, count,
                                                     cuda::std::plus<double>{}, kernels::Square{},
                                                     0.0, stream));
}

}  // namespace loom::gpu
