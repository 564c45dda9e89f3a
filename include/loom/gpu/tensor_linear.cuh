// CUDA runners of TensorParallel's shares of a Linear
// (layers/tensor_linear.hpp), each computing what its CPU layer computes,
// with the tensor group's sums and gathers on the layer's stream
// (DeviceTensorGroup, layer_call.hpp):
//
//   TensorColumns  one GEMM with the bias (and a fused ReLU) in its
//                  epilogue; backward sums the input gradient's parts.
//   TensorRows     the GEMM's partial products summed over the group, then
//                  the bias (and ReLU) added once, as the CPU adds them
//                  after its sum; backward needs no sum.
//   TensorGather   the column-parallel GEMM into the scratch, every rank's
//                  outputs gathered and laid side by side in each row;
//                  backward takes this rank's columns of the output
//                  gradient and sums the input gradient's parts.
//
// Backward overwrites the weight and bias gradients, as every runner's
// does; the bias gradient comes from the weight GEMM's epilogue (BGRADA) or,
// after a ReLU, from that GEMM over dZ. A group of one (TensorParallel<1>)
// sums and gathers nothing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <memory>

#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/epilogue.cuh"
#include "../backend/cuda/gemm.hpp"
#include "../layers/tensor_linear.hpp"
#include "layer_call.hpp"
#include "transformer.cuh"

namespace loom::gpu {

enum class TensorSplit { columns, rows, gather };

template <class L, TensorSplit Split>
class TensorLinearRunner {
  static constexpr std::size_t positions = L::positions, in = L::in_features,
                               tensor = L::tensor;
  // The outputs this rank's GEMM makes, and the layer's (all of them after
  // a gather or a sum).
  static constexpr std::size_t own = L::weight_count / in, out = L::output_shape::size / positions;
  static constexpr Act activation = L::activation;
  static_assert(Split != TensorSplit::gather || activation == Act::identity,
                "TensorGather is the network's last Linear: no activation follows it");

 public:
  TensorLinearRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
                     TensorMath math)
      : batch_(batch) {
    const std::size_t rows = batch * positions;
    const GemmOptions options = detail::gemm_options(math, library_limit);
    // TensorRows adds its bias after the sum; the others in the epilogue.
    const Epilogue forward = Split == TensorSplit::rows    ? Epilogue::none
                             : activation == Act::relu ? Epilogue::relu_bias
                                                       : Epilogue::bias;
    forward_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, true, rows, own, in, in, in, own}, forward, options);
    weight_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{true, false, own, in, rows, own, in, in}, Epilogue::bgrad_a,
        options);
    input_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, false, rows, in, own, own, in, in}, Epilogue::none,
        options);
  }

  // Before the libraries' workspace: dZ after a ReLU, or a gather's own
  // outputs (their gradient in backward) and every rank's.
  static std::size_t fixed_bytes(std::size_t n) {
    const std::size_t rows = n * positions;
    if constexpr (Split == TensorSplit::gather)
      return DeviceArena::padded_bytes<float>(rows * own) +
             DeviceArena::padded_bytes<float>(rows * out);
    else if constexpr (activation == Act::relu)
      return DeviceArena::padded_bytes<float>(rows * own);
    else
      return 0;
  }
  std::size_t scratch_bytes() const {
    std::size_t library = 0;
    for (const auto* plan : {forward_.get(), weight_grad_.get(), input_grad_.get()})
      library = std::max(library, plan->workspace_bytes());
    return fixed_bytes(batch_) + library;
  }

  void forward(const detail::LayerCall& c) {
    const std::size_t rows = batch_ * positions;
    if constexpr (Split == TensorSplit::gather) {
      float* mine = reinterpret_cast<float*>(c.scratch);
      GemmArgs args = call(c, c.x, c.weights, mine);
      args.bias = c.bias;
      forward_->run(args);
      const float* all = mine;
      if constexpr (tensor > 1) {
        float* gathered = reinterpret_cast<float*>(
            c.scratch + DeviceArena::padded_bytes<float>(rows * own));
        detail::tensor_group_of(c, L::index, tensor).gather(mine, gathered, rows * own, c.stream);
        all = gathered;
      }
      // Rank r's rows x own block into columns [r own, (r + 1) own) of y.
      for (std::size_t r = 0; r < tensor; ++r)
        LOOM_CUDA_CHECK(cudaMemcpy2DAsync(c.y + r * own, out * sizeof(float), all + r * rows * own,
                                          own * sizeof(float), own * sizeof(float), rows,
                                          cudaMemcpyDeviceToDevice, c.stream));
    } else {
      GemmArgs args = call(c, c.x, c.weights, c.y);
      if constexpr (Split == TensorSplit::columns) args.bias = c.bias;
      forward_->run(args);
      if constexpr (Split == TensorSplit::rows) {
        if constexpr (tensor > 1)
          detail::tensor_group_of(c, L::index, tensor).sum(c.y, rows * out, c.stream);
        bias_act_nchw<activation>(c.y, c.bias, rows, out, 1, c.stream);
      }
    }
  }

  void backward(const detail::LayerCall& c) {
    const std::size_t rows = batch_ * positions;
    const float* grad = c.dy;
    if constexpr (Split == TensorSplit::gather) {
      // Every rank holds the whole output's gradient: this rank's columns of it.
      float* d_mine = reinterpret_cast<float*>(c.scratch);
      const std::size_t rank = tensor > 1 ? detail::tensor_group_of(c, L::index, tensor).rank : 0;
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(d_mine, own * sizeof(float), c.dy + rank * own,
                                        out * sizeof(float), own * sizeof(float), rows,
                                        cudaMemcpyDeviceToDevice, c.stream));
      grad = d_mine;
    } else if constexpr (activation == Act::relu) {
      float* dz = reinterpret_cast<float*>(c.scratch);
      activation_backward<Act::relu>(c.dy, c.y, dz, rows * own, c.stream);
      grad = dz;
    }
    GemmArgs weights = call(c, grad, c.x, c.dweights);
    weights.bias_grad = c.dbias;
    weight_grad_->run(weights);
    if (c.dx == nullptr) return;
    input_grad_->run(call(c, grad, c.weights, c.dx));
    if constexpr (Split != TensorSplit::rows && tensor > 1)
      detail::tensor_group_of(c, L::index, tensor).sum(c.dx, rows * in, c.stream);
  }

 private:
  // What every product shares: the workspace past the fixed buffers.
  GemmArgs call(const detail::LayerCall& c, const float* a, const float* b, float* y) const {
    const std::size_t fixed = fixed_bytes(batch_);
    return detail::gemm_call(a, b, y, c.scratch + fixed, c.scratch_bytes - fixed, c.stream);
  }

  std::size_t batch_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

}  // namespace loom::gpu
