// LayerNorm and RMSNorm over the last dimension: each position of
// Positions x Features (or a flat vector, one position) normalised over its
// features, as PyTorch's nn.LayerNorm(features) and nn.RMSNorm(features):
//   LayerNorm: y = (x - mean) / sqrt(var + 1e-5) * weight + bias (biased
//              variance; weight starts at 1, bias at 0);
//   RMSNorm:   y = x / sqrt(mean(x^2) + 1e-6) * weight (weight starts at 1).
// No running statistics, so training and evaluation compute alike. Each
// row's statistics are summed in double; backward recomputes them from x
// rather than keeping them (one more pass, no buffer per batch in flight).
// A row's sums run as 8 running sums (cpu::lane_sum), an order the GPU's
// kernels (backend/cuda/transformer.cuh) do not follow: the two agree to
// rounding, not to the bit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../backend/cpu/reduce.hpp"
#include "../core/host_device.hpp"
#include "layer.hpp"

namespace loom {

struct LayerNorm {};
struct RMSNorm {};

namespace detail {

inline constexpr double layer_norm_eps = 1e-5;
inline constexpr double rms_norm_eps = 1e-6;

// Centered: LayerNorm (mean removed, a bias); else RMSNorm.
template <class Spec, class In, std::size_t Index, bool Centered>
struct RowNormLayer : LayerBase<Spec, In, In, Index> {
  static constexpr bool checked =
      layer_input_rank_mismatch<Index, Spec, In::rank == 2 ? 2 : 1, In::rank>::ok;
  static constexpr std::size_t features = In::rank == 2 ? dim_or_one<In, 1> : In::size;
  static constexpr std::size_t rows = In::size / features;  // per sample
  static constexpr std::size_t weight_count = features;
  static constexpr std::size_t bias_count = Centered ? features : 0;
  static constexpr std::size_t param_count = weight_count + bias_count;
  static constexpr std::size_t forward_flops = 5 * In::size;
  static constexpr std::size_t backward_flops = 10 * In::size;
  static constexpr std::string_view kind = Centered ? "layernorm" : "rmsnorm";
  static constexpr double eps = Centered ? layer_norm_eps : rms_norm_eps;

  template <class T>
  static void init(T* params, std::uint64_t, bool) {
    for (std::size_t c = 0; c < param_count; ++c) params[c] = c < features ? T(1) : T(0);
  }

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {features}, false);
    if constexpr (Centered) visit("bias", features, {features}, false);
  }

  template <class T>
  LOOM_CPU_KERNEL static void forward(const T* params, const T* x, T* y, T*, std::size_t samples) {
    for (std::size_t r = 0; r < samples * rows; ++r) {
      const T* in = x + r * features;
      T* out = y + r * features;
      const Moments m = moments(in);
      for (std::size_t c = 0; c < features; ++c) {
        const T normalised = static_cast<T>((static_cast<double>(in[c]) - m.mean) * m.rstd);
        out[c] = normalised * params[c];
        if constexpr (Centered) out[c] += params[features + c];
      }
    }
  }

  // With x̂ the normalised input and g = dy * weight:
  //   LayerNorm: dx = rstd * (g - mean(g) - x̂ * mean(g * x̂));
  //   RMSNorm:   dx = rstd * (g - x̂ * mean(g * x̂)).
  template <class T>
  LOOM_CPU_KERNEL static void backward(const T* params, const T* x, const T*, const T* dy, T* dx,
                                       T* dparams, T*, std::size_t samples, bool accumulate) {
    if (!accumulate)
      for (std::size_t c = 0; c < param_count; ++c) dparams[c] = T(0);
    for (std::size_t r = 0; r < samples * rows; ++r) {
      const T* in = x + r * features;
      const T* grad = dy + r * features;
      const Moments m = moments(in);
      auto normalised = [&](std::size_t c) {
        return (static_cast<double>(in[c]) - m.mean) * m.rstd;
      };
      auto g = [&](std::size_t c) {
        return static_cast<double>(grad[c]) * static_cast<double>(params[c]);
      };
      for (std::size_t c = 0; c < features; ++c) {
        dparams[c] += static_cast<T>(static_cast<double>(grad[c]) * normalised(c));
        if constexpr (Centered) dparams[features + c] += grad[c];
      }
      if (dx == nullptr) continue;
      const double g_mean =
          Centered ? cpu::lane_sum<8, double>(features, [&](std::size_t c) { return g(c); }) /
                         static_cast<double>(features)
                   : 0.0;
      const double gx_mean =
          cpu::lane_sum<8, double>(features, [&](std::size_t c) { return g(c) * normalised(c); }) /
          static_cast<double>(features);
      T* out = dx + r * features;
      for (std::size_t c = 0; c < features; ++c)
        out[c] = static_cast<T>(m.rstd * (g(c) - g_mean - normalised(c) * gx_mean));
    }
  }

 private:
  struct Moments {
    double mean = 0.0;  // 0 for RMSNorm
    double rstd = 1.0;  // 1 / sqrt(variance or mean square + eps)
  };
  template <class T>
  static Moments moments(const T* in) {
    Moments m;
    if constexpr (Centered)
      m.mean = cpu::lane_sum<8, double>(features,
                                        [&](std::size_t c) { return static_cast<double>(in[c]); }) /
               static_cast<double>(features);
    const double squares = cpu::lane_sum<8, double>(features, [&](std::size_t c) {
      const double d = static_cast<double>(in[c]) - m.mean;
      return d * d;
    });
    m.rstd = 1.0 / std::sqrt(squares / static_cast<double>(features) + eps);
    return m;
  }
};

}  // namespace detail

template <class In, std::size_t Index>
struct Bind<LayerNorm, In, Index> : detail::RowNormLayer<LayerNorm, In, Index, true> {};

template <class In, std::size_t Index>
struct Bind<RMSNorm, In, Index> : detail::RowNormLayer<RMSNorm, In, Index, false> {};

}  // namespace loom
