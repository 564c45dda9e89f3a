// BatchNorm2d (per channel of C x H x W) and BatchNorm1d (per feature of a
// flat vector), as PyTorch defines them: training normalises with the batch's
// mean and biased variance and updates running statistics (momentum 0.1, the
// unbiased variance); evaluation normalises with the running statistics.
// Parameters: weight (gamma) [C], bias (beta) [C]; state: running mean [C],
// running variance [C]. Backward recomputes the batch statistics from x
// rather than saving them: one extra pass, no per-slot buffer. A ReLU after
// it is fused into the same passes (Fused<BatchNorm2d, ReLU>).
#pragma once

#include <cmath>
#include <cstddef>
#include <string_view>
#include <vector>

#include "../backend/cpu/epilogue.hpp"
#include "layer.hpp"
#include "relu.hpp"

namespace loom {

struct BatchNorm2d {};
struct BatchNorm1d {};

namespace detail {

inline constexpr double batch_norm_eps = 1e-5;
inline constexpr double batch_norm_momentum = 0.1;

template <class Spec, class In, std::size_t Index, std::size_t Rank, Act A>
struct BatchNormLayer : LayerBase<Spec, In, In, Index> {
  static constexpr bool checked = layer_input_rank_mismatch<Index, Spec, Rank, In::rank>::ok;
  static constexpr std::size_t channels = dim_or_one<In, 0>;
  static constexpr std::size_t plane = In::size / channels;
  static constexpr std::size_t weight_count = channels;
  static constexpr std::size_t bias_count = channels;
  static constexpr std::size_t param_count = 2 * channels;
  static constexpr std::size_t state_count = 2 * channels;
  static constexpr bool contextual = true;
  static constexpr std::size_t forward_flops = 4 * In::size;
  static constexpr std::size_t backward_flops = 8 * In::size;
  static constexpr std::string_view kind = "batchnorm";
  static constexpr Act activation = A;

  template <class T>
  static void init(T* params, std::uint64_t, bool) {
    for (std::size_t c = 0; c < channels; ++c) {
      params[c] = T(1);
      params[channels + c] = T(0);
    }
  }
  template <class T>
  static void init_state(T* state) {
    for (std::size_t c = 0; c < channels; ++c) {
      state[c] = T(0);
      state[channels + c] = T(1);
    }
  }

  // Channel c's batch mean and biased variance, accumulated in double.
  template <class T>
  static void batch_moments(const T* x, std::size_t n, std::size_t c, double& mean, double& var) {
    double sum = 0, squares = 0;
    for (std::size_t s = 0; s < n; ++s) {
      const T* p = x + s * In::size + c * plane;
      for (std::size_t i = 0; i < plane; ++i) sum += static_cast<double>(p[i]);
    }
    const double count = static_cast<double>(n * plane);
    mean = sum / count;
    for (std::size_t s = 0; s < n; ++s) {
      const T* p = x + s * In::size + c * plane;
      for (std::size_t i = 0; i < plane; ++i) {
        const double d = static_cast<double>(p[i]) - mean;
        squares += d * d;
      }
    }
    var = squares / count;
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t n,
                      const LayerContext<T>& context) {
    T* running_mean = context.state;
    T* running_var = context.state + channels;
    const double count = static_cast<double>(n * plane);
    for (std::size_t c = 0; c < channels; ++c) {
      double mean, var;
      if (context.pass.training) {
        batch_moments(x, n, c, mean, var);
        const double unbiased = count > 1 ? var * count / (count - 1) : var;
        running_mean[c] = static_cast<T>((1 - batch_norm_momentum) * running_mean[c] +
                                         batch_norm_momentum * mean);
        running_var[c] = static_cast<T>((1 - batch_norm_momentum) * running_var[c] +
                                        batch_norm_momentum * unbiased);
      } else {
        mean = static_cast<double>(running_mean[c]);
        var = static_cast<double>(running_var[c]);
      }
      const T scale = static_cast<T>(params[c] / std::sqrt(var + batch_norm_eps));
      const T shift = static_cast<T>(params[channels + c] - mean * scale);
      for (std::size_t s = 0; s < n; ++s) {
        const T* in = x + s * In::size + c * plane;
        T* out = y + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) out[i] = cpu::activate<A>(in[i] * scale + shift);
      }
    }
  }

  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams,
                       T*, std::size_t n, bool accumulate, const LayerContext<T>& context) {
    const double count = static_cast<double>(n * plane);
    for (std::size_t c = 0; c < channels; ++c) {
      double mean, var;
      if (context.pass.training) {
        batch_moments(x, n, c, mean, var);
      } else {
        mean = static_cast<double>(context.state[c]);
        var = static_cast<double>(context.state[channels + c]);
      }
      const double inv_std = 1.0 / std::sqrt(var + batch_norm_eps);
      // The gradient before the fused activation: dy masked where the ReLU cut.
      const auto grad = [&](std::size_t s, std::size_t i) {
        const std::size_t at = s * In::size + c * plane + i;
        return static_cast<double>(cpu::activate_grad<A>(dy[at], y[at]));
      };
      double dgamma = 0, dbeta = 0;
      for (std::size_t s = 0; s < n; ++s) {
        const T* in = x + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) {
          const double g = grad(s, i);
          dbeta += g;
          dgamma += g * (static_cast<double>(in[i]) - mean) * inv_std;
        }
      }
      dparams[c] = static_cast<T>(accumulate ? dparams[c] + dgamma : dgamma);
      dparams[channels + c] =
          static_cast<T>(accumulate ? dparams[channels + c] + dbeta : dbeta);
      if (dx == nullptr) continue;
      const double gamma = static_cast<double>(params[c]);
      for (std::size_t s = 0; s < n; ++s) {
        const T* in = x + s * In::size + c * plane;
        T* out = dx + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) {
          if (context.pass.training) {
            // The batch statistics depend on every x: the mean's and variance's terms.
            const double xhat = (static_cast<double>(in[i]) - mean) * inv_std;
            out[i] = static_cast<T>(gamma * inv_std / count *
                                    (count * grad(s, i) - dbeta - xhat * dgamma));
          } else {
            out[i] = static_cast<T>(gamma * inv_std * grad(s, i));
          }
        }
      }
    }
  }
};

}  // namespace detail

template <class In, std::size_t Index>
struct Bind<BatchNorm2d, In, Index>
    : detail::BatchNormLayer<BatchNorm2d, In, Index, 3, Act::identity> {};
template <class In, std::size_t Index>
struct Bind<BatchNorm1d, In, Index>
    : detail::BatchNormLayer<BatchNorm1d, In, Index, 1, Act::identity> {};
template <class In, std::size_t Index>
struct Bind<Fused<BatchNorm2d, ReLU>, In, Index>
    : detail::BatchNormLayer<BatchNorm2d, In, Index, 3, Act::relu> {};
template <class In, std::size_t Index>
struct Bind<Fused<BatchNorm1d, ReLU>, In, Index>
    : detail::BatchNormLayer<BatchNorm1d, In, Index, 1, Act::relu> {};

}  // namespace loom
