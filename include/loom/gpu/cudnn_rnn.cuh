// GRU and LSTM layers on cuDNN's RNN (cudnnRNNForward,
// cudnnRNNBackwardData_v8, cudnnRNNBackwardWeights_v8): the whole sequence
// in one call each way, where recurrent.cuh's runner launches a GEMM and a
// cell kernel per step. cuDNN's cells are the CPU layer's equations
// (PyTorch's: two bias vectors, the GRU's reset gate applied to W_hn h +
// b_hn) with the same gate order (r, z, n; i, f, g, o), so only the weights
// move: cuDNN keeps them in its own buffer (the weight space) in an order
// that cudnnGetRNNWeightParams reports matrix by matrix. Each forward copies
// the layer's 2G matrices and 2G bias vectors there (device to device), and
// each backward copies the weight-space gradients back out.
//
// What forward leaves for backward (cuDNN's reserve space and, for a layer
// that returns its last state only, every step's output, which cuDNN's
// backward reads) lives in the layer's saved area, whose size only cuDNN
// knows: saved_floats() says how much the owner must give for this batch.
// A Residual block lays its body's saved areas out at compile time, so a
// GRU or LSTM inside one runs on recurrent.cuh's runner instead.
//
// The weight spaces, the sequence lengths cuDNN reads on the device, a zero
// output gradient (last-state layers) and an input gradient for a first
// layer that wants none are this runner's own, allocated once when it is
// made, never in a step. Its scratch is cuDNN's workspace. Making it also
// runs one throwaway training step of cuDNN's (on zeros, then waits): a
// device model captures its first step as a CUDA graph, and whatever cuDNN
// sets up on first use happens here, outside the capture, where a failure
// names this layer.
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
#include "../backend/cuda/memory.hpp"
#include "../layers/recurrent.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace detail {

using RnnDescriptor = DnnDescriptor<cudnnRNNDescriptor_t, cudnnDestroyRNNDescriptor>;
using RnnDataDescriptor = DnnDescriptor<cudnnRNNDataDescriptor_t, cudnnDestroyRNNDataDescriptor>;
using DropoutDescriptor = DnnDescriptor<cudnnDropoutDescriptor_t, cudnnDestroyDropoutDescriptor>;

}  // namespace detail

// L: an executed GRU or LSTM layer (Bind<GRU<...>, In, I>, Bind<LSTM<...>, In, I>).
template <class L>
class CudnnRecurrentRunner {
  static_assert(!L::spec::bidirectional,
                "loom: a bidirectional GRU or LSTM (BiGRU, BiLSTM, Bidirectional = true) runs on "
                "the CPU only so far; train this network on CPU devices");
 public:
  // tensor_cores: cuDNN may use TF32 tensor-op kernels; off, FMA kernels
  // only (CUDNN_FMA_MATH), as the convolutions.
  CudnnRecurrentRunner(DeviceContext& context, std::size_t batch, std::size_t /*library_limit*/,
                       bool tensor_cores)
      : handle_(context.dnn.get()), batch_(batch), what_(describe(batch)) {
    const int n = to_int(batch, "batch"), t = to_int(steps, "steps");
    const int f = to_int(F, "features"), h = to_int(H, "hidden size");
    LOOM_CHECK(batch * steps * std::max(F, H) <= static_cast<std::size_t>(INT_MAX), what_,
               ": a sequence batch of more than INT_MAX values, more than cuDNN addresses; "
               "split the batch");

    dropout_.reset(create<cudnnDropoutDescriptor_t>(cudnnCreateDropoutDescriptor,
                                                    "cudnnCreateDropoutDescriptor"));
    // No dropout (one layer): cuDNN needs no random state then.
    check(cudnnSetDropoutDescriptor(dropout_.get(), handle_, 0.0f, nullptr, 0, 0),
          "cudnnSetDropoutDescriptor");
    rnn_.reset(create<cudnnRNNDescriptor_t>(cudnnCreateRNNDescriptor, "cudnnCreateRNNDescriptor"));
    check(cudnnSetRNNDescriptor_v8(rnn_.get(), CUDNN_RNN_ALGO_STANDARD,
                                   L::Cell::gates == 3 ? CUDNN_GRU : CUDNN_LSTM,
                                   CUDNN_RNN_DOUBLE_BIAS, CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT,
                                   CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT,
                                   tensor_cores ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH, f, h, h,
                                   1, dropout_.get(), CUDNN_RNN_PADDED_IO_ENABLED),
          "cudnnSetRNNDescriptor_v8");

    // Every sequence has all the steps: batch-major [n][steps][features],
    // the layer's own input and (sequence) output layout.
    const std::vector<int> lengths(batch, t);
    float fill = 0.0f;
    for (auto [desc, width] : {std::pair{&x_, f}, std::pair{&y_, h}}) {
      desc->reset(create<cudnnRNNDataDescriptor_t>(cudnnCreateRNNDataDescriptor,
                                                   "cudnnCreateRNNDataDescriptor"));
      check(cudnnSetRNNDataDescriptor(desc->get(), CUDNN_DATA_FLOAT,
                                      CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED, t, n, width,
                                      lengths.data(), &fill),
            "cudnnSetRNNDataDescriptor");
    }
    h_.reset(create<cudnnTensorDescriptor_t>(cudnnCreateTensorDescriptor,
                                             "cudnnCreateTensorDescriptor"));
    const std::array<int, 3> dims{1, n, h}, strides{n * h, h, 1};
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
    LOOM_CUDA_CHECK(cudaMemcpyAsync(lengths_.data(), lengths.data(), batch * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream));
    if constexpr (!L::spec::sequence) {
      zero_dy_ = DeviceBuffer<float>(batch * steps * H, what_ + " zero output gradient");
      LOOM_CUDA_CHECK(
          cudaMemsetAsync(zero_dy_.data(), 0, zero_dy_.size() * sizeof(float), stream));
    }
    spare_dx_ = DeviceBuffer<float>(batch * steps * F, what_ + " unwanted input gradient");
    LOOM_CUDA_CHECK(cudaMemsetAsync(weights_.data(), 0, weight_bytes_, stream));
    map_weights();
    warm_up(stream);
  }

  // The scratch a batch of n needs besides cuDNN's workspace: none.
  static std::size_t fixed_bytes(std::size_t) { return 0; }
  std::size_t scratch_bytes() const { return workspace_bytes_; }
  // The saved area this batch needs, in floats: cuDNN's reserve space
  // (256-byte aligned), then, for a last-state layer, every step's output.
  std::size_t saved_floats() const { return reserve_floats() + outputs_floats(); }

  void forward(const detail::LayerCall& c) {
    require_scratch(c);
    check(cudnnSetStream(handle_, c.stream), "cudnnSetStream");
    copy_weights(c, false);
    float* outputs = L::spec::sequence ? c.y : c.saved + reserve_floats();
    check(cudnnRNNForward(handle_, rnn_.get(),
                          c.training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
                          lengths_.data(), x_.get(), c.x, y_.get(), outputs, h_.get(), nullptr,
                          L::spec::sequence ? nullptr : c.y, h_.get(), nullptr, nullptr,
                          weight_bytes_, weights_.data(), workspace_bytes_, c.scratch,
                          c.training ? reserve_bytes_ : 0, c.training ? c.saved : nullptr),
          "cudnnRNNForward");
  }

  // After a training forward of the same batch (its saved area), with the
  // same weights: the weight space still holds them.
  void backward(const detail::LayerCall& c) {
    require_scratch(c);
    check(cudnnSetStream(handle_, c.stream), "cudnnSetStream");
    const float* outputs = L::spec::sequence ? c.y : c.saved + reserve_floats();
    const float* dy = L::spec::sequence ? c.dy : zero_dy_.data();
    check(cudnnRNNBackwardData_v8(handle_, rnn_.get(), lengths_.data(), y_.get(), outputs, dy,
                                  x_.get(), c.dx != nullptr ? c.dx : spare_dx_.data(), h_.get(),
                                  nullptr, L::spec::sequence ? nullptr : c.dy, nullptr, h_.get(),
                                  nullptr, nullptr, nullptr, weight_bytes_, weights_.data(),
                                  workspace_bytes_, c.scratch, reserve_bytes_, c.saved),
          "cudnnRNNBackwardData_v8");
    // cuDNN only adds weight gradients (CUDNN_WGRAD_MODE_ADD).
    LOOM_CUDA_CHECK(cudaMemsetAsync(dweights_.data(), 0, weight_bytes_, c.stream));
    check(cudnnRNNBackwardWeights_v8(handle_, rnn_.get(), CUDNN_WGRAD_MODE_ADD, lengths_.data(),
                                     x_.get(), c.x, h_.get(), nullptr, y_.get(), outputs,
                                     weight_bytes_, dweights_.data(), workspace_bytes_, c.scratch,
                                     reserve_bytes_, c.saved),
          "cudnnRNNBackwardWeights_v8");
    copy_weights(c, true);
  }

 private:
  static constexpr std::size_t H = L::H;
  static constexpr std::size_t F = L::features;
  static constexpr std::size_t G = L::Cell::gates;
  static constexpr std::size_t steps = L::steps;

  // One of cuDNN's 2G matrices or 2G bias vectors: `count` floats at
  // `offset` in the layer's weight block (is_bias: its bias block) and at
  // `space` bytes into the weight space.
  struct Piece {
    std::size_t offset, count, space;
    bool is_bias;
  };

  static std::string describe(std::size_t batch) {
    return std::string(L::kind) + "<" + std::to_string(H) + "> on cuDNN (layer " +
           std::to_string(L::index) + ", batch " + std::to_string(batch) + " x " +
           std::to_string(steps) + " steps x " + std::to_string(F) + " features)";
  }

  std::size_t reserve_floats() const {
    return DeviceArena::padded_bytes<unsigned char>(reserve_bytes_) / sizeof(float);
  }
  std::size_t outputs_floats() const { return L::spec::sequence ? 0 : batch_ * steps * H; }

  // One training step on zeros in temporary buffers (see the file comment).
  void warm_up(cudaStream_t stream) {
    const std::size_t floats = batch_ * steps * std::max(F, H);
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

  // Where cuDNN keeps each matrix and bias vector: linear layer g < G is
  // gate g's input matrix W (with b_ih's part), G + g its recurrent matrix
  // R (with b_hh's), gate g as PyTorch numbers it. Each must hold exactly
  // the floats loom copies there, packed, or the layouts differ and nothing
  // is guessed. Pieces adjacent in both buffers are copied as one.
  void map_weights() {
    detail::TensorDescriptor matrix(create<cudnnTensorDescriptor_t>(
        cudnnCreateTensorDescriptor, "cudnnCreateTensorDescriptor"));
    detail::TensorDescriptor bias(create<cudnnTensorDescriptor_t>(cudnnCreateTensorDescriptor,
                                                                  "cudnnCreateTensorDescriptor"));
    const auto* base = weights_.data();
    for (std::size_t id = 0; id < 2 * G; ++id) {
      void* matrix_at = nullptr;
      void* bias_at = nullptr;
      check(cudnnGetRNNWeightParams(handle_, rnn_.get(), 0, weight_bytes_, weights_.data(),
                                    static_cast<std::int32_t>(id), matrix.get(), &matrix_at,
                                    bias.get(), &bias_at),
            "cudnnGetRNNWeightParams");
      const bool recurrent = id >= G;
      const std::size_t gate = id % G;
      const std::size_t columns = recurrent ? H : F;
      require_packed(matrix.get(), H * columns, id, "matrix");
      require_packed(bias.get(), H, id, "bias vector");
      add_piece({(recurrent ? L::w_hh : L::w_ih) + gate * H * columns, H * columns,
                 static_cast<std::size_t>(static_cast<unsigned char*>(matrix_at) - base), false});
      add_piece({(recurrent ? L::b_hh : L::b_ih) - L::weight_count + gate * H, H,
                 static_cast<std::size_t>(static_cast<unsigned char*>(bias_at) - base), true});
    }
  }

  void add_piece(const Piece& p) {
    for (Piece& q : pieces_)
      if (q.is_bias == p.is_bias && q.offset + q.count == p.offset &&
          q.space + q.count * sizeof(float) == p.space) {
        q.count += p.count;
        return;
      }
    pieces_.push_back(p);
  }

  // `desc` must describe `want` floats without gaps (its dimensions in
  // any order of strides; cuDNN's matrices are row-major, as PyTorch's views
  // of them rely on).
  void require_packed(cudnnTensorDescriptor_t desc, std::size_t want, std::size_t id,
                      const char* what) const {
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
               " of linear layer ", id, " holds ", count, packed ? " packed" : " strided",
               " values, not the ", want, " packed floats loom's layout copies there");
  }

  // Layer parameters into the weight space, or (back) its gradients out
  // into the layer's gradient blocks.
  void copy_weights(const detail::LayerCall& c, bool back) {
    for (const Piece& p : pieces_) {
      unsigned char* space = (back ? dweights_.data() : weights_.data()) + p.space;
      if (back) {
        float* to = (p.is_bias ? c.dbias : c.dweights) + p.offset;
        LOOM_CUDA_CHECK(cudaMemcpyAsync(to, space, p.count * sizeof(float),
                                        cudaMemcpyDeviceToDevice, c.stream));
      } else {
        const float* from = (p.is_bias ? c.bias : c.weights) + p.offset;
        LOOM_CUDA_CHECK(cudaMemcpyAsync(space, from, p.count * sizeof(float),
                                        cudaMemcpyDeviceToDevice, c.stream));
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
  detail::RnnDataDescriptor x_, y_;
  detail::TensorDescriptor h_;
  std::size_t weight_bytes_ = 0, workspace_bytes_ = 0, reserve_bytes_ = 0;
  DeviceBuffer<unsigned char> weights_, dweights_;
  DeviceBuffer<std::int32_t> lengths_;
  DeviceBuffer<float> zero_dy_, spare_dx_;
  std::vector<Piece> pieces_;
};

}  // namespace loom::gpu
