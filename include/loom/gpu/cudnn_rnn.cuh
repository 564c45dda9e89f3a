// GRU and LSTM layers, one- or two-directional, on cuDNN's RNN
// (cudnnRNNForward, cudnnRNNBackwardData_v8, cudnnRNNBackwardWeights_v8):
// the whole sequence in one call each way, where recurrent.cuh's runner
// launches a GEMM and a cell kernel per step. cuDNN's cells are the CPU
// layer's equations (PyTorch's: two bias vectors, the GRU's reset gate
// applied to W_hn h + b_hn) with the same gate order (r, z, n; i, f, g, o),
// and its bidirectional output is the CPU's (each step's forward h, then its
// reverse h), so only the weights move: cuDNN keeps them in its own buffer
// (the weight space) in an order that cudnnGetRNNWeightParams reports
// matrix by matrix, direction by direction (pseudo-layer 0 forward, 1
// reverse). Each forward copies the layer's matrices and bias vectors there
// (device to device), and each backward copies the weight-space gradients
// back out. A bidirectional layer's reverse tensors lie in its bias block
// (the CPU layer splits its parameters before the first bias only).
//
// Per-sample lengths (LayerCall::frames and host_frames) are PyTorch's
// pack_padded_sequence, as on the CPU: cuDNN runs sample s over its first
// len steps only (the reverse direction from step len - 1 down to 0), and
// the runner makes the padding what the CPU layer writes: zero outputs past
// len (a last-state output of a sample with no frames is zero) and zero
// input gradients there. cuDNN does not say whether it reads the padding of
// x and dy in its unpacked layouts, and a padded row times a zero gradient
// is NaN when the padding holds NaN, so the runner hands cuDNN copies of x
// and dy with zero padding (its own buffer, n x steps x max(F, 2H) floats).
//
// CUDA graphs and lengths. cuDNN takes the lengths twice: on the host in
// the RNN data descriptors (cudnnSetRNNDataDescriptor's seqLengthArray),
// which cudnnRNNForward and the backward calls read when they plan their
// launches, and on the device (devSeqLengths, documented as "a copy of
// seqLengthArray", read by the kernels). A graph replays the launches that
// were planned at capture, so a captured call is right only for the lengths
// it was captured with; cuDNN documents no way to take the lengths from
// device memory alone. The runner therefore:
//   - without lengths, uses two descriptors made once with every length =
//     steps and never changed: capture and replay as before;
//   - with lengths, re-sets two other descriptors from host_frames on every
//     call, which must then run outside any capture. capturable(call) says
//     so, and a call with lengths on a capturing stream throws instead of
//     baking this batch's lengths into a graph.
// The owner (the GPU stage) must run a pass whose batch has per-sample
// frames directly, not through its graphs, whenever the network has a layer on
// this runner; host_frames need only live for the call (cuDNN copies them
// into the descriptor), frames until the call's work has run.
//
// What forward leaves for backward (cuDNN's reserve space and, for a layer
// that returns its last state only, every step's output, which cuDNN's
// backward reads) lives in the layer's saved area, whose size only cuDNN
// knows: saved_floats() says how much the owner must give for this batch.
// A block lays its layers' saved areas out at compile time, so a
// GRU or LSTM inside one runs on recurrent.cuh's runner instead.
//
// The weight spaces, the all-steps lengths cuDNN reads on the device, a zero
// output gradient (last-state layers), an input gradient for a first layer
// that wants none, the zero-padded copies and a bidirectional last state in
// cuDNN's direction-major order are this runner's own, allocated once when
// it is made, never in a step. Its scratch is cuDNN's workspace. Making it
// also runs one throwaway training step of cuDNN's (on zeros, then waits):
// whatever cuDNN sets up on first use happens here, outside any CUDA graph
// capture (as a device model's first step of each shape is, StepGraphs),
// where a failure names this layer.
//
// bf16 and fp16 networks round a sequence layer's output in place after
// forward; cuDNN's backward reads that output, so its gradients differ from
// the CPU's emulation (which keeps its own states) by that rounding.
#pragma once

#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/conv.cuh"
#include "../backend/cuda/launch.hpp"
#include "../backend/cuda/memory.hpp"
#include "../layers/recurrent.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace detail {

using RnnDescriptor = DnnDescriptor<cudnnRNNDescriptor_t, cudnnDestroyRNNDescriptor>;
using RnnDataDescriptor = DnnDescriptor<cudnnRNNDataDescriptor_t, cudnnDestroyRNNDataDescriptor>;
using DropoutDescriptor = DnnDescriptor<cudnnDropoutDescriptor_t, cudnnDestroyDropoutDescriptor>;

}  // namespace detail

namespace kernels {

// An n x steps x width tensor with sample s's steps at or past frames[s]
// set to zero and the others copied from `from` (which may be `to`).
inline __global__ void rnn_keep_valid_frames(const float* from, float* to,
                                             const std::int32_t* frames, std::size_t n,
                                             std::size_t steps, std::size_t width) {
  const std::size_t grid_stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n * steps * width; i += grid_stride) {
    const std::size_t row = i / width, s = row / steps, t = row % steps;
    to[i] = t < static_cast<std::size_t>(frames[s]) ? from[i] : 0.0f;
  }
}

}  // namespace kernels

// L: an executed GRU or LSTM layer (Bind<GRU<...>, In, I>, Bind<LSTM<...>, In, I>).
template <class L>
class CudnnRecurrentRunner {
 public:
  // tensor_cores: cuDNN may use TF32 tensor-op kernels; off, FMA kernels
  // only (CUDNN_FMA_MATH), as the convolutions.
  CudnnRecurrentRunner(DeviceContext& context, std::size_t batch, std::size_t /*library_limit*/,
                       bool tensor_cores)
      : handle_(context.dnn.get()), batch_(batch), what_(describe(batch)) {
    const int n = to_int(batch, "batch"), t = to_int(steps, "steps");
    const int h = to_int(H, "hidden size"), d = static_cast<int>(D);
    LOOM_CHECK(batch * steps * std::max(F, W) <= static_cast<std::size_t>(INT_MAX), what_,
               ": a sequence batch of more than INT_MAX values, more than cuDNN addresses; "
               "split the batch");

    dropout_.reset(create<cudnnDropoutDescriptor_t>(cudnnCreateDropoutDescriptor,
                                                    "cudnnCreateDropoutDescriptor"));
    // No dropout (one layer): cuDNN needs no random state then.
    check(cudnnSetDropoutDescriptor(dropout_.get(), handle_, 0.0f, nullptr, 0, 0),
          "cudnnSetDropoutDescriptor");
    rnn_.reset(create<cudnnRNNDescriptor_t>(cudnnCreateRNNDescriptor, "cudnnCreateRNNDescriptor"));
    check(cudnnSetRNNDescriptor_v8(rnn_.get(), CUDNN_RNN_ALGO_STANDARD,
                                   G == 3 ? CUDNN_GRU : CUDNN_LSTM, CUDNN_RNN_DOUBLE_BIAS,
                                   D == 2 ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL,
                                   CUDNN_LINEAR_INPUT, CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT,
                                   tensor_cores ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH,
                                   to_int(F, "features"), h, h, 1, dropout_.get(),
                                   CUDNN_RNN_PADDED_IO_ENABLED),
          "cudnnSetRNNDescriptor_v8");

    // Batch-major [n][steps][width], the layer's own input and (sequence)
    // output layout. x_ and y_ have every length = steps and are never
    // changed again; x_frames_ and y_frames_ take each call's lengths.
    const std::vector<int> lengths(batch, t);
    for (auto* desc : {&x_, &y_, &x_frames_, &y_frames_})
      desc->reset(create<cudnnRNNDataDescriptor_t>(cudnnCreateRNNDataDescriptor,
                                                   "cudnnCreateRNNDataDescriptor"));
    set_lengths(x_.get(), F, lengths.data());
    set_lengths(y_.get(), W, lengths.data());
    h_.reset(create<cudnnTensorDescriptor_t>(cudnnCreateTensorDescriptor,
                                             "cudnnCreateTensorDescriptor"));
    // [directions][n][H], as cuDNN orders the last states.
    const std::array<int, 3> dims{d, n, h}, strides{n * h, h, 1};
    check(cudnnSetTensorNdDescriptor(h_.get(), CUDNN_DATA_FLOAT, 3, dims.data(), strides.data()),
          "cudnnSetTensorNdDescriptor");

    check(cudnnGetRNNWeightSpaceSize(handle_, rnn_.get(), &weight_bytes_),
          "cudnnGetRNNWeightSpaceSize");
    std::size_t train_work = 0, infer_work = 0, unused = 0;
    check(cudnnGetRNNTempSpaceSizes(handle_, rnn_.get(), CUDNN_FWD_MODE_TRAINING, x_.get(),
                                    &train_work, &reserve_bytes_),
          "cudnnGetRNNTempSpaceSizes");
    check(cudnnGetRNNTempSpaceSizes(handle_, rnn_.get(), CUDNN_FWD_MODE_INFERENCE, x_.get(),
                                    &infer_work, &unused),
          "cudnnGetRNNTempSpaceSizes");
    workspace_bytes_ = std::max(train_work, infer_work);

    weights_ = DeviceBuffer<unsigned char>(weight_bytes_, what_ + " weight space");
    dweights_ = DeviceBuffer<unsigned char>(weight_bytes_, what_ + " weight-space gradients");
    // On the context's stream, which the layer's calls run on: ordered
    // before them (a pageable copy has read `lengths` on return).
    const cudaStream_t stream = context.stream.get();
    lengths_ = DeviceBuffer<std::int32_t>(batch, what_ + " sequence lengths");
    copy_async(lengths_.data(), lengths.data(), batch, cudaMemcpyHostToDevice, stream);
    if constexpr (!L::spec::sequence) {
      zero_dy_ = DeviceBuffer<float>(batch * steps * W, what_ + " zero output gradient");
      LOOM_CUDA_CHECK(
          cudaMemsetAsync(zero_dy_.data(), 0, zero_dy_.size() * sizeof(float), stream));
      if constexpr (D == 2)
        last_states_ = DeviceBuffer<float>(D * batch * H, what_ + " last states by direction");
    }
    spare_dx_ = DeviceBuffer<float>(batch * steps * F, what_ + " unwanted input gradient");
    padded_ = DeviceBuffer<float>(batch * steps * std::max(F, W),
                                  what_ + " input or output gradient with zero padding");
    LOOM_CUDA_CHECK(cudaMemsetAsync(weights_.data(), 0, weight_bytes_, stream));
    map_weights();
    warm_up(stream);
  }

  std::size_t scratch_bytes() const { return workspace_bytes_; }
  // The saved area this batch needs, in floats: cuDNN's reserve space
  // (256-byte aligned), then, for a last-state layer, every step's output.
  std::size_t saved_floats() const { return reserve_floats() + outputs_floats(); }

  // Whether this call may be captured into a CUDA graph and replayed for
  // later batches: only without per-sample lengths (see the file comment).
  static bool capturable(const detail::LayerCall& c) { return c.host_frames == nullptr; }

  void forward(const detail::LayerCall& c) {
    require_scratch(c);
    const Lengths lengths = lengths_of(c, c.training ? CUDNN_FWD_MODE_TRAINING
                                                     : CUDNN_FWD_MODE_INFERENCE);
    check(cudnnSetStream(handle_, c.stream), "cudnnSetStream");
    copy_weights(c, false);
    const float* x = c.x;
    if (c.frames != nullptr) x = keep_valid(c.x, padded_.data(), c.frames, steps, F, c.stream);
    float* outputs = L::spec::sequence ? c.y : c.saved + reserve_floats();
    float* last = nullptr;
    if constexpr (!L::spec::sequence) last = D == 2 ? last_states_.data() : c.y;
    check(cudnnRNNForward(handle_, rnn_.get(),
                          c.training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
                          lengths.device, lengths.x, x, lengths.y, outputs, h_.get(), nullptr,
                          last, h_.get(), nullptr, nullptr, weight_bytes_, weights_.data(),
                          workspace_bytes_, c.scratch, c.training ? reserve_bytes_ : 0,
                          c.training ? c.saved : nullptr),
          "cudnnRNNForward");
    if constexpr (!L::spec::sequence && D == 2)
      for (std::size_t d = 0; d < D; ++d)
        copy_rows(c.y + d * H, W, last_states_.data() + d * batch_ * H, H, c.stream);
    if (c.frames != nullptr) {
      // cuDNN documents the descriptor's fill (zero) for the padding of
      // every step's outputs; as no GPU has confirmed it for these layouts
      // yet and backward reads them, they are zeroed here too (one pass).
      // A last-state layer's y is cuDNN's hy, of which cuDNN says nothing
      // for a sample with no frames; the CPU writes zero.
      keep_valid(outputs, outputs, c.frames, steps, W, c.stream);
      if constexpr (!L::spec::sequence) keep_valid(c.y, c.y, c.frames, 1, W, c.stream);
    }
  }

  // After a training forward of the same batch (its saved area, the same
  // frames), with the same weights: the weight space still holds them.
  void backward(const detail::LayerCall& c) {
    require_scratch(c);
    const Lengths lengths = lengths_of(c, CUDNN_FWD_MODE_TRAINING);
    check(cudnnSetStream(handle_, c.stream), "cudnnSetStream");
    const float* outputs = L::spec::sequence ? c.y : c.saved + reserve_floats();
    const float* dy = L::spec::sequence ? c.dy : zero_dy_.data();
    if (L::spec::sequence && c.frames != nullptr)
      dy = keep_valid(c.dy, padded_.data(), c.frames, steps, W, c.stream);
    const float* last_dy = nullptr;
    if constexpr (!L::spec::sequence) {
      if constexpr (D == 2)
        for (std::size_t d = 0; d < D; ++d)
          copy_rows(last_states_.data() + d * batch_ * H, H, c.dy + d * H, W, c.stream);
      last_dy = D == 2 ? last_states_.data() : c.dy;
    }
    float* dx = c.dx != nullptr ? c.dx : spare_dx_.data();
    check(cudnnRNNBackwardData_v8(handle_, rnn_.get(), lengths.device, lengths.y, outputs, dy,
                                  lengths.x, dx, h_.get(), nullptr, last_dy, nullptr, h_.get(),
                                  nullptr, nullptr, nullptr, weight_bytes_, weights_.data(),
                                  workspace_bytes_, c.scratch, reserve_bytes_, c.saved),
          "cudnnRNNBackwardData_v8");
    // cuDNN documents its padding fill for outputs, not for dx: the CPU's
    // zeros are written here.
    if (c.dx != nullptr && c.frames != nullptr)
      keep_valid(c.dx, c.dx, c.frames, steps, F, c.stream);
    // cuDNN only adds weight gradients (CUDNN_WGRAD_MODE_ADD).
    LOOM_CUDA_CHECK(cudaMemsetAsync(dweights_.data(), 0, weight_bytes_, c.stream));
    // The padded copy of dy is read by now (same stream): x's takes its place.
    const float* x = c.x;
    if (c.frames != nullptr) x = keep_valid(c.x, padded_.data(), c.frames, steps, F, c.stream);
    check(cudnnRNNBackwardWeights_v8(handle_, rnn_.get(), CUDNN_WGRAD_MODE_ADD, lengths.device,
                                     lengths.x, x, h_.get(), nullptr, lengths.y, outputs,
                                     weight_bytes_, dweights_.data(), workspace_bytes_, c.scratch,
                                     reserve_bytes_, c.saved),
          "cudnnRNNBackwardWeights_v8");
    copy_weights(c, true);
  }

 private:
  static constexpr std::size_t H = L::H;
  static constexpr std::size_t F = L::features;
  static constexpr std::size_t G = L::Cell::gates;
  static constexpr std::size_t D = L::directions;
  static constexpr std::size_t W = L::width;  // output values per step: D x H
  static constexpr std::size_t steps = L::steps;

  // One of cuDNN's 2G matrices or 2G bias vectors per direction: `count`
  // floats at `offset` in the layer's parameters (its weight block below
  // L::weight_count, its bias block from there) and at `space` bytes into
  // the weight space.
  struct Piece {
    std::size_t offset, count, space;
  };

  // The lengths one call runs with: the data descriptors and their device copy.
  struct Lengths {
    cudnnRNNDataDescriptor_t x, y;
    const std::int32_t* device;
  };

  static std::string describe(std::size_t batch) {
    return std::string(L::kind) + "<" + std::to_string(H) + (D == 2 ? ", bidirectional" : "") +
           "> on cuDNN (layer " + std::to_string(L::index) + ", batch " + std::to_string(batch) +
           " x " + std::to_string(steps) + " steps x " + std::to_string(F) + " features)";
  }

  std::size_t reserve_floats() const {
    return DeviceArena::padded_bytes<unsigned char>(reserve_bytes_) / sizeof(float);
  }
  std::size_t outputs_floats() const { return L::spec::sequence ? 0 : batch_ * steps * W; }

  void set_lengths(cudnnRNNDataDescriptor_t desc, std::size_t width, const int* lengths) const {
    // The output's padding is written with this (the CPU's zero).
    float fill = 0.0f;
    check(cudnnSetRNNDataDescriptor(desc, CUDNN_DATA_FLOAT,
                                    CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED,
                                    static_cast<int>(steps), static_cast<int>(batch_),
                                    static_cast<int>(width), lengths, &fill),
          "cudnnSetRNNDataDescriptor");
  }

  // The all-steps descriptors without frames; with them, the per-call ones
  // set to host_frames (after checking them and that no capture is under
  // way: see the file comment).
  Lengths lengths_of(const detail::LayerCall& c, cudnnForwardMode_t mode) {
    LOOM_CHECK((c.frames == nullptr) == (c.host_frames == nullptr), what_,
               ": a LayerCall with frames ", c.frames == nullptr ? "null" : "set",
               " but host_frames ", c.host_frames == nullptr ? "null" : "set",
               "; cuDNN needs each sample's length both on the device and on the host");
    if (c.host_frames == nullptr) return {x_.get(), y_.get(), lengths_.data()};
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    LOOM_CUDA_CHECK(cudaStreamIsCapturing(c.stream, &capture));
    LOOM_CHECK(capture == cudaStreamCaptureStatusNone, what_,
               ": per-sample lengths on a stream being captured into a CUDA graph; cuDNN plans "
               "its launches from the host lengths, so a replay would run this batch's lengths "
               "for every later batch; run steps with lengths uncaptured (capturable(call))");
    for (std::size_t s = 0; s < batch_; ++s)
      LOOM_CHECK(c.host_frames[s] >= 0 && static_cast<std::size_t>(c.host_frames[s]) <= steps,
                 what_, ": sample ", s, " has ", c.host_frames[s], " frames, outside 0..", steps,
                 " (the steps of its input)");
    set_lengths(x_frames_.get(), F, c.host_frames);
    set_lengths(y_frames_.get(), W, c.host_frames);
    // The owner sized the workspace and reserve space for full lengths;
    // shorter ones should never need more, and if cuDNN says otherwise the
    // call stops here rather than overrun them.
    std::size_t work = 0, reserve = 0;
    check(cudnnGetRNNTempSpaceSizes(handle_, rnn_.get(), mode, x_frames_.get(), &work, &reserve),
          "cudnnGetRNNTempSpaceSizes");
    LOOM_CHECK(work <= workspace_bytes_ && reserve <= reserve_bytes_, what_,
               ": cuDNN asks for ", work, " bytes of workspace and ", reserve,
               " of reserve space for this batch's lengths, more than the ", workspace_bytes_,
               " and ", reserve_bytes_, " it asked for at full length");
    return {x_frames_.get(), y_frames_.get(), c.frames};
  }

  // `to` = `from` with every step at or past its sample's frames zero (n
  // samples of `rows` steps of `width` values); returns `to`.
  const float* keep_valid(const float* from, float* to, const std::int32_t* frames,
                          std::size_t rows, std::size_t width, cudaStream_t stream) const {
    kernels::rnn_keep_valid_frames<<<grid_blocks(batch_ * rows * width), block_threads, 0,
                                     stream>>>(from, to, frames, batch_, rows, width);
    LOOM_CUDA_LAUNCH_CHECK("rnn_keep_valid_frames");
    return to;
  }

  // n rows of H floats, `from` rows `from_pitch` floats apart to `to` rows
  // `to_pitch` apart: a bidirectional last state between the layer's
  // [n][2H] and cuDNN's [2][n][H].
  void copy_rows(float* to, std::size_t to_pitch, const float* from, std::size_t from_pitch,
                 cudaStream_t stream) const {
    LOOM_CUDA_CHECK(cudaMemcpy2DAsync(to, to_pitch * sizeof(float), from,
                                      from_pitch * sizeof(float), H * sizeof(float), batch_,
                                      cudaMemcpyDeviceToDevice, stream));
  }

  // One training step on zeros in temporary buffers (see the file comment).
  void warm_up(cudaStream_t stream) {
    const std::size_t floats = batch_ * steps * std::max(F, W);
    DeviceBuffer<float> x(floats, what_ + " warm-up input"), y(floats, what_ + " warm-up output"),
        dx(floats, what_ + " warm-up input gradient");
    DeviceBuffer<unsigned char> reserve(reserve_bytes_, what_ + " warm-up reserve space"),
        work(workspace_bytes_, what_ + " warm-up workspace");
    for (float* buffer : {x.data(), y.data()})
      LOOM_CUDA_CHECK(cudaMemsetAsync(buffer, 0, floats * sizeof(float), stream));
    check(cudnnSetStream(handle_, stream), "cudnnSetStream");
    check(cudnnRNNForward(handle_, rnn_.get(), CUDNN_FWD_MODE_TRAINING, lengths_.data(), x_.get(),
                          x.data(), y_.get(), y.data(), h_.get(), nullptr, nullptr, h_.get(),
                          nullptr, nullptr, weight_bytes_, weights_.data(), workspace_bytes_,
                          work.data(), reserve_bytes_, reserve.data()),
          "cudnnRNNForward (warm-up)");
    check(cudnnRNNBackwardData_v8(handle_, rnn_.get(), lengths_.data(), y_.get(), y.data(),
                                  y.data(), x_.get(), dx.data(), h_.get(), nullptr, nullptr,
                                  nullptr, h_.get(), nullptr, nullptr, nullptr, weight_bytes_,
                                  weights_.data(), workspace_bytes_, work.data(), reserve_bytes_,
                                  reserve.data()),
          "cudnnRNNBackwardData_v8 (warm-up)");
    check(cudnnRNNBackwardWeights_v8(handle_, rnn_.get(), CUDNN_WGRAD_MODE_ADD, lengths_.data(),
                                     x_.get(), x.data(), h_.get(), nullptr, y_.get(), y.data(),
                                     weight_bytes_, dweights_.data(), workspace_bytes_,
                                     work.data(), reserve_bytes_, reserve.data()),
          "cudnnRNNBackwardWeights_v8 (warm-up)");
    // The temporary buffers are freed on return: the step must be done.
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // Where cuDNN keeps each matrix and bias vector: in pseudo-layer d (the
  // direction: the layer's tensors from d x L::direction_params), linear
  // layer g < G is gate g's input matrix W (with b_ih's part), G + g its
  // recurrent matrix R (with b_hh's), gate g as PyTorch numbers it. Each
  // must hold exactly the floats loom copies there, packed, or the layouts
  // differ and nothing is guessed. Pieces adjacent in both buffers (and in
  // the same block of the layer's) are copied as one.
  void map_weights() {
    detail::TensorDescriptor matrix(create<cudnnTensorDescriptor_t>(
        cudnnCreateTensorDescriptor, "cudnnCreateTensorDescriptor"));
    detail::TensorDescriptor bias(create<cudnnTensorDescriptor_t>(cudnnCreateTensorDescriptor,
                                                                  "cudnnCreateTensorDescriptor"));
    const auto* base = weights_.data();
    for (std::size_t d = 0; d < D; ++d) {
      const std::size_t first = d * L::direction_params;
      for (std::size_t id = 0; id < 2 * G; ++id) {
        void* matrix_at = nullptr;
        void* bias_at = nullptr;
        check(cudnnGetRNNWeightParams(handle_, rnn_.get(), static_cast<std::int32_t>(d),
                                      weight_bytes_, weights_.data(),
                                      static_cast<std::int32_t>(id), matrix.get(), &matrix_at,
                                      bias.get(), &bias_at),
              "cudnnGetRNNWeightParams");
        const bool recurrent = id >= G;
        const std::size_t gate = id % G;
        const std::size_t columns = recurrent ? H : F;
        require_packed(matrix.get(), H * columns, d, id, "matrix");
        require_packed(bias.get(), H, d, id, "bias vector");
        add_piece({first + (recurrent ? L::w_hh : L::w_ih) + gate * H * columns, H * columns,
                   static_cast<std::size_t>(static_cast<unsigned char*>(matrix_at) - base)});
        add_piece({first + (recurrent ? L::b_hh : L::b_ih) + gate * H, H,
                   static_cast<std::size_t>(static_cast<unsigned char*>(bias_at) - base)});
      }
    }
  }

  void add_piece(const Piece& p) {
    const auto in_weights = [](std::size_t offset) { return offset < L::weight_count; };
    for (Piece& q : pieces_)
      if (in_weights(q.offset) == in_weights(p.offset) && q.offset + q.count == p.offset &&
          q.space + q.count * sizeof(float) == p.space) {
        q.count += p.count;
        return;
      }
    pieces_.push_back(p);
  }

  // `desc` must describe `want` floats without gaps (its dimensions in
  // any order of strides; cuDNN's matrices are row-major, as PyTorch's views
  // of them rely on).
  void require_packed(cudnnTensorDescriptor_t desc, std::size_t want, std::size_t direction,
                      std::size_t id, const char* what) const {
    cudnnDataType_t type{};
    int rank = 0;
    std::array<int, 8> dims{}, strides{};
    check(cudnnGetTensorNdDescriptor(desc, static_cast<int>(dims.size()), &type, &rank,
                                     dims.data(), strides.data()),
          "cudnnGetTensorNdDescriptor");
    std::vector<std::pair<long, long>> by_stride;  // (stride, dimension), dimensions above 1
    std::size_t count = 1;
    for (int i = 0; i < rank; ++i) {
      const auto k = static_cast<std::size_t>(i);
      count *= static_cast<std::size_t>(dims[k]);
      if (dims[k] > 1) by_stride.emplace_back(strides[k], dims[k]);
    }
    std::sort(by_stride.begin(), by_stride.end());
    long expected = 1;
    bool packed = true;
    for (const auto& [stride, dim] : by_stride) {
      packed = packed && stride == expected;
      expected *= dim;
    }
    LOOM_CHECK(type == CUDNN_DATA_FLOAT && count == want && packed, what_, ": cuDNN's ", what,
               " of linear layer ", id, " (direction ", direction, ") holds ", count,
               packed ? " packed" : " strided", " values, not the ", want,
               " packed floats loom's layout copies there");
  }

  // Layer parameters into the weight space, or (back) its gradients out
  // into the layer's gradient blocks.
  void copy_weights(const detail::LayerCall& c, bool back) {
    for (const Piece& p : pieces_) {
      unsigned char* space = (back ? dweights_.data() : weights_.data()) + p.space;
      const bool in_weights = p.offset < L::weight_count;
      const std::size_t at = in_weights ? p.offset : p.offset - L::weight_count;
      if (back) {
        float* to = (in_weights ? c.dweights : c.dbias) + at;
        copy_async(to, reinterpret_cast<const float*>(space), p.count, cudaMemcpyDeviceToDevice,
                   c.stream);
      } else {
        const float* from = (in_weights ? c.weights : c.bias) + at;
        copy_async(reinterpret_cast<float*>(space), from, p.count, cudaMemcpyDeviceToDevice,
                   c.stream);
      }
    }
  }

  void require_scratch(const detail::LayerCall& c) const {
    LOOM_CHECK(c.scratch_bytes >= workspace_bytes_, what_, ": ", c.scratch_bytes,
               " bytes of scratch given, ", workspace_bytes_,
               " needed; size the scratch with scratch_bytes()");
  }

  int to_int(std::size_t value, const char* what) const {
    LOOM_CHECK(value <= static_cast<std::size_t>(INT_MAX), what_, ": ", what, " = ", value,
               " does not fit cuDNN's int dimensions");
    return static_cast<int>(value);
  }

  void check(cudnnStatus_t status, const char* call) const {
    detail::check_dnn(status, call, what_);
  }

  template <class Handle, class Create>
  Handle create(Create create_fn, const char* call) const {
    return detail::create_dnn<Handle>(create_fn, call, what_);
  }

  cudnnHandle_t handle_;
  std::size_t batch_;
  std::string what_;
  detail::DropoutDescriptor dropout_;
  detail::RnnDescriptor rnn_;
  detail::RnnDataDescriptor x_, y_, x_frames_, y_frames_;
  detail::TensorDescriptor h_;
  std::size_t weight_bytes_ = 0, workspace_bytes_ = 0, reserve_bytes_ = 0;
  DeviceBuffer<unsigned char> weights_, dweights_;
  DeviceBuffer<std::int32_t> lengths_;
  DeviceBuffer<float> zero_dy_, last_states_, spare_dx_, padded_;
  std::vector<Piece> pieces_;
};

}  // namespace loom::gpu
