// Conv1d (and Fused<Conv1d, ReLU>) on the GPU, computing what the CPU layer
// (layers/conv1d.hpp) computes over a time-major batch N x Frames x C whose
// samples have their own lengths (LayerCall::frames, each sample's valid
// input frames; null: all of them).
//
// Method: a frames-aware im2col kernel and cuBLASLt GEMMs, not cuDNN. The
// im2col kernel builds all n x Frames' rows of the batch at once, zero at
// and past each sample's output length and wherever the window leaves its
// valid input, so one GEMM over the whole batch gives every sample's
// outputs (the CPU's per-sample GEMMs over the valid rows, up to the
// order of the sums) and neither padding nor a NaN written there reaches a
// valid output, a weight gradient or an input gradient. Both lengths are
// read on the device, at replay, so a captured step takes each step's new
// lengths with the same launches. cuDNN over NHWC with H = 1 would need the
// lengths in its descriptors (fixed at capture) and still a masking pass.
// The GEMMs are Linear's over positions (Frames' x Out per sample), with
// its epilogues: bias(+ReLU) forward, the bias gradient with the weight
// GEMM; the gradient passed back is dcol = dZ W, gathered by col2im.
//
// Padding: outputs at or past a sample's output length are written as zero,
// and so are input-gradient frames at or past its input length, as on the
// CPU.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "../backend/cpu/epilogue.hpp"
#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/gemm.hpp"
#include "../backend/cuda/launch.hpp"
#include "../core/activation.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace kernels {

// Sample s's valid input and output frames (conv1d.hpp's frames_out), read
// on the device: constexpr host functions are not callable here.
template <class L>
__device__ inline std::size_t conv1d_in_frames(const std::int32_t* frames, std::size_t s) {
  return frames == nullptr ? L::frames : static_cast<std::size_t>(frames[s]);
}
template <class L>
__device__ inline std::size_t conv1d_out_frames(const std::int32_t* frames, std::size_t s) {
  if (frames == nullptr) return L::out_frames;
  constexpr std::size_t padded = 2 * L::spec::pad;
  const std::size_t in = static_cast<std::size_t>(frames[s]);
  return in + padded >= L::span ? (in + padded - L::span) / L::spec::stride + 1 : 0;
}

// col, n x Frames' rows of C x K: row (s, t), column c K + k holds
// x[s, t S + k D - P, c], zero outside the sample's valid input frames and
// on rows at or past its output length (which are never read).
template <class L>
__global__ void conv1d_im2col(const float* x, float* col, const std::int32_t* frames,
                              std::size_t count) {
  constexpr std::size_t K = L::spec::kernel;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t j = i % L::patch, row = i / L::patch;
    const std::size_t t = row % L::out_frames, s = row / L::out_frames;
    const std::size_t c = j / K, k = j % K;
    float v = 0.0f;
    if (t < conv1d_out_frames<L>(frames, s)) {
      // Signed: with padding the window may start before frame 0.
      const long at = static_cast<long>(t * L::spec::stride + k * L::spec::dilation) -
                      static_cast<long>(L::spec::pad);
      if (at >= 0 && static_cast<std::size_t>(at) < conv1d_in_frames<L>(frames, s))
        v = x[s * L::input_shape::size + static_cast<std::size_t>(at) * L::channels + c];
    }
    col[i] = v;
  }
}

// The forward GEMM's bias(+ReLU) epilogue wrote every row: rows at or past
// a sample's output length become zero, as the CPU writes them.
template <class L>
__global__ void conv1d_zero_padding(float* y, const std::int32_t* frames, std::size_t count) {
  constexpr std::size_t out = L::spec::out_channels;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t row = i / out;
    if (row % L::out_frames >= conv1d_out_frames<L>(frames, row / L::out_frames)) y[i] = 0.0f;
  }
}

// dZ = act'(dY) on the valid rows, zero on the others (dY there is not read).
template <class L>
__global__ void conv1d_output_gradient(const float* dy, const float* y, float* dz,
                                       const std::int32_t* frames, std::size_t count) {
  constexpr std::size_t out = L::spec::out_channels;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t row = i / out;
    const bool valid = row % L::out_frames < conv1d_out_frames<L>(frames, row / L::out_frames);
    dz[i] = valid ? cpu::activate_grad<L::activation>(dy[i], y[i]) : 0.0f;
  }
}

// dx[s, f, c]: the entries of dcol that came from frame f, gathered (one
// thread per element, no atomics) in the CPU's order: the output frames t
// ascending, which is the taps k descending; zero at or past the sample's
// input length.
template <class L>
__global__ void conv1d_col2im(const float* dcol, float* dx, const std::int32_t* frames,
                              std::size_t count) {
  constexpr std::size_t K = L::spec::kernel, S = L::spec::stride, D = L::spec::dilation;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t c = i % L::channels, f = i / L::channels % L::frames;
    const std::size_t s = i / L::input_shape::size;
    float sum = 0.0f;
    if (f < conv1d_in_frames<L>(frames, s)) {
      const std::size_t out_length = conv1d_out_frames<L>(frames, s);
      for (std::size_t k = K; k-- > 0;) {
        const long from = static_cast<long>(f + L::spec::pad) - static_cast<long>(k * D);
        if (from < 0 || from % static_cast<long>(S) != 0) continue;
        const std::size_t t = static_cast<std::size_t>(from) / S;
        if (t < out_length) sum += dcol[(s * L::out_frames + t) * L::patch + c * K + k];
      }
    }
    dx[i] = sum;
  }
}

}  // namespace kernels

// Scratch (valid during one call): the column matrix (also dcol), dZ, then
// the GEMMs' workspace. Like every runner it takes LayerRunner's
// constructor arguments; its GEMMs use TF32 when tensor cores are allowed.
template <class L>
class Conv1dRunner {
 public:
  Conv1dRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
               bool tensor_cores)
      : batch_(batch) {
    const std::size_t rows = batch * L::out_frames;
    const GemmOptions options =
        detail::gemm_options(tensor_cores ? TensorMath::tf32 : TensorMath::fp32, library_limit);
    forward_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, true, rows, out, patch, patch, patch, out},
        L::activation == Act::relu ? Epilogue::relu_bias : Epilogue::bias, options);
    weight_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{true, false, out, patch, rows, out, patch, patch},
        Epilogue::bgrad_a, options);
    input_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, false, rows, patch, out, out, patch, patch},
        Epilogue::none, options);
  }

  static std::size_t fixed_bytes(std::size_t n) { return col_bytes(n) + dz_bytes(n); }
  std::size_t scratch_bytes() const {
    return fixed_bytes(batch_) + std::max({forward_->workspace_bytes(),
                                           weight_grad_->workspace_bytes(),
                                           input_grad_->workspace_bytes()});
  }

  void forward(const detail::LayerCall& c) {
    check_scratch(c);
    float* col = reinterpret_cast<float*>(c.scratch);
    im2col(c, col);
    GemmArgs args = gemm_args(col, c.weights, c.y, c);
    args.bias = c.bias;
    forward_->run(args);
    if (c.frames == nullptr) return;
    const std::size_t count = batch_ * L::output_shape::size;
    kernels::conv1d_zero_padding<L>
        <<<grid_blocks(count), block_threads, 0, c.stream>>>(c.y, c.frames, count);
    LOOM_CUDA_LAUNCH_CHECK("conv1d_zero_padding");
  }

  void backward(const detail::LayerCall& c) {
    check_scratch(c);
    float* col = reinterpret_cast<float*>(c.scratch);
    float* dz = reinterpret_cast<float*>(c.scratch + col_bytes(batch_));
    const std::size_t count = batch_ * L::output_shape::size;
    kernels::conv1d_output_gradient<L>
        <<<grid_blocks(count), block_threads, 0, c.stream>>>(c.dy, c.y, dz, c.frames, count);
    LOOM_CUDA_LAUNCH_CHECK("conv1d_output_gradient");
    im2col(c, col);
    GemmArgs weights = gemm_args(dz, col, c.dweights, c);
    weights.bias_grad = c.dbias;
    weight_grad_->run(weights);
    if (c.dx == nullptr) return;
    input_grad_->run(gemm_args(dz, c.weights, col, c));
    const std::size_t inputs = batch_ * L::input_shape::size;
    kernels::conv1d_col2im<L>
        <<<grid_blocks(inputs), block_threads, 0, c.stream>>>(col, c.dx, c.frames, inputs);
    LOOM_CUDA_LAUNCH_CHECK("conv1d_col2im");
  }

 private:
  static constexpr std::size_t out = L::spec::out_channels;
  static constexpr std::size_t patch = L::patch;

  static std::size_t col_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * L::out_frames * patch);
  }
  static std::size_t dz_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * L::output_shape::size);
  }

  void check_scratch(const detail::LayerCall& c) const {
    LOOM_CHECK(c.scratch_bytes >= scratch_bytes(), "Conv1d (layer ", L::index, ") needs ",
               scratch_bytes(), " bytes of scratch for a batch of ", batch_, " but got ",
               c.scratch_bytes);
  }

  void im2col(const detail::LayerCall& c, float* col) const {
    const std::size_t count = batch_ * L::out_frames * patch;
    kernels::conv1d_im2col<L>
        <<<grid_blocks(count), block_threads, 0, c.stream>>>(c.x, col, c.frames, count);
    LOOM_CUDA_LAUNCH_CHECK("conv1d_im2col");
  }

  GemmArgs gemm_args(const float* a, const float* b, float* result,
                     const detail::LayerCall& c) const {
    return detail::gemm_call(a, b, result, c.scratch + fixed_bytes(batch_),
                             c.scratch_bytes - fixed_bytes(batch_), c.stream);
  }

  std::size_t batch_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

}  // namespace loom::gpu
