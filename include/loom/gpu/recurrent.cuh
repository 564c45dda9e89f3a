// GRU and LSTM layers on the GPU (detail::RecurrentLayer): the CPU layer's
// algorithm with the same buffers, so the two backends can be compared step
// by step. Forward: one GEMM for every step's input projections (+ b_ih),
// then per step b_hh broadcast, a GEMM adding h_t-1 by W_hh to it, and a
// cell kernel, one thread per sample and hidden unit, running the CPU's own
// GruCell/LstmCell::step_at. Backward runs the steps in reverse: the cell's
// step_back_at, b_hh's column sums, and GEMMs adding into dW_hh and
// d(loss)/d(h_t-1); then one GEMM for dW_ih (its epilogue sums b_ih's
// gradient) and one for dx. Gradients are overwritten, never accumulated
// across calls, and every sum runs in a fixed order (no atomics). It runs a
// GRU or LSTM inside a block (device_layers.cuh); one direction only, and
// every sample over all the steps: a call with per-sample lengths is
// refused (cudnn_rnn.cuh's runner, used outside blocks, has both).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <utility>

#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/gemm.hpp"
#include "../backend/cuda/launch.hpp"
#include "../layers/recurrent.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace kernels {

// Step t of every sample; thread (s, j) computes hidden unit j of sample s.
template <class L>
__global__ void recurrent_step(const float* xg, const float* hg, float* saved, float* y,
                               std::size_t n, std::size_t t) {
  constexpr std::size_t H = L::H;
  const std::size_t grid_stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * H;
       i += grid_stride) {
    const std::size_t s = i / H, j = i % H;
    float* cur = saved + s * L::stride + t * L::block;
    L::Cell::step_at(H, j, xg + (s * L::steps + t) * L::GH, hg + s * L::GH,
                     t > 0 ? cur - L::block : nullptr, cur);
    const float h = cur[L::Cell::h_block * H + j];
    if constexpr (L::spec::sequence)
      y[(s * L::steps + t) * H + j] = h;
    else if (t + 1 == L::steps)
      y[s * H + j] = h;
  }
}

// Step t backward; thread (s, j) owns element j of each of sample s's
// vectors (dh, dc, dh_prev, and gate j of every block of dgi and dgh).
template <class L>
__global__ void recurrent_step_back(const float* saved, const float* dy, float* dh, float* dc,
                                    float* dgi, float* dgh, float* dh_prev, std::size_t n,
                                    std::size_t t) {
  constexpr std::size_t H = L::H;
  const std::size_t grid_stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * H;
       i += grid_stride) {
    const std::size_t s = i / H, j = i % H;
    float* d = dh + s * H;
    if constexpr (L::spec::sequence)
      d[j] += dy[(s * L::steps + t) * H + j];
    else if (t + 1 == L::steps)
      d[j] = dy[s * H + j];
    const float* cur = saved + s * L::stride + t * L::block;
    L::Cell::step_back_at(H, j, cur, t > 0 ? cur - L::block : nullptr, d, dc + s * H,
                          dgi + (s * L::steps + t) * L::GH, dgh + s * L::GH, dh_prev + s * H);
  }
}

// Every row of a rows x cols matrix set to `row`.
template <class T>
__global__ void fill_rows(T* m, const T* row, std::size_t rows, std::size_t cols) {
  const std::size_t grid_stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < rows * cols; i += grid_stride)
    m[i] = row[i % cols];
}

// sums[g] += the column sum of a rows x cols matrix. One thread per column
// adding the rows in order: the CPU's order, and no atomics.
template <class T>
__global__ void add_column_sums(const T* m, std::size_t rows, std::size_t cols, T* sums) {
  const std::size_t grid_stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t g = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < cols;
       g += grid_stride) {
    T sum = sums[g];
    for (std::size_t r = 0; r < rows; ++r) sum += m[r * cols + g];
    sums[g] = sum;
  }
}

}  // namespace kernels

// L: an executed GRU or LSTM layer (Bind<GRU<...>, In, I>, Bind<LSTM<...>, In, I>).
// Scratch, each region padded to DeviceArena::alignment: the input
// projections of every step (their gradients in backward), one step's
// recurrent projections (their gradients), d(loss)/d(h_t), d(loss)/d(h_t-1),
// d(loss)/d(c_t) (n x H each), then the cuBLASLt workspace.
template <class L>
class RecurrentRunner {
  static_assert(!L::spec::bidirectional,
                "loom: a bidirectional GRU or LSTM (BiGRU, BiLSTM, Bidirectional = true) inside a "
                "block (Residual, Series, ...) runs on the CPU only; on the GPU put it outside "
                "the block (it then runs on cuDNN) or train this network on CPU devices");
 public:
  RecurrentRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
                  bool allow_tf32)
      : batch_(batch) {
    const GemmOptions whole =
        detail::gemm_options(allow_tf32 ? TensorMath::tf32 : TensorMath::fp32, library_limit);
    GemmOptions per_step = whole;
    per_step.alignment_bytes = step_alignment;
    const std::size_t rows = batch * steps;
    const auto plan = [&](const GemmShape& shape, Epilogue epilogue, const GemmOptions& options) {
      auto made = std::make_unique<GemmPlan>(context.blas, shape, epilogue, options);
      workspace_bytes_ = std::max(workspace_bytes_, made->workspace_bytes());
      return made;
    };
    input_proj_ = plan({false, true, rows, GH, F, F, F, GH}, Epilogue::bias, whole);
    // A single step has no recurrent GEMM (its state is zero).
    if constexpr (steps > 1) {
      recurrent_proj_ =
          plan({false, true, batch, GH, H, L::stride, H, GH}, Epilogue::none, per_step);
      recurrent_weight_grad_ =
          plan({true, false, GH, H, batch, GH, L::stride, H}, Epilogue::none, per_step);
      recurrent_input_grad_ =
          plan({false, false, batch, H, GH, GH, H, H}, Epilogue::none, per_step);
    }
    input_weight_grad_ = plan({true, false, GH, F, rows, GH, F, F}, Epilogue::bgrad_a, whole);
    input_grad_ = plan({false, false, rows, F, GH, GH, F, F}, Epilogue::none, whole);
  }

  std::size_t scratch_bytes() const { return work_bytes() + workspace_bytes_; }
  // The scratch apart from cuBLASLt's workspace, for a batch of n: the five
  // work regions (the owner gives the workspace what is left).
  static std::size_t fixed_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * steps * GH) +
           DeviceArena::padded_bytes<float>(n * GH) + 3 * DeviceArena::padded_bytes<float>(n * H);
  }

  void forward(const detail::LayerCall& c) {
    refuse_frames(c);
    const Work w = carve(c);
    GemmArgs input = gemm_args(c.x, c.weights + L::w_ih, w.gates_x, w, c);
    input.bias = c.bias + ih_bias;
    input_proj_->run(input);
    for (std::size_t t = 0; t < steps; ++t) {
      // b_hh enters as C with beta = 1, not as a bias epilogue: its offset
      // in the bias block may leave it 4-byte aligned, which cuBLASLt's bias
      // epilogues are not documented to accept. Step 0 (zero state) is b_hh
      // alone, as on the CPU.
      kernels::fill_rows<float><<<grid_blocks(batch_ * GH), block_threads, 0, c.stream>>>(
          w.gates_h, c.bias + hh_bias, batch_, GH);
      LOOM_CUDA_LAUNCH_CHECK("fill_rows");
      if (t > 0) {
        GemmArgs recurrent = gemm_args(h_prev(c.saved, t), c.weights + L::w_hh, w.gates_h, w, c);
        recurrent.beta = 1.0f;
        recurrent_proj_->run(recurrent);
      }
      kernels::recurrent_step<L><<<grid_blocks(batch_ * H), block_threads, 0, c.stream>>>(
          w.gates_x, w.gates_h, c.saved, c.y, batch_, t);
      LOOM_CUDA_LAUNCH_CHECK("recurrent_step");
    }
  }

  void backward(const detail::LayerCall& c) {
    refuse_frames(c);
    const Work w = carve(c);
    float* dh = w.dh;
    float* dh_prev = w.dh_prev;
    float* dw_hh = c.dweights + L::w_hh;
    float* db_hh = c.dbias + hh_bias;
    // Zeroed, then summed over the steps, as on the CPU.
    for (auto [buffer, count] : {std::pair{dw_hh, GH * H}, std::pair{db_hh, GH},
                                 std::pair{dh, batch_ * H}, std::pair{w.dc, batch_ * H}})
      LOOM_CUDA_CHECK(cudaMemsetAsync(buffer, 0, count * sizeof(float), c.stream));
    for (std::size_t t = steps; t-- > 0;) {
      kernels::recurrent_step_back<L><<<grid_blocks(batch_ * H), block_threads, 0, c.stream>>>(
          c.saved, c.dy, dh, w.dc, w.gates_x, w.gates_h, dh_prev, batch_, t);
      LOOM_CUDA_LAUNCH_CHECK("recurrent_step_back");
      kernels::add_column_sums<float>
          <<<grid_blocks(GH), block_threads, 0, c.stream>>>(w.gates_h, batch_, GH, db_hh);
      LOOM_CUDA_LAUNCH_CHECK("add_column_sums");
      if (t > 0) {
        GemmArgs weights = gemm_args(w.gates_h, h_prev(c.saved, t), dw_hh, w, c);
        weights.beta = 1.0f;
        recurrent_weight_grad_->run(weights);
        GemmArgs state = gemm_args(w.gates_h, c.weights + L::w_hh, dh_prev, w, c);
        state.beta = 1.0f;
        recurrent_input_grad_->run(state);
      }
      std::swap(dh, dh_prev);
    }
    GemmArgs weights = gemm_args(w.gates_x, c.x, c.dweights + L::w_ih, w, c);
    weights.bias_grad = c.dbias + ih_bias;
    input_weight_grad_->run(weights);
    if (c.dx != nullptr) input_grad_->run(gemm_args(w.gates_x, c.weights + L::w_ih, c.dx, w, c));
  }

 private:
  static constexpr std::size_t H = L::H;
  static constexpr std::size_t F = L::features;
  static constexpr std::size_t GH = L::GH;
  static constexpr std::size_t steps = L::steps;
  // Where b_ih and b_hh sit in the bias block (it starts at L::b_ih).
  static constexpr std::size_t ih_bias = L::b_ih - L::weight_count;
  static constexpr std::size_t hh_bias = L::b_hh - L::weight_count;
  // Where h sits in a step's saved block.
  static constexpr std::size_t h_offset = L::Cell::h_block * H;

  // The alignment, up to cuBLASLt's 16 bytes, that a pointer keeps when it
  // is offset from a 16-byte aligned base by any of these float counts.
  static constexpr std::size_t offset_alignment(std::initializer_list<std::size_t> offsets) {
    std::size_t alignment = 16;
    for (const std::size_t offset : offsets)
      while (offset * sizeof(float) % alignment != 0) alignment /= 2;
    return alignment;
  }
  // Every LayerCall buffer and scratch region starts 16-byte aligned (the
  // arena gives 256; GemmPlan::run checks). The whole-sequence GEMMs use
  // those starts only. The per-step GEMMs also take h_t-1 (at
  // (t-1) * block + h_offset in the saved buffer) and W_hh and dW_hh (at
  // w_hh): with H = 5, say, only 4 bytes are certain.
  // Leading dimensions are part of the layouts cuBLASLt plans with, so only
  // the pointers need promising here.
  static constexpr std::size_t step_alignment = offset_alignment({L::block, h_offset, L::w_hh});

  struct Work {
    float* gates_x;  // n x steps x GH: input projections, then their gradients
    float* gates_h;  // n x GH: one step's recurrent projections, then their gradients
    float* dh;
    float* dh_prev;
    float* dc;
    unsigned char* workspace;
    std::size_t workspace_bytes;
  };

  std::size_t gates_x_bytes() const {
    return DeviceArena::padded_bytes<float>(batch_ * steps * GH);
  }
  std::size_t gates_h_bytes() const { return DeviceArena::padded_bytes<float>(batch_ * GH); }
  std::size_t state_bytes() const { return DeviceArena::padded_bytes<float>(batch_ * H); }
  std::size_t work_bytes() const { return fixed_bytes(batch_); }

  // The kernels run every sample over all the steps; with per-sample
  // lengths they would compute other numbers than the CPU layer, so the
  // call stops instead.
  static void refuse_frames(const detail::LayerCall& c) {
    LOOM_CHECK(c.frames == nullptr && c.host_frames == nullptr, "RecurrentRunner<", L::kind,
               "> (", ::loom::detail::layer_path_text(L::index), "): per-sample lengths (a batch with frames) reach a ",
               L::Cell::name, " inside a block (Residual, Series, ...), whose GPU runner runs "
               "every sample over all ", steps, " steps; put the ", L::Cell::name,
               " outside the block (cuDNN's runner honours lengths), give every sample all its "
               "frames, or train on CPU devices");
  }

  Work carve(const detail::LayerCall& c) const {
    LOOM_CHECK(c.scratch_bytes >= scratch_bytes(), "RecurrentRunner<", L::kind, "> (layer ",
               L::index, "): ", c.scratch_bytes, " bytes of scratch given, ", scratch_bytes(),
               " needed for a batch of ", batch_, "; size the scratch with scratch_bytes()");
    unsigned char* at = c.scratch;
    const auto take = [&](std::size_t bytes) {
      float* region = reinterpret_cast<float*>(at);
      at += bytes;
      return region;
    };
    Work w{};
    w.gates_x = take(gates_x_bytes());
    w.gates_h = take(gates_h_bytes());
    w.dh = take(state_bytes());
    w.dh_prev = take(state_bytes());
    w.dc = take(state_bytes());
    w.workspace = at;
    w.workspace_bytes = c.scratch_bytes - work_bytes();
    return w;
  }

  // h_t-1 of every sample: a column block of the saved buffer, rows L::stride apart.
  static const float* h_prev(const float* saved, std::size_t t) {
    return saved + (t - 1) * L::block + h_offset;
  }

  static GemmArgs gemm_args(const float* a, const float* b, float* out, const Work& w,
                            const detail::LayerCall& c) {
    return detail::gemm_call(a, b, out, w.workspace, w.workspace_bytes, c.stream);
  }

  std::size_t batch_;
  std::size_t workspace_bytes_ = 0;
  std::unique_ptr<GemmPlan> input_proj_, recurrent_proj_, recurrent_weight_grad_,
      recurrent_input_grad_, input_weight_grad_, input_grad_;
};

}  // namespace loom::gpu
