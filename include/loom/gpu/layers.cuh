// CUDA runners for the layers that have no cuBLAS/cuDNN op: Tanh, Sigmoid,
// GELU, GlobalAvgPool, Dropout and (Sync)BatchNorm (over channels of
// N x C x plane, or over time: N x Frames x C), each computing what its
// CPU layer computes. Rules shared by all: work is only enqueued on the
// call's stream (a step may be captured in a CUDA graph), backward
// overwrites the parameter gradients, and every reduction adds in a fixed
// order (no floating-point atomics), so a result never varies between runs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "../backend/cpu/epilogue.hpp"
#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/launch.hpp"
#include "../backend/cuda/memory.hpp"
#include "../core/activation.hpp"
#include "../layers/normalization.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace kernels {

template <class Fn, class T>
__global__ void pointwise_forward(const T* x, T* y, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    y[i] = Fn::forward(x[i]);
}

template <class Fn, class T>
__global__ void pointwise_backward(const T* x, const T* y, const T* dy, T* dx, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    dx[i] = Fn::backward(x[i], y[i], dy[i]);
}

// One thread per (sample, channel): the plane is summed in order, as on the
// CPU, so the mean is the CPU's to the bit.
template <class T>
__global__ void global_avg_pool_forward(const T* x, T* y, std::size_t planes, std::size_t plane) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t s = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < planes;
       s += stride) {
    T sum = T(0);
    for (std::size_t i = 0; i < plane; ++i) sum += x[s * plane + i];
    y[s] = sum / static_cast<T>(plane);
  }
}

template <class T>
__global__ void global_avg_pool_backward(const T* dy, T* dx, std::size_t count, std::size_t plane) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    dx[i] = dy[i / plane] / static_cast<T>(plane);
}

// The pass is read here, not on the host, so that a captured graph replayed
// after the owner wrote a new step draws that step's mask.
template <class L, class T>
__global__ void dropout_apply(const T* in, T* out, std::size_t count, const DevicePass* pass) {
  constexpr std::size_t size = L::input_shape::size;
  const T scale = static_cast<T>(1.0 / (1.0 - L::spec::p));
  const std::uint64_t seed = pass->seed, first_sample = pass->first_sample;
  const std::uint64_t key = L::stream_at(pass->step);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t at = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < count;
       at += stride)
    // x * 0, not 0: a dropped NaN stays NaN, as on the CPU.
    out[at] = in[at] * (L::keep(seed, key, first_sample + at / size, at % size) ? scale : T(0));
}

// Which elements a BatchNorm reads and writes: over time, frame t of
// sample s when t < frames[s] (rows: frames per sample, width: channels);
// without lengths (frames null) every element. Padding is never read, so a
// NaN written there changes nothing.
struct FrameMask {
  const std::int32_t* frames = nullptr;
  std::size_t rows = 1, width = 1;
  __device__ bool valid(std::size_t at) const {
    if (frames == nullptr) return true;
    const std::size_t row = at / width;
    return row % rows < static_cast<std::size_t>(frames[row / rows]);
  }
  // The values per channel of n samples: the valid frames, or `full`.
  __device__ double count(std::size_t n, double full) const {
    if (frames == nullptr) return full;
    double total = 0;
    for (std::size_t s = 0; s < n; ++s) total += static_cast<double>(frames[s]);
    return total;
  }
};

// Two per-channel sums carried through one block reduction.
struct SumPair {
  double a = 0, b = 0;
};
struct AddPairs {
  __device__ SumPair operator()(const SumPair& l, const SumPair& r) const {
    return {l.a + r.a, l.b + r.b};
  }
};

// Where element k (0 <= k < n * plane) of channel c sits in N x C x plane.
__device__ inline std::size_t channel_element(std::size_t k, std::size_t c, std::size_t channels,
                                              std::size_t plane) {
  return (k / plane * channels + c) * plane + k % plane;
}

// Block b sums term(c, element) over chunk b % chunks of channel
// c = b / chunks into partials[b]; chunk boundaries and the block's tree are
// fixed by the launch shape, so the sum is the same on every run.
template <unsigned Threads, class Term>
__global__ void channel_partials(Term term, std::size_t channels, std::size_t plane,
                                 std::size_t count, std::size_t chunks, std::size_t per_chunk,
                                 SumPair* partials) {
  using Reduce = cub::BlockReduce<SumPair, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  const std::size_t c = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const std::size_t begin = chunk * per_chunk;
  const std::size_t end = begin + per_chunk < count ? begin + per_chunk : count;
  SumPair sum;
  for (std::size_t k = begin + threadIdx.x; k < end; k += Threads) {
    const SumPair v = term(c, channel_element(k, c, channels, plane));
    sum.a += v.a;
    sum.b += v.b;
  }
  const SumPair total = Reduce(temp).Reduce(sum, AddPairs{});
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Channel c's partials added in chunk order.
__device__ inline SumPair channel_total(const SumPair* partials, std::size_t c,
                                        std::size_t chunks) {
  SumPair total;
  for (std::size_t chunk = 0; chunk < chunks; ++chunk) {
    total.a += partials[c * chunks + chunk].a;
    total.b += partials[c * chunks + chunk].b;
  }
  return total;
}

// The terms summed: x and x^2, x's squared deviation from the mean, and the
// gradient before the fused activation with its product with xhat; zero
// (nothing read) where the mask leaves an element out.
// stats: mean [C], variance [C], count; inv_std [C].
struct SumSquares {
  const float* x;
  FrameMask mask;
  __device__ SumPair operator()(std::size_t, std::size_t at) const {
    if (!mask.valid(at)) return {};
    const double v = static_cast<double>(x[at]);
    return {v, v * v};
  }
};
struct SquaredDeviation {
  const float* x;
  const double* stats;
  FrameMask mask;
  __device__ SumPair operator()(std::size_t c, std::size_t at) const {
    if (!mask.valid(at)) return {};
    const double d = static_cast<double>(x[at]) - stats[c];
    return {d * d, 0.0};
  }
};
template <Act A>
struct GradientTerms {
  const float* x;
  const float* y;
  const float* dy;
  const double* stats;
  const double* inv_std;
  FrameMask mask;
  __device__ SumPair operator()(std::size_t c, std::size_t at) const {
    if (!mask.valid(at)) return {};
    const double g = static_cast<double>(cpu::activate_grad<A>(dy[at], y[at]));
    return {g, g * (static_cast<double>(x[at]) - stats[c]) * inv_std[c]};
  }
};

// The per-channel kernels below run one thread per channel. Where the CPU
// rounds a double result to float (running statistics, scale, shift, y),
// the arithmetic is spelled with _rn intrinsics: nvcc would otherwise
// contract a * b + c into an FMA and round differently from the CPU.
__device__ inline double inverse_std(double var) {
  return 1.0 / std::sqrt(__dadd_rn(var, loom::detail::batch_norm_eps));
}

__device__ inline std::size_t channel_index() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Unsynchronised training, first pass: the mean over the `full` values
// per channel of n samples, or over their valid frames (read here: a
// replayed graph takes each step's lengths).
inline __global__ void batch_norm_mean(const SumPair* partials, std::size_t chunks,
                                       std::size_t channels, FrameMask mask, std::size_t n,
                                       double full, double* stats) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const double count = mask.count(n, full);
  stats[c] = channel_total(partials, c, chunks).a / count;
  if (c == 0) stats[2 * channels] = count;
}

// Second pass: the biased variance, from the squared deviations.
inline __global__ void batch_norm_variance(const SumPair* partials, std::size_t chunks,
                                           std::size_t channels, double* stats, double* inv_std) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const double var = channel_total(partials, c, chunks).a / stats[2 * channels];
  stats[channels + c] = var;
  inv_std[c] = inverse_std(var);
}

// Synchronised training: this replica's sums and count, to be all-reduced.
inline __global__ void batch_norm_sums(const SumPair* partials, std::size_t chunks,
                                       std::size_t channels, FrameMask mask, std::size_t n,
                                       double full, double* stats) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const SumPair total = channel_total(partials, c, chunks);
  stats[c] = total.a;
  stats[channels + c] = total.b;
  if (c == 0) stats[2 * channels] = mask.count(n, full);
}

// The all-reduced sums become the moments, in place.
inline __global__ void batch_norm_sync_moments(std::size_t channels, double* stats,
                                               double* inv_std) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const double count = stats[2 * channels];
  const double mean = stats[c] / count;
  // std::max(0.0, v) as on the CPU: a NaN variance becomes 0.
  const double v = __dsub_rn(stats[channels + c] / count, __dmul_rn(mean, mean));
  const double var = 0.0 < v ? v : 0.0;
  stats[c] = mean;
  stats[channels + c] = var;
  inv_std[c] = inverse_std(var);
}

// Evaluation: the running statistics (and no batch: count 0, as on the CPU).
inline __global__ void batch_norm_running_moments(const float* state, std::size_t channels,
                                                  double* stats, double* inv_std) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  if (c == 0) stats[2 * channels] = 0;
  stats[c] = static_cast<double>(state[c]);
  stats[channels + c] = static_cast<double>(state[channels + c]);
  inv_std[c] = inverse_std(stats[channels + c]);
}

// In training, PyTorch's running-statistics update (momentum 0.1, the
// unbiased variance); then the float scale and shift the CPU normalises with.
inline __global__ void batch_norm_scale_shift(const float* gamma, const float* beta, float* state,
                                              bool training, std::size_t channels,
                                              const double* stats, float* scale, float* shift) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const double mean = stats[c], var = stats[channels + c];
  if (training) {
    constexpr double momentum = loom::detail::batch_norm_momentum;
    const double count = stats[2 * channels];
    const double unbiased = count > 1 ? count / (count - 1) : 1.0;
    state[c] =
        static_cast<float>(__dadd_rn(__dmul_rn(1 - momentum, state[c]), __dmul_rn(momentum, mean)));
    state[channels + c] =
        static_cast<float>(__dadd_rn(__dmul_rn(1 - momentum, state[channels + c]),
                                     __dmul_rn(__dmul_rn(momentum, var), unbiased)));
  }
  const float s = static_cast<float>(static_cast<double>(gamma[c]) /
                                     std::sqrt(__dadd_rn(var, loom::detail::batch_norm_eps)));
  scale[c] = s;
  shift[c] = static_cast<float>(
      __dsub_rn(static_cast<double>(beta[c]), __dmul_rn(mean, static_cast<double>(s))));
}

// Padding (outside the mask) is written as zero, as on the CPU.
template <Act A>
__global__ void batch_norm_apply(const float* x, float* y, const float* scale, const float* shift,
                                 std::size_t count, std::size_t channels, std::size_t plane,
                                 FrameMask mask) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t c = i / plane % channels;
    y[i] = mask.valid(i) ? cpu::activate<A>(__fadd_rn(__fmul_rn(x[i], scale[c]), shift[c])) : 0.0f;
  }
}

// sums: sum(g) [C] (beta's gradient), then sum(g * xhat) [C] (gamma's).
inline __global__ void batch_norm_gradient_sums(const SumPair* partials, std::size_t chunks,
                                                std::size_t channels, double* sums, float* dgamma,
                                                float* dbeta) {
  const std::size_t c = channel_index();
  if (c >= channels) return;
  const SumPair total = channel_total(partials, c, chunks);
  sums[c] = total.a;
  sums[channels + c] = total.b;
  dgamma[c] = static_cast<float>(total.b);
  dbeta[c] = static_cast<float>(total.a);
}

// The CPU's formula: in training the batch statistics depend on every x,
// which adds the mean's and the variance's terms. Padding gets zero.
template <Act A>
__global__ void batch_norm_input_gradient(const float* gamma, const float* x, const float* y,
                                          const float* dy, float* dx, bool training,
                                          const double* stats, const double* inv_std,
                                          const double* sums, std::size_t count,
                                          std::size_t channels, std::size_t plane, FrameMask mask) {
  const double batch = stats[2 * channels];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    if (!mask.valid(i)) {
      dx[i] = 0.0f;
      continue;
    }
    const std::size_t c = i / plane % channels;
    const double g = static_cast<double>(cpu::activate_grad<A>(dy[i], y[i]));
    const double scale = static_cast<double>(gamma[c]) * inv_std[c];
    if (training) {
      const double xhat = (static_cast<double>(x[i]) - stats[c]) * inv_std[c];
      dx[i] = static_cast<float>(scale / batch * (batch * g - sums[c] - xhat * sums[channels + c]));
    } else {
      dx[i] = static_cast<float>(scale * g);
    }
  }
}

}  // namespace kernels

// Tanh, Sigmoid and GELU (Fn: detail::TanhFn, SigmoidFn, GeluFn), elementwise.
// Like every runner here it takes LayerRunner's constructor arguments;
// it uses no library, so no workspace and no TF32.
template <class L, class Fn>
class PointwiseRunner {
 public:
  PointwiseRunner(DeviceContext&, std::size_t batch, std::size_t, bool)
      : count_(batch * L::input_shape::size) {}

  std::size_t scratch_bytes() const { return 0; }

  void forward(const detail::LayerCall& c) {
    if (count_ == 0) return;
    kernels::pointwise_forward<Fn, float>
        <<<grid_blocks(count_), block_threads, 0, c.stream>>>(c.x, c.y, count_);
    LOOM_CUDA_LAUNCH_CHECK("pointwise_forward");
  }

  void backward(const detail::LayerCall& c) {
    if (c.dx == nullptr || count_ == 0) return;
    kernels::pointwise_backward<Fn, float>
        <<<grid_blocks(count_), block_threads, 0, c.stream>>>(c.x, c.y, c.dy, c.dx, count_);
    LOOM_CUDA_LAUNCH_CHECK("pointwise_backward");
  }

 private:
  std::size_t count_;
};

template <class L>
class GlobalAvgPoolRunner {
 public:
  GlobalAvgPoolRunner(DeviceContext&, std::size_t batch, std::size_t, bool) : batch_(batch) {}

  std::size_t scratch_bytes() const { return 0; }

  void forward(const detail::LayerCall& c) {
    const std::size_t planes = batch_ * L::channels;
    if (planes == 0) return;
    kernels::global_avg_pool_forward<float>
        <<<grid_blocks(planes), block_threads, 0, c.stream>>>(c.x, c.y, planes, L::plane);
    LOOM_CUDA_LAUNCH_CHECK("global_avg_pool_forward");
  }

  void backward(const detail::LayerCall& c) {
    const std::size_t count = batch_ * L::input_shape::size;
    if (c.dx == nullptr || count == 0) return;
    kernels::global_avg_pool_backward<float>
        <<<grid_blocks(count), block_threads, 0, c.stream>>>(c.dy, c.dx, count, L::plane);
    LOOM_CUDA_LAUNCH_CHECK("global_avg_pool_backward");
  }

 private:
  std::size_t batch_;
};

// Draws the CPU layer's mask (the same seed, step and global sample index
// give the same elements); backward regenerates it rather than storing it.
template <class L>
class DropoutRunner {
 public:
  DropoutRunner(DeviceContext&, std::size_t batch, std::size_t, bool)
      : count_(batch * L::input_shape::size) {}

  std::size_t scratch_bytes() const { return 0; }

  void forward(const detail::LayerCall& c) { apply(c.x, c.y, c); }

  void backward(const detail::LayerCall& c) {
    if (c.dx != nullptr) apply(c.dy, c.dx, c);
  }

 private:
  void apply(const float* in, float* out, const detail::LayerCall& c) const {
    if (count_ == 0) return;
    if (!c.training) {
      copy_async(out, in, count_, cudaMemcpyDeviceToDevice, c.stream);
      return;
    }
    kernels::dropout_apply<L, float>
        <<<grid_blocks(count_), block_threads, 0, c.stream>>>(in, out, count_, c.pass);
    LOOM_CUDA_LAUNCH_CHECK("dropout_apply");
  }

  std::size_t count_;
};

// BatchNorm1d over Frames x C: batch_norm_layer_t's rule (layers/normalization.hpp).
template <class L>
constexpr bool batch_norm_over_time() {
  if constexpr (BatchNormSpec<typename L::spec>)
    return ::loom::detail::batch_norm_kind<typename L::spec>::rank == 1 &&
           L::input_shape::rank == 2;
  else
    return false;
}
// Where a channel's elements lie: `plane` in a row (1 over time), and
// per_sample of them in one sample.
template <class L>
constexpr std::size_t batch_norm_plane() {
  if constexpr (batch_norm_over_time<L>())
    return 1;
  else
    return L::plane;
}
template <class L>
constexpr std::size_t batch_norm_per_sample() {
  if constexpr (batch_norm_over_time<L>())
    return L::frames;
  else
    return L::plane;
}

// BatchNorm2d/1d and SyncBatchNorm2d/1d, with the fused ReLU when there is
// one, over channels of N x C x plane ("batchnorm") or over time, N x Frames
// x C ("batchnorm_time": plane 1, the rows of a channel being the samples'
// frames), where only each sample's valid frames (LayerCall::frames, read
// on the device) count, and padding is written as zero. Device layout: weights = gamma [C], bias = beta [C], state = running
// mean [C] then running variance [C]. Moments are computed in double as on
// the CPU: two passes (mean, then squared deviations) on one replica, one
// pass of sums all-reduced over the replicas for SyncBatchNorm in training.
// The reductions run on a grid of (channel, chunk) blocks whose partials a
// per-channel kernel adds in chunk order: C = 16 at n * plane = 256 * 784
// gets 49 chunks per channel, C = 512 at n * plane = 64 one.
//
// Scratch (valid during one call only): partials [C x chunks], stats
// (mean [C], variance [C], count: 2C + 1 doubles, the sums that the
// replicas all-reduce before they become moments), inv_std [C], and either
// the float scale and shift (forward) or the gradient sums [2C] (backward).
template <class L>
class BatchNormRunner {
 public:
  BatchNormRunner(DeviceContext&, std::size_t batch, std::size_t, bool)
      : batch_(batch),
        count_(batch * per_sample),
        chunks_(
            std::clamp<std::size_t>((count_ + chunk_elements - 1) / chunk_elements, 1, max_chunks)),
        per_chunk_((count_ + chunks_ - 1) / chunks_) {}

  std::size_t scratch_bytes() const {
    return DeviceArena::padded_bytes<kernels::SumPair>(channels * chunks_) +
           DeviceArena::padded_bytes<double>(2 * channels + 1) +
           DeviceArena::padded_bytes<double>(channels) +
           DeviceArena::padded_bytes<double>(2 * channels);
  }

  void forward(const detail::LayerCall& c) {
    const Scratch s = carve(c);
    moments(c, s);
    kernels::batch_norm_scale_shift<<<channel_blocks(), block_threads, 0, c.stream>>>(
        c.weights, c.bias, c.state, c.training, channels, s.stats, s.scale, s.shift);
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_scale_shift");
    const std::size_t count = batch_ * L::input_shape::size;
    if (count == 0) return;
    kernels::batch_norm_apply<L::activation><<<grid_blocks(count), block_threads, 0, c.stream>>>(
        c.x, c.y, s.scale, s.shift, count, channels, plane, mask(c));
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_apply");
  }

  void backward(const detail::LayerCall& c) {
    const Scratch s = carve(c);
    moments(c, s);
    launch_partials(
        kernels::GradientTerms<L::activation>{c.x, c.y, c.dy, s.stats, s.inv_std, mask(c)},
        s.partials, c.stream);
    kernels::batch_norm_gradient_sums<<<channel_blocks(), block_threads, 0, c.stream>>>(
        s.partials, chunks_, channels, s.sums, c.dweights, c.dbias);
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_gradient_sums");
    if (c.dx == nullptr) return;
    // dx's batch terms span the global batch, while the parameter gradients
    // written above stay this replica's (the gradient all-reduce adds them).
    if (synced(c))
      c.replicas->all_reduce_async(s.sums, 2 * channels, comm::ReduceOp::sum, c.stream);
    const std::size_t count = batch_ * L::input_shape::size;
    if (count == 0) return;
    kernels::batch_norm_input_gradient<L::activation>
        <<<grid_blocks(count), block_threads, 0, c.stream>>>(c.weights, c.x, c.y, c.dy, c.dx,
                                                             c.training, s.stats, s.inv_std, s.sums,
                                                             count, channels, plane, mask(c));
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_input_gradient");
  }

 private:
  static constexpr std::size_t channels = L::channels;
  static constexpr bool over_time = batch_norm_over_time<L>();
  static constexpr std::size_t plane = batch_norm_plane<L>();
  static constexpr std::size_t per_sample = batch_norm_per_sample<L>();
  // 256 threads x 16 elements per block; caps the per-channel kernel's
  // serial sum of partials. Not yet tuned on a GPU.
  static constexpr std::size_t chunk_elements = 16 * block_threads;
  static constexpr std::size_t max_chunks = 1024;

  struct Scratch {
    kernels::SumPair* partials;
    double* stats;
    double* inv_std;
    double* sums;  // backward
    float* scale;  // forward, in the same bytes as sums
    float* shift;
  };

  Scratch carve(const detail::LayerCall& c) const {
    LOOM_CHECK(c.scratch_bytes >= scratch_bytes(), "BatchNorm (layer ", L::index, ") needs ",
               scratch_bytes(), " bytes of scratch for a batch of ", batch_, " but got ",
               c.scratch_bytes);
    unsigned char* at = c.scratch;
    Scratch s{};
    s.partials = reinterpret_cast<kernels::SumPair*>(at);
    at += DeviceArena::padded_bytes<kernels::SumPair>(channels * chunks_);
    s.stats = reinterpret_cast<double*>(at);
    at += DeviceArena::padded_bytes<double>(2 * channels + 1);
    s.inv_std = reinterpret_cast<double*>(at);
    at += DeviceArena::padded_bytes<double>(channels);
    s.sums = reinterpret_cast<double*>(at);
    s.scale = reinterpret_cast<float*>(at);
    s.shift = s.scale + channels;
    return s;
  }

  static kernels::FrameMask mask(const detail::LayerCall& c) {
    if constexpr (over_time)
      return {c.frames, L::frames, channels};
    else
      return {};
  }

  static bool synced(const detail::LayerCall& c) {
    return L::syncs && c.training && c.replicas != nullptr;
  }

  static unsigned channel_blocks() {
    return static_cast<unsigned>((channels + block_threads - 1) / block_threads);
  }

  template <class Term>
  void launch_partials(const Term& term, kernels::SumPair* partials, cudaStream_t stream) const {
    kernels::channel_partials<block_threads, Term>
        <<<static_cast<unsigned>(channels * chunks_), block_threads, 0, stream>>>(
            term, channels, plane, count_, chunks_, per_chunk_, partials);
    LOOM_CUDA_LAUNCH_CHECK("channel_partials");
  }

  // s.stats and s.inv_std for this call: the batch's moments in training
  // (the global batch's when synced), the running statistics in evaluation.
  void moments(const detail::LayerCall& c, const Scratch& s) const {
    if (!c.training) {
      kernels::batch_norm_running_moments<<<channel_blocks(), block_threads, 0, c.stream>>>(
          c.state, channels, s.stats, s.inv_std);
      LOOM_CUDA_LAUNCH_CHECK("batch_norm_running_moments");
      return;
    }
    // Without lengths every element of the batch counts.
    const double full = static_cast<double>(count_);
    if (synced(c)) {
      launch_partials(kernels::SumSquares{c.x, mask(c)}, s.partials, c.stream);
      kernels::batch_norm_sums<<<channel_blocks(), block_threads, 0, c.stream>>>(
          s.partials, chunks_, channels, mask(c), batch_, full, s.stats);
      LOOM_CUDA_LAUNCH_CHECK("batch_norm_sums");
      c.replicas->all_reduce_async(s.stats, 2 * channels + 1, comm::ReduceOp::sum, c.stream);
      kernels::batch_norm_sync_moments<<<channel_blocks(), block_threads, 0, c.stream>>>(
          channels, s.stats, s.inv_std);
      LOOM_CUDA_LAUNCH_CHECK("batch_norm_sync_moments");
      return;
    }
    launch_partials(kernels::SumSquares{c.x, mask(c)}, s.partials, c.stream);
    kernels::batch_norm_mean<<<channel_blocks(), block_threads, 0, c.stream>>>(
        s.partials, chunks_, channels, mask(c), batch_, full, s.stats);
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_mean");
    launch_partials(kernels::SquaredDeviation{c.x, s.stats, mask(c)}, s.partials, c.stream);
    kernels::batch_norm_variance<<<channel_blocks(), block_threads, 0, c.stream>>>(
        s.partials, chunks_, channels, s.stats, s.inv_std);
    LOOM_CUDA_LAUNCH_CHECK("batch_norm_variance");
  }

  std::size_t batch_;
  std::size_t count_;  // elements per channel: n x plane, or n x Frames over time
  std::size_t chunks_;
  std::size_t per_chunk_;
};

}  // namespace loom::gpu
