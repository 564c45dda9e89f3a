// CausalSelfAttention<Heads, Positions = void>: multi-head self-attention
// over a sequence of Context x Width, each position attending to itself and
// the positions before it (nanoGPT's CausalSelfAttention, without dropout):
//   q, k, v = split(x Wqkv^T + bqkv)            (Wqkv [3 Width, Width])
//   per head h: P_h = softmax(q_h k_h^T / sqrt(Width / Heads), masked above
//               the diagonal);  o_h = P_h v_h
//   y = concat_h(o_h) Wproj^T + bproj           (Wproj [Width, Width])
// Parameters, in this order: qkv.weight, qkv.bias, proj.weight, proj.bias
// (PyTorch's layouts; q, k and v are the weight's row blocks in that
// order, each head a run of Width / Heads rows of each). The heads must
// divide the width: otherwise a compile error names the layer, the width
// and the heads.
//
// CausalSelfAttention<Heads, Rotary<>> turns each head's queries and keys
// by their position before the scores (rotary position embedding, RoFormer,
// in the half-split layout of GPT-NeoX and Llama): feature i of a head's
// first half and feature i of its second half, (a, b), become
// (a cos - b sin, b cos + a sin) at angle position x Theta^(-2i / head
// width), so a score depends on how far apart two positions are. No
// parameters; the head width must be even (a compile error says so), and
// the checkpoint names read "rotary_attention", so weights trained one way
// do not load the other way unnoticed.
//
// On the CPU every product is an OpenBLAS GEMM: the projections over all
// positions of the batch at once, the scores and the weighted sums per
// sample and head on strided views of q, k and v (no copy). The softmax is
// fused with the causal mask and the scale, a row at a time in T with its
// maximum subtracted. Forward keeps q, k, v, the probabilities and the
// heads' outputs for backward (LayerContext::saved), each tensor whole over
// the batch (all samples' q, k, v, then their probabilities, then their
// heads' outputs), so that a projection is one GEMM of every position
// rather than one per sample (64 rows each in the baby GPT, where OpenBLAS
// ran a fifth slower: docs/cpu-backend.md); the GPU keeps the same layout.
// In bf16 and fp16 the heads' output and the q, k, v gradient are rounded
// as a layer's output and passed-back gradient are: what the projections
// read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../backend/cpu/epilogue.hpp"
#include "../backend/cpu/gemm.hpp"
#include "../backend/cpu/reduce.hpp"
#include "../backend/cpu/transcendental.hpp"
#include "../core/error.hpp"
#include "../core/host_device.hpp"
#include "layer.hpp"

namespace loom {

// Rotary position embedding for CausalSelfAttention's queries and keys,
// with base Theta (RoFormer's and Llama's 10000).
template <std::size_t Theta = 10000>
struct Rotary {
  static_assert(Theta > 1, "Rotary<Theta>: the base must be at least 2");
  static constexpr double theta = static_cast<double>(Theta);
};

template <std::size_t Heads, class Positions = void>
struct CausalSelfAttention {
  static constexpr std::size_t heads = Heads;
};

namespace detail {

template <class At, class Layer, std::size_t Width, std::size_t Heads>
struct attention_heads_must_divide_width_at {
  static_assert(Heads > 0 && Width % Heads == 0,
                "loom shape error: the attention's heads do not divide its width (template "
                "arguments: layer path, layer, width, heads); choose heads that divide the "
                "width, each head taking width / heads features");
  static constexpr bool ok = Heads > 0 && Width % Heads == 0;
};
template <std::size_t Index, class Layer, std::size_t Width, std::size_t Heads>
using attention_heads_must_divide_width =
    attention_heads_must_divide_width_at<layer_path_t<Index>, Layer, Width, Heads>;

template <class At, class Layer, std::size_t HeadWidth>
struct rotary_head_width_must_be_even_at {
  static_assert(HeadWidth % 2 == 0,
                "loom shape error: rotary positions turn a head's features in pairs, and this "
                "attention's head width (width / heads: the third template argument) is odd; "
                "choose a width and heads whose quotient is even");
  static constexpr bool ok = HeadWidth % 2 == 0;
};
template <std::size_t Index, class Layer, std::size_t HeadWidth>
using rotary_head_width_must_be_even =
    rotary_head_width_must_be_even_at<layer_path_t<Index>, Layer, HeadWidth>;

template <class Positions>
inline constexpr bool is_rotary = false;
template <std::size_t Theta>
inline constexpr bool is_rotary<Rotary<Theta>> = true;

}  // namespace detail

namespace detail {

// Tensor parallelism splits the attention's heads over the ranks of the
// mesh's tensor axis (Megatron's split): with Tensor ranks, each holds
// Heads / Tensor heads, its rows of q, k and v (a column-parallel qkv
// projection) and the matching columns of the output projection
// (row-parallel), whose partial products the ranks sum before the bias,
// which every rank holds whole. Backward sums the input gradient's parts.
template <class At, class Layer, std::size_t Heads_, std::size_t Tensor>
struct attention_split_heads_by_degree_at {
  static_assert(Heads_ % Tensor == 0,
                "loom tensor-parallel error: the tensor degree does not divide the attention's "
                "heads (template arguments: layer path, layer, heads, degree); each rank takes "
                "heads / degree whole heads: choose a degree that divides them");
  static constexpr bool ok = Heads_ % Tensor == 0;
};
template <std::size_t Index, class Layer, std::size_t Heads_, std::size_t Tensor>
using attention_split_heads_by_degree =
    attention_split_heads_by_degree_at<layer_path_t<Index>, Layer, Heads_, Tensor>;

template <class Spec_, std::size_t Heads, class Positions, class In, std::size_t Index,
          std::size_t Tensor>
struct AttentionLayer : LayerBase<Spec_, In, In, Index> {
  using Spec = Spec_;
  static_assert(std::is_void_v<Positions> || detail::is_rotary<Positions>,
                "CausalSelfAttention<Heads, Positions>: Positions is void or Rotary<Theta>");
  static constexpr bool rotary = detail::is_rotary<Positions>;
  using positions = Positions;  // void or Rotary<Theta>
  static constexpr std::size_t context = detail::dim_or_one<In, 0>;
  static constexpr std::size_t width = detail::dim_or_one<In, 1>;
  static constexpr bool checked =
      detail::layer_input_rank_mismatch<Index, Spec, 2, In::rank>::ok &&
      detail::attention_heads_must_divide_width<Index, Spec, width, Heads>::ok &&
      // Without rotary positions the check sees a width of 0: naming its
      // ::ok instantiates it, whatever || would have skipped.
      detail::rotary_head_width_must_be_even<Index, Spec,
                                             (rotary && Heads > 0 ? width / Heads : 0)>::ok;
  static constexpr std::size_t head_width = Heads > 0 ? width / Heads : 1;
  // This rank's heads, and their features: the width of its q, k and v each.
  static constexpr std::size_t heads = Heads / Tensor;
  static constexpr std::size_t inner = heads * head_width;
  static constexpr std::size_t qkv_width = 3 * inner;
  // Offsets into the parameters.
  static constexpr std::size_t qkv_bias_at = qkv_width * width;
  static constexpr std::size_t proj_weight_at = qkv_bias_at + qkv_width;
  static constexpr std::size_t proj_bias_at = proj_weight_at + width * inner;
  // One block of parameters: the GPU layout's "bias" pointer is not used.
  static constexpr std::size_t weight_count = proj_bias_at + width;
  static constexpr std::size_t param_count = weight_count;
  // Kept per sample: q, k, v (Context x 3 Inner), every head's probabilities
  // (Heads x Context x Context) and the heads' outputs (Context x Inner).
  // For n samples each tensor is n times its sample's, one after the other:
  // the probabilities start at n x probabilities_at, the heads' outputs at
  // n x heads_out_at.
  static constexpr std::size_t probabilities_at = context * qkv_width;
  static constexpr std::size_t heads_out_at = probabilities_at + heads * context * context;
  static constexpr std::size_t saved = heads_out_at + context * inner;
  static constexpr bool contextual = true;
  // Backward's, per sample: the heads' output gradient, the q, k, v
  // gradient, and one head's probability gradient.
  static constexpr std::size_t workspace = 4 * context * inner + context * context;
  static constexpr std::size_t forward_flops =
      2 * context * width * (qkv_width + inner) + 4 * context * context * inner;
  static constexpr std::size_t backward_flops = 2 * forward_flops;
  static constexpr std::string_view kind = rotary ? "rotary_attention" : "attention";

  // Glorot uniform for both weights (one stream of draws over the
  // parameters, the projection's rescaled to its own bound), zero biases.
  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    const double qkv_limit = detail::init_limit(width, 3 * width, false);
    const double proj_limit = detail::init_limit(width, width, false);
    detail::init_uniform(params, param_count, qkv_limit, seed, Index);
    for (std::size_t i = proj_weight_at; i < proj_bias_at; ++i)
      params[i] = static_cast<T>(static_cast<double>(params[i]) * (proj_limit / qkv_limit));
    for (std::size_t i = qkv_bias_at; i < proj_weight_at; ++i) params[i] = T(0);
    for (std::size_t i = proj_bias_at; i < param_count; ++i) params[i] = T(0);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("qkv.weight", 0, {qkv_width, width}, false);
    visit("qkv.bias", qkv_bias_at, {qkv_width}, false);
    visit("proj.weight", proj_weight_at, {width, inner}, false);
    visit("proj.bias", proj_bias_at, {width}, false);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t samples,
                      const LayerContext<T>& ctx) {
    const std::size_t rows = samples * context;
    T* const qkv_all = ctx.saved;
    T* const probabilities = ctx.saved + samples * probabilities_at;
    T* const heads_out = ctx.saved + samples * heads_out_at;
    cpu::gemm<T>(false, true, rows, qkv_width, width, T(1), x, width, params, width, T(0), qkv_all,
                 qkv_width);
    cpu::bias_act_rows<Act::identity>(qkv_all, params + qkv_bias_at, rows, qkv_width);
    for (std::size_t s = 0; s < samples; ++s) {
      T* qkv = qkv_all + s * context * qkv_width;
      if constexpr (rotary) turn(qkv, false);
      for (std::size_t h = 0; h < heads; ++h) {
        T* p = probabilities + (s * heads + h) * context * context;
        const T* q = qkv + h * head_width;
        const T* k = qkv + inner + h * head_width;
        const T* v = qkv + 2 * inner + h * head_width;
        cpu::gemm<T>(false, true, context, context, head_width, scale<T>(), q, qkv_width, k,
                     qkv_width, T(0), p, context);
        causal_softmax(p);
        cpu::gemm<T>(false, false, context, head_width, context, T(1), p, context, v, qkv_width,
                     T(0), heads_out + s * context * inner + h * head_width, inner);
      }
    }
    // In a reduced precision the heads' output is an activation like a
    // layer's: rounded before the projection reads it (a GPU's bf16 or
    // fp16 GEMM then takes it exactly).
    round_to(ctx.precision, heads_out, rows * inner);
    cpu::gemm<T>(false, true, rows, width, inner, T(1), heads_out, inner, params + proj_weight_at,
                 inner, T(0), y, width);
    // Split heads: the ranks' partial projections summed, then the bias once.
    if constexpr (Tensor > 1) tensor_group(ctx).sum(std::span<T>(y, rows * width));
    cpu::bias_act_rows<Act::identity>(y, params + proj_bias_at, rows, width);
  }

  template <class T>
  static void backward(const T* params, const T* x, const T*, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t samples, bool accumulate,
                       const LayerContext<T>& ctx) {
    const std::size_t rows = samples * context;
    const T keep = accumulate ? T(1) : T(0);
    T* d_heads = work;                     // rows x inner
    T* d_qkv = d_heads + rows * inner;     // rows x 3 inner
    T* d_p = d_qkv + rows * qkv_width;     // context x context, one head at a time
    const T* const probabilities = ctx.saved + samples * probabilities_at;
    const T* const heads_out = ctx.saved + samples * heads_out_at;
    // The projection: its bias and weight gradients, and the heads' output gradient.
    cpu::column_sums(dy, dparams + proj_bias_at, rows, width, accumulate);
    cpu::gemm<T>(true, false, width, inner, rows, T(1), dy, width, heads_out, inner, keep,
                 dparams + proj_weight_at, inner);
    cpu::gemm<T>(false, false, rows, inner, width, T(1), dy, width, params + proj_weight_at, inner,
                 T(0), d_heads, inner);
    for (std::size_t s = 0; s < samples; ++s) {
      const T* qkv = ctx.saved + s * context * qkv_width;
      T* dq = d_qkv + s * context * qkv_width;
      for (std::size_t h = 0; h < heads; ++h) {
        const T* p = probabilities + (s * heads + h) * context * context;
        const T* q = qkv + h * head_width;
        const T* k = qkv + inner + h * head_width;
        const T* v = qkv + 2 * inner + h * head_width;
        const T* d_o = d_heads + s * context * inner + h * head_width;
        // dP = dO v^T; dV = P^T dO.
        cpu::gemm<T>(false, true, context, context, head_width, T(1), d_o, inner, v, qkv_width,
                     T(0), d_p, context);
        cpu::gemm<T>(true, false, context, head_width, context, T(1), p, context, d_o, inner, T(0),
                     dq + 2 * inner + h * head_width, qkv_width);
        causal_softmax_backward(p, d_p);
        // dQ = scale dS k; dK = scale dS^T q.
        cpu::gemm<T>(false, false, context, head_width, context, scale<T>(), d_p, context, k,
                     qkv_width, T(0), dq + h * head_width, qkv_width);
        cpu::gemm<T>(true, false, context, head_width, context, scale<T>(), d_p, context, q,
                     qkv_width, T(0), dq + inner + h * head_width, qkv_width);
      }
    }
    // The gradients above are the turned queries' and keys': turned back,
    // they are the projection's.
    if constexpr (rotary)
      for (std::size_t s = 0; s < samples; ++s) turn(d_qkv + s * context * qkv_width, true);
    // Likewise the q, k, v gradient: rounded as a gradient passed between layers.
    round_to(ctx.precision, d_qkv, rows * qkv_width);
    // The q, k, v projection: its bias and weight gradients, and the input's.
    cpu::column_sums(d_qkv, dparams + qkv_bias_at, rows, qkv_width, accumulate);
    cpu::gemm<T>(true, false, qkv_width, width, rows, T(1), d_qkv, qkv_width, x, width, keep,
                 dparams, width);
    if (dx == nullptr) return;
    cpu::gemm<T>(false, false, rows, width, qkv_width, T(1), d_qkv, qkv_width, params, width,
                 T(0), dx, width);
    // Split heads: each rank's part of the input gradient is its heads'.
    if constexpr (Tensor > 1) tensor_group(ctx).sum(std::span<T>(dx, rows * width));
  }

 private:
  template <class T>
  static TensorGroup& tensor_group(const LayerContext<T>& ctx) {
    LOOM_CHECK(ctx.pass.tensor != nullptr && ctx.pass.tensor->size == Tensor,
               detail::layer_path_text(Index), " (attention, heads split over ", Tensor,
               " ranks) runs without its tensor group: only TensorParallel's engine runs it");
    return *ctx.pass.tensor;
  }

  // Each position's angles' cosine and sine, (cos, sin) per position and
  // pair, computed once in double.
  static const std::vector<double>& rotations() {
    static const std::vector<double> table = [] {
      std::vector<double> t(context * head_width);
      for (std::size_t pos = 0; pos < context; ++pos)
        for (std::size_t i = 0; i < head_width / 2; ++i) {
          const double angle =
              static_cast<double>(pos) *
              std::pow(Positions::theta, -2.0 * static_cast<double>(i) / double(head_width));
          t[(pos * head_width / 2 + i) * 2] = std::cos(angle);
          t[(pos * head_width / 2 + i) * 2 + 1] = std::sin(angle);
        }
      return t;
    }();
    return table;
  }

  // Every head's queries and keys of one sample (rows of 3 Inner: q, k,
  // v), turned by their positions' angles; `back`: by minus them (the
  // transpose, what takes a gradient of the turned values to the values').
  template <class T>
  static void turn(T* qkv, bool back) {
    const std::vector<double>& table = rotations();
    const std::size_t half = head_width / 2;
    for (std::size_t pos = 0; pos < context; ++pos) {
      const double* cs = table.data() + pos * head_width;
      for (std::size_t part = 0; part < 2; ++part)  // q, then k
        for (std::size_t h = 0; h < heads; ++h) {
          T* head = qkv + pos * qkv_width + part * inner + h * head_width;
          for (std::size_t i = 0; i < half; ++i) {
            const T c = static_cast<T>(cs[2 * i]);
            const T sn = back ? static_cast<T>(-cs[2 * i + 1]) : static_cast<T>(cs[2 * i + 1]);
            const T a = head[i], b = head[half + i];
            head[i] = a * c - b * sn;
            head[half + i] = b * c + a * sn;
          }
        }
    }
  }

  template <class T>
  static T scale() {
    return T(1) / std::sqrt(T(head_width));
  }

  // Each row i of the scores (already scaled) to the softmax over its
  // columns 0..i; the columns after i to 0. Each loop on its own, the
  // maximum and the sum in lanes (backend/cpu/reduce.hpp), so that the
  // compiler vectorises all of them.
  template <class T>
  LOOM_CPU_KERNEL static void causal_softmax(T* p) {
    for (std::size_t i = 0; i < context; ++i) {
      T* row = p + i * context;
      const T top = cpu::lane_max<16>(row, i + 1);
      for (std::size_t j = 0; j <= i; ++j) {
        // Never above 0: float takes the vectorised exp (backend/cpu/transcendental.hpp).
        if constexpr (std::is_same_v<T, float>)
          row[j] = cpu::exp_nonpositive(row[j] - top);
        else
          row[j] = std::exp(row[j] - top);
      }
      const T total = cpu::lane_sum<16, T>(i + 1, [&](std::size_t j) { return row[j]; });
      for (std::size_t j = 0; j <= i; ++j) row[j] /= total;
      for (std::size_t j = i + 1; j < context; ++j) row[j] = T(0);
    }
  }

  // The softmax's backward, in place of dP: dS = P * (dP - rowsum(P * dP)),
  // the masked entries 0 (P is).
  template <class T>
  LOOM_CPU_KERNEL static void causal_softmax_backward(const T* p, T* d_p) {
    for (std::size_t i = 0; i < context; ++i) {
      const T* prow = p + i * context;
      T* drow = d_p + i * context;
      const T dot = cpu::lane_sum<16, T>(i + 1, [&](std::size_t j) { return prow[j] * drow[j]; });
      for (std::size_t j = 0; j <= i; ++j) drow[j] = prow[j] * (drow[j] - dot);
      for (std::size_t j = i + 1; j < context; ++j) drow[j] = T(0);
    }
  }
};

}  // namespace detail

template <std::size_t Heads, class Positions, class In, std::size_t Index>
struct Bind<CausalSelfAttention<Heads, Positions>, In, Index>
    : detail::AttentionLayer<CausalSelfAttention<Heads, Positions>, Heads, Positions, In, Index,
                             1> {};

// The attention's share on one rank of Tensor (see AttentionLayer): a
// layer of TensorParallel's sharded network (parallel/tensor_parallel.hpp
// makes it), never written by hand.
template <class Attention, std::size_t Tensor>
struct TensorHeads {};

template <std::size_t Heads, class Positions, std::size_t Tensor, class In, std::size_t Index>
struct Bind<TensorHeads<CausalSelfAttention<Heads, Positions>, Tensor>, In, Index>
    : detail::AttentionLayer<CausalSelfAttention<Heads, Positions>, Heads, Positions, In, Index,
                             Tensor> {
  using Base = detail::AttentionLayer<CausalSelfAttention<Heads, Positions>, Heads, Positions, In,
                                      Index, Tensor>;
  static constexpr bool checked =
      Base::checked &&
      detail::attention_split_heads_by_degree<Index, CausalSelfAttention<Heads, Positions>, Heads,
                                              Tensor>::ok;
  // The whole layer's parameters, and where this rank's lie in them (in
  // the order of its own): its heads' rows of q, k and v and their biases,
  // its columns of the projection's rows; the projection's bias whole.
  // visit(whole offset, own offset, count, split).
  static constexpr std::size_t whole_width = Base::width;
  static constexpr std::size_t whole_param_count =
      3 * whole_width * whole_width + 3 * whole_width + whole_width * whole_width + whole_width;
  template <class Visit>
  static void tensor_segments(std::size_t rank, Visit&& visit) {
    constexpr std::size_t w = whole_width, inner = Base::inner;
    for (std::size_t part = 0; part < 3; ++part)
      visit((part * w + rank * inner) * w, part * inner * w, inner * w, true);
    for (std::size_t part = 0; part < 3; ++part)
      visit(3 * w * w + part * w + rank * inner, Base::qkv_bias_at + part * inner, inner, true);
    const std::size_t proj = 3 * w * w + 3 * w;
    for (std::size_t row = 0; row < w; ++row)
      visit(proj + row * w + rank * inner, Base::proj_weight_at + row * inner, inner, true);
    visit(proj + w * w, Base::proj_bias_at, w, false);
  }
};

}  // namespace loom
