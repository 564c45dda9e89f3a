// CUDA runners of a transformer's layers, each computing what its CPU
// layer computes (layers/embedding.hpp, layer_norm.hpp, attention.hpp):
// Embedding, PositionEmbedding, TiedLinear, LayerNorm, RMSNorm and
// CausalSelfAttention (plain and rotary). Their kernels are
// backend/cuda/transformer.cuh's; the products are cuBLASLt's.
//
// The attention, for a batch of n samples of Context positions: the q, k, v
// projection is one GEMM over all n x Context rows with the bias in its
// epilogue; the scores and the weighted sums are strided-batched GEMMs over
// the samples, one per head, reading each head's columns of q, k and v in
// place; the causal mask, the scale's softmax and its backward are one
// kernel each over every row of every head (fused, a warp per row). The
// scores stay in memory (Heads x Context x Context per sample, as on the
// CPU) rather than being recomputed FlashAttention-style: at GPT-2 small's
// context of 1024 that is 48 MiB per sample and layer, and it keeps the
// backward GEMMs plain. Forward keeps q, k, v, the probabilities and the
// heads' outputs in the layer's saved area, laid out per tensor over the
// whole batch as on the CPU, so that each product is one call.
//
// In a reduced precision the projections take the network's tensor math:
// their operands are the layer's input, weights and output gradient, which
// the owner rounds as the CPU's emulation does, and the heads' output and
// the q, k, v gradient, which the runner rounds where the CPU layer does.
// The products inside the attention, whose operands the CPU keeps in fp32,
// take TF32 at most.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>

#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/check.hpp"
#include "../backend/cuda/epilogue.cuh"
#include "../backend/cuda/gemm.hpp"
#include "../backend/cuda/memory.hpp"
#include "../backend/cuda/precision.cuh"
#include "../backend/cuda/transformer.cuh"
#include "../layers/attention.hpp"
#include "../layers/embedding.hpp"
#include "../layers/layer_norm.hpp"
#include "layer_call.hpp"

namespace loom::gpu {

namespace detail {

// The group a split layer runs over (TensorParallel's shares: the
// attention's heads here, a Linear's in tensor_linear.cuh), or the CPU's
// message when it has none.
inline DeviceTensorGroup& tensor_group_of(const LayerCall& c, std::size_t index,
                                          std::size_t size) {
  LOOM_CHECK(c.tensor != nullptr && c.tensor->size == size,
             ::loom::detail::layer_path_text(index), " (a layer split over ", size,
             " ranks) runs on a GPU without its tensor group: only TensorParallel's engine "
             "runs it");
  return *c.tensor;
}

}  // namespace detail

// Embedding<Vocab, Width>: a gather forward; backward sorts the batch's
// ids (CUB's stable radix sort) and sums each row's tokens in their order.
// The ids were checked on the host before they came over (DeviceLayers).
template <class L>
class EmbeddingRunner {
 public:
  EmbeddingRunner(DeviceContext&, std::size_t batch, std::size_t, TensorMath)
      : batch_(batch), temp_(embedding_sort_temp_bytes(tokens(batch), L::vocab)) {}

  static std::size_t fixed_bytes(std::size_t n) {
    return embedding_sort_bytes(tokens(n), L::vocab);
  }
  std::size_t scratch_bytes() const { return fixed_bytes(batch_); }

  void forward(const detail::LayerCall& c) {
    embedding_forward(c.x, c.weights, c.y, tokens(batch_), L::width, c.stream);
  }
  // The ids have no gradient: dx is zero, as on the CPU.
  void backward(const detail::LayerCall& c) {
    embedding_backward(c.x, c.dy, c.dweights, tokens(batch_), L::vocab, L::width, c.scratch, temp_,
                       c.stream);
    if (c.dx != nullptr)
      LOOM_CUDA_CHECK(cudaMemsetAsync(c.dx, 0, tokens(batch_) * sizeof(float), c.stream));
  }

 private:
  static std::size_t tokens(std::size_t n) { return n * L::context; }
  std::size_t batch_, temp_;
};

// PositionEmbedding: the table added to every sample; its gradient sums the
// samples in order (the CPU's, to the bit).
template <class L>
class PositionEmbeddingRunner {
  static constexpr std::size_t size = L::input_shape::size;

 public:
  PositionEmbeddingRunner(DeviceContext&, std::size_t batch, std::size_t, TensorMath)
      : batch_(batch) {}
  std::size_t scratch_bytes() const { return 0; }

  void forward(const detail::LayerCall& c) {
    positions_forward(c.x, c.weights, c.y, batch_, size, c.stream);
  }
  void backward(const detail::LayerCall& c) {
    positions_backward(c.dy, c.dweights, batch_, size, c.stream);
    if (c.dx != nullptr) copy_async(c.dx, c.dy, batch_ * size, cudaMemcpyDeviceToDevice, c.stream);
  }

 private:
  std::size_t batch_;
};

// TiedLinear<Vocab>: y = x E^T per position with its copy of the
// embedding's weight, no bias: three plain GEMMs.
template <class L>
class TiedLinearRunner {
  static constexpr std::size_t in = L::in_features, out = L::out_features;

 public:
  TiedLinearRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
                   TensorMath math)
      : batch_(batch) {
    const std::size_t rows = batch * L::positions;
    const GemmOptions options = detail::gemm_options(math, library_limit);
    forward_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, true, rows, out, in, in, in, out}, Epilogue::none, options);
    weight_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{true, false, out, in, rows, out, in, in}, Epilogue::none, options);
    input_grad_ = std::make_unique<GemmPlan>(
        context.blas, GemmShape{false, false, rows, in, out, out, in, in}, Epilogue::none, options);
  }
  std::size_t scratch_bytes() const {
    return std::max({forward_->workspace_bytes(), weight_grad_->workspace_bytes(),
                     input_grad_->workspace_bytes()});
  }

  void forward(const detail::LayerCall& c) {
    forward_->run(detail::gemm_call(c.x, c.weights, c.y, c.scratch, c.scratch_bytes, c.stream));
  }
  void backward(const detail::LayerCall& c) {
    weight_grad_->run(
        detail::gemm_call(c.dy, c.x, c.dweights, c.scratch, c.scratch_bytes, c.stream));
    if (c.dx != nullptr)
      input_grad_->run(
          detail::gemm_call(c.dy, c.weights, c.dx, c.scratch, c.scratch_bytes, c.stream));
  }

 private:
  std::size_t batch_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

// LayerNorm (Centered) and RMSNorm: a block per row, its statistics summed
// in double as on the CPU; the parameters' gradients summed over chunks of
// rows, then over the chunks in order.
template <class L, bool Centered>
class RowNormRunner {
 public:
  RowNormRunner(DeviceContext&, std::size_t batch, std::size_t, TensorMath) : batch_(batch) {}

  static std::size_t fixed_bytes(std::size_t n) {
    return row_norm_scratch_bytes(n * L::rows, L::features);
  }
  std::size_t scratch_bytes() const { return fixed_bytes(batch_); }

  void forward(const detail::LayerCall& c) {
    row_norm_forward<Centered>(c.x, c.weights, Centered ? c.bias : nullptr, c.y, rows(),
                               L::features, L::eps, c.stream);
  }
  void backward(const detail::LayerCall& c) {
    row_norm_backward<Centered>(c.x, c.weights, c.dy, c.dx, c.dweights,
                                Centered ? c.dbias : nullptr, rows(), L::features, L::eps,
                                c.scratch, c.stream);
  }

 private:
  std::size_t rows() const { return batch_ * L::rows; }
  std::size_t batch_;
};

// CausalSelfAttention<Heads, Positions> (see the top of this file).
template <class L>
class AttentionRunner {
  static constexpr std::size_t C = L::context, W = L::width, H = L::heads, hw = L::head_width,
                               I = L::inner, Q = L::qkv_width;
  // TensorParallel's share (TensorHeads): this rank's H of the heads, whose
  // partial projections the tensor group sums before the bias.
  static constexpr std::size_t tensor = W / I;
  // Every pointer a product takes lies a multiple of 4 floats into its
  // buffer when these are; else the plans take 4-byte alignment.
  static constexpr std::size_t alignment = hw % 4 == 0 && C % 4 == 0 ? 16 : 4;

 public:
  AttentionRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
                  TensorMath math)
      : batch_(batch) {
    const std::size_t rows = batch * C, n = batch;
    const GemmOptions outer = detail::gemm_options(math, library_limit, alignment);
    const GemmOptions inner =
        detail::gemm_options(detail::inner_math(math), library_limit, alignment);
    const auto plan = [&](const GemmShape& shape, Epilogue epilogue, const GemmOptions& options) {
      return std::make_unique<GemmPlan>(context.blas, shape, epilogue, options);
    };
    const auto per_head = [&](bool ta, bool tb, std::size_t m, std::size_t cols, std::size_t k,
                              std::size_t lda, std::size_t ldb, std::size_t ldc, std::size_t sa,
                              std::size_t sb, std::size_t sc) {
      return plan(GemmShape{ta, tb, m, cols, k, lda, ldb, ldc, n, sa, sb, sc}, Epilogue::none,
                  inner);
    };
    constexpr std::size_t scores = H * C * C;  // per sample
    qkv_ = plan({false, true, rows, Q, W, W, W, Q}, Epilogue::bias, outer);
    // P_h = scale q_h k_h^T; O_h = P_h v_h.
    scores_ = per_head(false, true, C, C, hw, Q, Q, C, C * Q, C * Q, scores);
    mix_ = per_head(false, false, C, hw, C, C, Q, I, scores, C * Q, C * I);
    proj_ = plan({false, true, rows, W, I, I, I, W}, tensor > 1 ? Epilogue::none : Epilogue::bias,
                 outer);
    proj_weight_grad_ = plan({true, false, W, I, rows, W, I, I}, Epilogue::bgrad_a, outer);
    heads_grad_ = plan({false, false, rows, I, W, W, I, I}, Epilogue::none, outer);
    // dP_h = dO_h v_h^T; dV_h = P_h^T dO_h; dQ_h = scale dS_h k_h; dK_h = scale dS_h^T q_h.
    probs_grad_ = per_head(false, true, C, C, hw, I, Q, C, C * I, C * Q, scores);
    values_grad_ = per_head(true, false, C, hw, C, C, I, Q, scores, C * I, C * Q);
    queries_grad_ = per_head(false, false, C, hw, C, C, Q, Q, scores, C * Q, C * Q);
    keys_grad_ = per_head(true, false, C, hw, C, C, Q, Q, scores, C * Q, C * Q);
    qkv_weight_grad_ = plan({true, false, Q, W, rows, Q, W, W}, Epilogue::bgrad_a, outer);
    input_grad_ = plan({false, false, rows, W, Q, Q, W, W}, Epilogue::none, outer);
  }

  // The backward's buffers: the heads' output gradient, the q, k, v
  // gradient and every head's score gradient.
  static std::size_t fixed_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * C * I) +
           DeviceArena::padded_bytes<float>(n * C * Q) +
           DeviceArena::padded_bytes<float>(n * H * C * C);
  }
  std::size_t scratch_bytes() const {
    std::size_t library = 0;
    for (const auto* p : {&qkv_, &scores_, &mix_, &proj_, &proj_weight_grad_, &heads_grad_,
                          &probs_grad_, &values_grad_, &queries_grad_, &keys_grad_,
                          &qkv_weight_grad_, &input_grad_})
      library = std::max(library, (*p)->workspace_bytes());
    return fixed_bytes(batch_) + library;
  }

  void forward(const detail::LayerCall& c) {
    const Saved s = saved(c);
    const auto p = parts(c.weights);
    GemmArgs qkv = call(c, c.x, p.qkv_weight, s.qkv);
    qkv.bias = p.qkv_bias;
    qkv_->run(qkv);
    if constexpr (L::rotary) turn(s.qkv, false, c.stream);
    for (std::size_t h = 0; h < H; ++h) {
      GemmArgs scores = call(c, s.qkv + h * hw, s.qkv + I + h * hw, s.probabilities + h * C * C);
      scores.alpha = scale();
      scores_->run(scores);
    }
    causal_softmax_forward(s.probabilities, batch_ * H * C, C, c.stream);
    for (std::size_t h = 0; h < H; ++h)
      mix_->run(call(c, s.probabilities + h * C * C, s.qkv + 2 * I + h * hw, s.heads + h * hw));
    round_values(c.precision, s.heads, batch_ * C * I, c.stream);
    GemmArgs out = call(c, s.heads, p.proj_weight, c.y);
    if constexpr (tensor > 1) {
      proj_->run(out);
      detail::tensor_group_of(c, L::index, tensor).sum(c.y, batch_ * C * W, c.stream);
      bias_act_nchw<Act::identity>(c.y, p.proj_bias, batch_ * C, W, 1, c.stream);
    } else {
      out.bias = p.proj_bias;
      proj_->run(out);
    }
  }

  void backward(const detail::LayerCall& c) {
    const Saved s = saved(c);
    const auto p = parts(c.weights);
    const auto d = parts(c.dweights);
    float* d_heads = reinterpret_cast<float*>(c.scratch);
    float* d_qkv = reinterpret_cast<float*>(
        c.scratch + DeviceArena::padded_bytes<float>(batch_ * C * I));
    float* d_scores = reinterpret_cast<float*>(
        c.scratch + DeviceArena::padded_bytes<float>(batch_ * C * I) +
        DeviceArena::padded_bytes<float>(batch_ * C * Q));
    GemmArgs proj = call(c, c.dy, s.heads, d.proj_weight);
    proj.bias_grad = d.proj_bias;
    proj_weight_grad_->run(proj);
    heads_grad_->run(call(c, c.dy, p.proj_weight, d_heads));
    for (std::size_t h = 0; h < H; ++h) {
      probs_grad_->run(call(c, d_heads + h * hw, s.qkv + 2 * I + h * hw, d_scores + h * C * C));
      values_grad_->run(
          call(c, s.probabilities + h * C * C, d_heads + h * hw, d_qkv + 2 * I + h * hw));
    }
    causal_softmax_backward(s.probabilities, d_scores, batch_ * H * C, C, c.stream);
    for (std::size_t h = 0; h < H; ++h) {
      GemmArgs queries = call(c, d_scores + h * C * C, s.qkv + I + h * hw, d_qkv + h * hw);
      queries.alpha = scale();
      queries_grad_->run(queries);
      GemmArgs keys = call(c, d_scores + h * C * C, s.qkv + h * hw, d_qkv + I + h * hw);
      keys.alpha = scale();
      keys_grad_->run(keys);
    }
    // The gradients above are the turned queries' and keys': turned back,
    // they are the projection's.
    if constexpr (L::rotary) turn(d_qkv, true, c.stream);
    round_values(c.precision, d_qkv, batch_ * C * Q, c.stream);
    GemmArgs qkv = call(c, d_qkv, c.x, d.qkv_weight);
    qkv.bias_grad = d.qkv_bias;
    qkv_weight_grad_->run(qkv);
    if (c.dx == nullptr) return;
    input_grad_->run(call(c, d_qkv, p.qkv_weight, c.dx));
    // Split heads: each rank's part of the input gradient is its heads'.
    if constexpr (tensor > 1)
      detail::tensor_group_of(c, L::index, tensor).sum(c.dx, batch_ * C * W, c.stream);
  }

 private:
  // The layer's parameters (one block, the CPU's order), or their gradients.
  template <class Float>
  struct Parts {
    Float* qkv_weight;
    Float* qkv_bias;
    Float* proj_weight;
    Float* proj_bias;
  };
  template <class Float>
  static Parts<Float> parts(Float* block) {
    return {block, block + L::qkv_bias_at, block + L::proj_weight_at, block + L::proj_bias_at};
  }

  struct Saved {
    float* qkv;            // n x Context x 3 Inner
    float* probabilities;  // n x Heads x Context x Context
    float* heads;          // n x Context x Inner
  };
  Saved saved(const detail::LayerCall& c) const {
    return {c.saved, c.saved + batch_ * C * Q, c.saved + batch_ * (C * Q + H * C * C)};
  }

  // What every product shares: the workspace past the backward's buffers.
  GemmArgs call(const detail::LayerCall& c, const float* a, const float* b, float* out) const {
    const std::size_t fixed = fixed_bytes(batch_);
    return detail::gemm_call(a, b, out, c.scratch + fixed, c.scratch_bytes - fixed, c.stream);
  }

  void turn(float* qkv, bool back, cudaStream_t stream) const {
    if constexpr (L::rotary)
      rotary_turn(qkv, batch_ * C, C, I, hw, L::positions::theta, back, stream);
  }

  static float scale() { return 1.0f / std::sqrt(static_cast<float>(hw)); }

  std::size_t batch_;
  std::unique_ptr<GemmPlan> qkv_, scores_, mix_, proj_, proj_weight_grad_, heads_grad_,
      probs_grad_, values_grad_, queries_grad_, keys_grad_, qkv_weight_grad_, input_grad_;
};

}  // namespace loom::gpu
