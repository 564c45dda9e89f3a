// Conv1d<Out, K, Stride, Pad, Dilation>: Out filters of K taps, Dilation
// frames apart, over a time-major sequence Frames x C (C inferred), zero
// padding Pad at both ends: PyTorch's Conv1d over (N, C, L), with time
// first. Output Frames' x Out, Frames' = (Frames + 2 Pad - Dilation (K - 1)
// - 1) / Stride + 1. Parameters: weight [Out, C, K], bias [Out].
//
// Each sample has its own length (LayerContext::frames), mapped by the same
// rule (frames_out). Inputs at or past it read as zero, outputs at or past
// the output length are written as zero, and neither they nor their
// gradients reach the weights or the input gradient: padding changes
// nothing. A length that leaves no output frame is an Error naming the
// sample, not a silent empty output (the loss after it could not score it).
//
// Forward, per sample: im2col of its valid output frames (a row each, C x K
// columns), one GEMM straight into the output's layout (Frames' x Out, as
// Linear over positions) and the bias(+ReLU) pass. Backward, per sample:
// dZ = act'(dY), the bias sum and weight GEMM, then dcol = dZ W and col2im.
// One GEMM per sample and not one per chunk of samples (as Conv2d): OpenBLAS
// rounds a row of an sgemm by the block of rows it falls in (Zen kernels,
// 0.3.21: with K = 240, N = 256, every one of 64 samples of 50 rows came out
// different alone and inside one GEMM over all 64), so only per-sample calls
// make a sample's outputs and gradients independent of its batch, bit for
// bit; and padded frames then cost no FLOPs.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <string_view>

#include "../backend/cpu/cpu.hpp"
#include "../core/activation.hpp"
#include "frames.hpp"
#include "layer.hpp"
#include "relu.hpp"

namespace loom {

template <std::size_t Out_, std::size_t K_, std::size_t Stride_ = 1, std::size_t Pad_ = 0,
          std::size_t Dilation_ = 1>
struct Conv1d {
  static constexpr std::size_t out_channels = Out_;
  static constexpr std::size_t kernel = K_;
  static constexpr std::size_t stride = Stride_;
  static constexpr std::size_t pad = Pad_;
  static constexpr std::size_t dilation = Dilation_;
};

namespace detail {

// Frames a window of K taps Dilation apart spans: D (K - 1) + 1.
constexpr std::size_t dilated_span(std::size_t k, std::size_t dilation) {
  return k > 0 ? dilation * (k - 1) + 1 : 1;
}

// PyTorch's output length over `frames` padded by `pad` at both ends; 0 when
// the window does not fit.
constexpr std::size_t dilated_window_out(std::size_t frames, std::size_t k, std::size_t stride,
                                         std::size_t pad, std::size_t dilation) {
  const std::size_t span = dilated_span(k, dilation);
  return stride > 0 && frames + 2 * pad >= span ? (frames + 2 * pad - span) / stride + 1 : 0;
}

template <class Spec, class In, std::size_t Index, Act A>
struct Conv1dLayer;

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t D, class In,
          std::size_t Index, Act A>
struct Conv1dLayer<Conv1d<Out, K, S, P, D>, In, Index, A>
    : LayerBase<
          Conv1d<Out, K, S, P, D>, In,
          Shape<std::max<std::size_t>(1, dilated_window_out(dim_or_one<In, 0>, K, S, P, D)), Out>,
          Index> {
  using Spec = Conv1d<Out, K, S, P, D>;
  static constexpr std::size_t span = dilated_span(K, D);
  // The padded input, or the span after a rank error so that only that error shows.
  static constexpr std::size_t padded_frames = In::rank == 2 ? dim_or_one<In, 0> + 2 * P : span;
  static constexpr bool checked =
      layer_argument_must_be_positive<Index, Spec, Out>::ok &&
      layer_argument_must_be_positive<Index, Spec, K>::ok &&
      layer_argument_must_be_positive<Index, Spec, S>::ok &&
      layer_argument_must_be_positive<Index, Spec, D>::ok &&
      layer_input_rank_mismatch<Index, Spec, 2, In::rank>::ok &&
      layer_window_larger_than_input<Index, Spec, span, padded_frames>::ok;

  static constexpr std::size_t frames = dim_or_one<In, 0>;
  static constexpr std::size_t channels = dim_or_one<In, 1>;
  static constexpr std::size_t out_frames = Conv1dLayer::output_shape::dims[0];
  static constexpr std::size_t patch = channels * K;

  static constexpr std::size_t weight_count = Out * patch;
  static constexpr std::size_t bias_count = Out;
  static constexpr std::size_t param_count = weight_count + bias_count;
  // One sample's column matrix (reused for its gradient) + its dZ.
  static constexpr std::size_t workspace = out_frames * (patch + Out);
  static constexpr std::size_t chunk = 1;
  static constexpr std::size_t forward_flops = 2 * out_frames * Out * patch + out_frames * Out;
  // The input-gradient GEMM is skipped for the network's first layer.
  static constexpr std::size_t backward_flops =
      (Index == 1 ? 2 : 4) * out_frames * Out * patch + out_frames * Out;
  static constexpr bool contextual = true;
  static constexpr std::string_view kind = "conv1d";
  static constexpr Act activation = A;

  static constexpr std::size_t frames_out(std::size_t frames_in) {
    return dilated_window_out(frames_in, K, S, P, D);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {Out, channels, K}, false);
    visit("bias", weight_count, {Out}, false);
  }

  template <class T>
  static void init(T* params, std::uint64_t seed, bool relu_follows) {
    init_uniform(params, weight_count, init_limit(patch, Out * K, relu_follows), seed, Index);
    for (std::size_t i = 0; i < bias_count; ++i) params[weight_count + i] = T(0);
  }

  // Sample s's lengths: its input's and its output's.
  struct Lengths {
    std::size_t in, out;
  };
  template <class T>
  static Lengths lengths(const LayerContext<T>& context, std::size_t s) {
    const std::size_t in = sample_frames<Spec, Index, frames>(context, s);
    const std::size_t out = frames_out(in);
    LOOM_CHECK(out > 0, type_label<Spec>(), " (", layer_path_text(Index), "): sample ", s,
               " of the batch (global sample ", context.pass.first_sample + s, ") has ", in,
               " frames; padded by ", P, " at both ends that is shorter than the ", span,
               " frames the window spans, so it has no output frame; leave such short "
               "sequences out of the data or use a smaller kernel, dilation or more padding");
    return {in, out};
  }

  // Sample s's rows: row t, column c K + k holds x[t S + k D - P, c], zero
  // outside 0..length - 1; rows at or past the output length are not made.
  template <class T>
  static void im2col(const T* x, T* col, Lengths length) {
    for (std::size_t t = 0; t < length.out; ++t) {
      T* row = col + t * patch;
      for (std::size_t k = 0; k < K; ++k) {
        // Signed: with padding the window may start before frame 0.
        const long at = static_cast<long>(t * S + k * D) - static_cast<long>(P);
        if (at < 0 || at >= static_cast<long>(length.in)) {
          for (std::size_t c = 0; c < channels; ++c) row[c * K + k] = T(0);
          continue;
        }
        const T* frame = x + static_cast<std::size_t>(at) * channels;
        for (std::size_t c = 0; c < channels; ++c) row[c * K + k] = frame[c];
      }
    }
  }

  // dx = col2im(dcol) for one sample: each row's entries added back to the
  // frames they came from, in (frame, tap) order; padding and frames at or
  // past the length get nothing and stay zero.
  template <class T>
  static void col2im(const T* col, T* dx, Lengths length) {
    std::fill(dx, dx + In::size, T(0));
    for (std::size_t t = 0; t < length.out; ++t) {
      const T* row = col + t * patch;
      for (std::size_t k = 0; k < K; ++k) {
        const long at = static_cast<long>(t * S + k * D) - static_cast<long>(P);
        if (at < 0 || at >= static_cast<long>(length.in)) continue;
        T* frame = dx + static_cast<std::size_t>(at) * channels;
        for (std::size_t c = 0; c < channels; ++c) frame[c] += row[c * K + k];
      }
    }
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& context) {
    constexpr std::size_t out_size = Conv1dLayer::output_shape::size;
    for (std::size_t s = 0; s < n; ++s) {
      const Lengths length = lengths(context, s);
      T* out = y + s * out_size;
      im2col(x + s * In::size, work, length);
      cpu::gemm<T>(false, true, length.out, Out, patch, T(1), work, patch, params, patch, T(0), out,
                   Out);
      cpu::bias_act_rows<A>(out, params + weight_count, length.out, Out);
      std::fill(out + length.out * Out, out + out_size, T(0));
    }
  }

  // Per sample, in order: dZ = act'(dY) on its valid rows, db (+)= their
  // column sums, dW (+)= dZ^T col, and (skipped for the first layer)
  // dcol = dZ W, col2im. A sample's parameter gradient is thus added whole,
  // in sample order, however the batch is split into micro-batches or
  // single samples, and padded frames cost nothing.
  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t n, bool accumulate, const LayerContext<T>& context) {
    constexpr std::size_t out_size = Conv1dLayer::output_shape::size;
    T* col = work;
    T* dz = work + out_frames * patch;
    T* dbias = dparams + weight_count;
    for (std::size_t s = 0; s < n; ++s) {
      const Lengths length = lengths(context, s);
      const bool add = accumulate || s > 0;
      const std::size_t at = s * out_size;
      for (std::size_t i = 0; i < length.out * Out; ++i)
        dz[i] = cpu::activate_grad<A>(dy[at + i], y[at + i]);
      std::array<T, Out> sums{};
      for (std::size_t t = 0; t < length.out; ++t)
        for (std::size_t o = 0; o < Out; ++o) sums[o] += dz[t * Out + o];
      for (std::size_t o = 0; o < Out; ++o) dbias[o] = add ? dbias[o] + sums[o] : sums[o];
      im2col(x + s * In::size, col, length);
      cpu::gemm<T>(true, false, Out, patch, length.out, T(1), dz, Out, col, patch,
                   add ? T(1) : T(0), dparams, patch);
      if (dx == nullptr) continue;
      cpu::gemm<T>(false, false, length.out, patch, Out, T(1), dz, Out, params, patch, T(0), col,
                   patch);
      col2im(col, dx + s * In::size, length);
    }
  }
};

}  // namespace detail

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t D, class In,
          std::size_t Index>
struct Bind<Conv1d<Out, K, S, P, D>, In, Index>
    : detail::Conv1dLayer<Conv1d<Out, K, S, P, D>, In, Index, Act::identity> {};

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t D, class In,
          std::size_t Index>
struct Bind<Fused<Conv1d<Out, K, S, P, D>, ReLU>, In, Index>
    : detail::Conv1dLayer<Conv1d<Out, K, S, P, D>, In, Index, Act::relu> {};

}  // namespace loom
