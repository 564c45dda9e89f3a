// BatchNorm2d (per channel of C x H x W) and BatchNorm1d (per feature of a
// flat vector), as PyTorch defines them: training normalises with the batch's
// mean and biased variance and updates running statistics (momentum 0.1, the
// unbiased variance); evaluation normalises with the running statistics.
// Parameters: weight (gamma) [C], bias (beta) [C]; state: running mean [C],
// running variance [C]. Backward recomputes the batch statistics from x
// rather than saving them: one extra pass, no per-slot buffer. A ReLU after
// it is fused into the same passes (Fused<BatchNorm2d, ReLU>).
//
// BatchNorm1d over a time-major sequence Frames x C normalises per channel
// (the last dimension) over every sample's valid frames (LayerContext::
// frames): padded frames are left out of the statistics, the running
// statistics and the gradient sums, written as zero and given zero input
// gradient. With every frame valid it is PyTorch's BatchNorm1d over (N, C, L).
//
// SyncBatchNorm2d / SyncBatchNorm1d are the same layers whose training
// statistics span the global batch: under DataParallel the replicas sum
// their per-channel sums (forward) and gradient sums (backward), so the
// result is one device's on the whole batch. Elsewhere (one device, a
// pipeline's micro-batches) they are BatchNorm.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include "../backend/cpu/epilogue.hpp"
#include "frames.hpp"
#include "layer.hpp"
#include "relu.hpp"

namespace loom {

struct BatchNorm2d {};
struct BatchNorm1d {};
struct SyncBatchNorm2d {};
struct SyncBatchNorm1d {};

namespace detail {

inline constexpr double batch_norm_eps = 1e-5;
inline constexpr double batch_norm_momentum = 0.1;

// What both forms share: parameters gamma and beta and the running
// statistics of Channels channels, and PyTorch's update of the latter.
template <class Spec, class In, std::size_t Index, std::size_t Channels, Act A, bool Sync>
struct BatchNormBase : LayerBase<Spec, In, In, Index> {
  static constexpr bool syncs = Sync;
  static constexpr std::size_t channels = Channels;
  static constexpr std::size_t weight_count = channels;
  static constexpr std::size_t bias_count = channels;
  static constexpr std::size_t param_count = 2 * channels;
  static constexpr std::size_t state_count = 2 * channels;
  static constexpr bool contextual = true;
  static constexpr std::size_t forward_flops = 4 * In::size;
  static constexpr std::size_t backward_flops = 8 * In::size;
  static constexpr Act activation = A;

  template <class T>
  static void init(T* params, std::uint64_t, bool) {
    for (std::size_t c = 0; c < channels; ++c) {
      params[c] = T(1);
      params[channels + c] = T(0);
    }
  }
  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight", 0, {channels}, false);
    visit("bias", channels, {channels}, false);
    visit("running_mean", 0, {channels}, true);
    visit("running_var", channels, {channels}, true);
  }
  template <class T>
  static void init_state(T* state) {
    for (std::size_t c = 0; c < channels; ++c) {
      state[c] = T(0);
      state[channels + c] = T(1);
    }
  }

  // The statistics a pass normalises with: the batch's in training (the
  // form's batch_moments), the running ones in evaluation. Returns the
  // batch's count per channel (training).
  template <class Layer, class T>
  static double moments_of(const T* x, std::size_t n, const LayerContext<T>& context,
                           std::array<double, 2 * channels>& moments) {
    if (context.pass.training) return Layer::batch_moments(x, n, context, moments);
    for (std::size_t c = 0; c < 2 * channels; ++c)
      moments[c] = static_cast<double>(context.state[c]);
    return 0;
  }

  // A forward's moments_of, and in training PyTorch's update of the
  // running statistics from them: momentum 0.1, the unbiased variance.
  template <class Layer, class T>
  static void forward_moments(const T* x, std::size_t n, const LayerContext<T>& context,
                              std::array<double, 2 * channels>& moments) {
    const double count = moments_of<Layer>(x, n, context, moments);
    if (context.pass.training) update_running(context.state, moments, count);
  }

  // The running statistics' update after a training forward over `count`
  // values per channel.
  template <class T>
  static void update_running(T* state, const std::array<double, 2 * channels>& moments,
                             double count) {
    const double unbiased = count > 1 ? count / (count - 1) : 1.0;
    for (std::size_t c = 0; c < channels; ++c) {
      T& mean = state[c];
      T& var = state[channels + c];
      mean = static_cast<T>((1 - batch_norm_momentum) * mean + batch_norm_momentum * moments[c]);
      var = static_cast<T>((1 - batch_norm_momentum) * var +
                           batch_norm_momentum * moments[channels + c] * unbiased);
    }
  }
};

template <class Spec, class In, std::size_t Index, std::size_t Rank, Act A, bool Sync>
struct BatchNormLayer : BatchNormBase<Spec, In, Index, dim_or_one<In, 0>, A, Sync> {
  static constexpr bool checked = layer_input_rank_mismatch<Index, Spec, Rank, In::rank>::ok;
  static constexpr std::size_t channels = dim_or_one<In, 0>;
  static constexpr std::size_t plane = In::size / channels;
  static constexpr std::string_view kind = "batchnorm";

  // Each channel's training mean and biased variance, accumulated in
  // double: two passes over this device's samples, or, across replicas, one
  // pass of sums added up over all of them. Returns the sample count.
  template <class T>
  static double batch_moments(const T* x, std::size_t n, const LayerContext<T>& context,
                              std::array<double, 2 * channels>& moments) {
    const Pass& pass = context.pass;
    if (Sync && pass.replicas != nullptr) {
      std::array<double, 2 * channels + 1> sums{};
      for (std::size_t c = 0; c < channels; ++c)
        for (std::size_t s = 0; s < n; ++s) {
          const T* p = x + s * In::size + c * plane;
          for (std::size_t i = 0; i < plane; ++i) {
            const double v = static_cast<double>(p[i]);
            sums[c] += v;
            sums[channels + c] += v * v;
          }
        }
      sums[2 * channels] = static_cast<double>(n * plane);
      pass.replicas->sum(sums);
      const double count = sums[2 * channels];
      for (std::size_t c = 0; c < channels; ++c) {
        moments[c] = sums[c] / count;
        moments[channels + c] =
            std::max(0.0, sums[channels + c] / count - moments[c] * moments[c]);
      }
      return count;
    }
    const double count = static_cast<double>(n * plane);
    for (std::size_t c = 0; c < channels; ++c) {
      double sum = 0, squares = 0;
      for (std::size_t s = 0; s < n; ++s) {
        const T* p = x + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) sum += static_cast<double>(p[i]);
      }
      const double mean = sum / count;
      for (std::size_t s = 0; s < n; ++s) {
        const T* p = x + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) {
          const double d = static_cast<double>(p[i]) - mean;
          squares += d * d;
        }
      }
      moments[c] = mean;
      moments[channels + c] = squares / count;
    }
    return count;
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t n,
                      const LayerContext<T>& context) {
    std::array<double, 2 * channels> moments;
    BatchNormLayer::template forward_moments<BatchNormLayer>(x, n, context, moments);
    for (std::size_t c = 0; c < channels; ++c) {
      const double mean = moments[c], var = moments[channels + c];
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
    std::array<double, 2 * channels> moments;
    const double count =
        BatchNormLayer::template moments_of<BatchNormLayer>(x, n, context, moments);
    // The gradient before the fused activation: dy masked where the ReLU cut.
    const auto grad = [&](std::size_t s, std::size_t c, std::size_t i) {
      const std::size_t at = s * In::size + c * plane + i;
      return static_cast<double>(cpu::activate_grad<A>(dy[at], y[at]));
    };
    // Per channel: sum(dy) (beta's gradient), then sum(dy * xhat) (gamma's).
    std::array<double, 2 * channels> sums{};
    for (std::size_t c = 0; c < channels; ++c) {
      const double mean = moments[c];
      const double inv_std = 1.0 / std::sqrt(moments[channels + c] + batch_norm_eps);
      for (std::size_t s = 0; s < n; ++s) {
        const T* in = x + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) {
          const double g = grad(s, c, i);
          sums[c] += g;
          sums[channels + c] += g * (static_cast<double>(in[i]) - mean) * inv_std;
        }
      }
      dparams[c] = static_cast<T>(accumulate ? dparams[c] + sums[channels + c] : sums[channels + c]);
      dparams[channels + c] = static_cast<T>(accumulate ? dparams[channels + c] + sums[c] : sums[c]);
    }
    if (dx == nullptr) return;
    // The input gradient's batch terms span the global batch: the replicas'
    // sums, while the parameter gradients above stay this replica's (the
    // gradient all-reduce adds them).
    if (Sync && context.pass.training && context.pass.replicas != nullptr)
      context.pass.replicas->sum(sums);
    for (std::size_t c = 0; c < channels; ++c) {
      const double mean = moments[c];
      const double inv_std = 1.0 / std::sqrt(moments[channels + c] + batch_norm_eps);
      const double gamma = static_cast<double>(params[c]);
      const double dbeta = sums[c], dgamma = sums[channels + c];
      for (std::size_t s = 0; s < n; ++s) {
        const T* in = x + s * In::size + c * plane;
        T* out = dx + s * In::size + c * plane;
        for (std::size_t i = 0; i < plane; ++i) {
          if (context.pass.training) {
            // The batch statistics depend on every x: the mean's and variance's terms.
            const double xhat = (static_cast<double>(in[i]) - mean) * inv_std;
            out[i] = static_cast<T>(gamma * inv_std / count *
                                    (count * grad(s, c, i) - dbeta - xhat * dgamma));
          } else {
            out[i] = static_cast<T>(gamma * inv_std * grad(s, c, i));
          }
        }
      }
    }
  }
};

// BatchNorm1d (or SyncBatchNorm1d) over a time-major sequence Frames x C.
// Channels are the innermost loop, so every pass reads memory in order;
// each channel's sums still run over (sample, frame) in order, the order
// BatchNormLayer takes over the same valid frames packed as a batch of
// C-vectors, and the two agree bit for bit (a test holds them so).
template <class Spec, class In, std::size_t Index, Act A, bool Sync>
struct BatchNormTimeLayer : BatchNormBase<Spec, In, Index, In::dims[1], A, Sync> {
  static constexpr std::size_t frames = In::dims[0];
  static constexpr std::size_t channels = In::dims[1];
  // Not "batchnorm": channels are the inner dimension here (N x Frames x
  // C), and only the valid frames count; the GPU's BatchNormRunner takes
  // this layout, with a frame mask, by this kind.
  static constexpr std::string_view kind = "batchnorm_time";

  // Calls visit(offset of the frame's C values) for every valid frame,
  // samples and frames in order.
  template <class T, class Visit>
  static void each_valid(std::size_t n, const LayerContext<T>& context, Visit&& visit) {
    for (std::size_t s = 0; s < n; ++s) {
      const std::size_t valid = sample_frames<Spec, Index, frames>(context, s);
      for (std::size_t t = 0; t < valid; ++t) visit(s * In::size + t * channels);
    }
  }

  // Zeroes every sample's frames at or past its length.
  template <class T>
  static void zero_padding(T* v, std::size_t n, const LayerContext<T>& context) {
    for (std::size_t s = 0; s < n; ++s) {
      const std::size_t valid = sample_frames<Spec, Index, frames>(context, s);
      std::fill(v + s * In::size + valid * channels, v + (s + 1) * In::size, T(0));
    }
  }

  static void check_count(double count) {
    LOOM_CHECK(count > 0, type_label<Spec>(), " (", layer_path_text(Index),
               ") in training: no sample of the batch has a valid frame (every length is 0), "
               "so there are no statistics to normalise with; leave empty sequences out of the "
               "data");
  }

  // As BatchNormLayer's, over the valid frames only.
  template <class T>
  static double batch_moments(const T* x, std::size_t n, const LayerContext<T>& context,
                              std::array<double, 2 * channels>& moments) {
    std::size_t valid_frames = 0;
    for (std::size_t s = 0; s < n; ++s)
      valid_frames += sample_frames<Spec, Index, frames>(context, s);
    if (Sync && context.pass.replicas != nullptr) {
      std::array<double, 2 * channels + 1> sums{};
      each_valid(n, context, [&](std::size_t at) {
        for (std::size_t c = 0; c < channels; ++c) {
          const double v = static_cast<double>(x[at + c]);
          sums[c] += v;
          sums[channels + c] += v * v;
        }
      });
      sums[2 * channels] = static_cast<double>(valid_frames);
      context.pass.replicas->sum(sums);
      const double count = sums[2 * channels];
      check_count(count);
      for (std::size_t c = 0; c < channels; ++c) {
        moments[c] = sums[c] / count;
        moments[channels + c] = std::max(0.0, sums[channels + c] / count - moments[c] * moments[c]);
      }
      return count;
    }
    const double count = static_cast<double>(valid_frames);
    check_count(count);
    std::array<double, channels> sums{}, squares{};
    each_valid(n, context, [&](std::size_t at) {
      for (std::size_t c = 0; c < channels; ++c) sums[c] += static_cast<double>(x[at + c]);
    });
    for (std::size_t c = 0; c < channels; ++c) moments[c] = sums[c] / count;
    each_valid(n, context, [&](std::size_t at) {
      for (std::size_t c = 0; c < channels; ++c) {
        const double d = static_cast<double>(x[at + c]) - moments[c];
        squares[c] += d * d;
      }
    });
    for (std::size_t c = 0; c < channels; ++c) moments[channels + c] = squares[c] / count;
    return count;
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T*, std::size_t n,
                      const LayerContext<T>& context) {
    std::array<double, 2 * channels> moments;
    BatchNormTimeLayer::template forward_moments<BatchNormTimeLayer>(x, n, context, moments);
    std::array<T, channels> scale, shift;
    for (std::size_t c = 0; c < channels; ++c) {
      const double mean = moments[c], var = moments[channels + c];
      scale[c] = static_cast<T>(params[c] / std::sqrt(var + batch_norm_eps));
      shift[c] = static_cast<T>(params[channels + c] - mean * scale[c]);
    }
    each_valid(n, context, [&](std::size_t at) {
      for (std::size_t c = 0; c < channels; ++c)
        y[at + c] = cpu::activate<A>(x[at + c] * scale[c] + shift[c]);
    });
    zero_padding(y, n, context);
  }

  template <class T>
  static void backward(const T* params, const T* x, const T* y, const T* dy, T* dx, T* dparams, T*,
                       std::size_t n, bool accumulate, const LayerContext<T>& context) {
    std::array<double, 2 * channels> moments;
    const double count =
        BatchNormTimeLayer::template moments_of<BatchNormTimeLayer>(x, n, context, moments);
    std::array<double, channels> inv_std;
    for (std::size_t c = 0; c < channels; ++c)
      inv_std[c] = 1.0 / std::sqrt(moments[channels + c] + batch_norm_eps);
    // Per channel: sum(dy) (beta's gradient), then sum(dy * xhat) (gamma's),
    // dy masked where the fused ReLU cut.
    std::array<double, 2 * channels> sums{};
    each_valid(n, context, [&](std::size_t at) {
      for (std::size_t c = 0; c < channels; ++c) {
        const double g = static_cast<double>(cpu::activate_grad<A>(dy[at + c], y[at + c]));
        sums[c] += g;
        sums[channels + c] += g * (static_cast<double>(x[at + c]) - moments[c]) * inv_std[c];
      }
    });
    for (std::size_t c = 0; c < channels; ++c) {
      dparams[c] =
          static_cast<T>(accumulate ? dparams[c] + sums[channels + c] : sums[channels + c]);
      dparams[channels + c] =
          static_cast<T>(accumulate ? dparams[channels + c] + sums[c] : sums[c]);
    }
    if (dx == nullptr) return;
    // Across replicas the input gradient's batch terms are the global batch's.
    if (Sync && context.pass.training && context.pass.replicas != nullptr)
      context.pass.replicas->sum(sums);
    each_valid(n, context, [&](std::size_t at) {
      for (std::size_t c = 0; c < channels; ++c) {
        const double g = static_cast<double>(cpu::activate_grad<A>(dy[at + c], y[at + c]));
        const double gamma = static_cast<double>(params[c]);
        if (context.pass.training) {
          const double xhat = (static_cast<double>(x[at + c]) - moments[c]) * inv_std[c];
          dx[at + c] = static_cast<T>(gamma * inv_std[c] / count *
                                      (count * g - sums[c] - xhat * sums[channels + c]));
        } else {
          dx[at + c] = static_cast<T>(gamma * inv_std[c] * g);
        }
      }
    });
    zero_padding(dx, n, context);
  }
};

}  // namespace detail

namespace detail {

template <class Spec>
struct batch_norm_kind {
  static constexpr bool is = false;
};
template <>
struct batch_norm_kind<BatchNorm2d> {
  static constexpr bool is = true, sync = false;
  static constexpr std::size_t rank = 3;
};
template <>
struct batch_norm_kind<BatchNorm1d> {
  static constexpr bool is = true, sync = false;
  static constexpr std::size_t rank = 1;
};
template <>
struct batch_norm_kind<SyncBatchNorm2d> {
  static constexpr bool is = true, sync = true;
  static constexpr std::size_t rank = 3;
};
template <>
struct batch_norm_kind<SyncBatchNorm1d> {
  static constexpr bool is = true, sync = true;
  static constexpr std::size_t rank = 1;
};

}  // namespace detail

// The four normalisation specs, alone or fused with the ReLU after them.
template <class Spec>
concept BatchNormSpec = detail::batch_norm_kind<Spec>::is;

namespace detail {

// BatchNorm1d over Frames x C is the form over time; every other input
// goes to BatchNormLayer, whose rank check names what it takes.
template <class Spec, class In, std::size_t Index, Act A>
using batch_norm_layer_t = std::conditional_t<
    batch_norm_kind<Spec>::rank == 1 && In::rank == 2,
    BatchNormTimeLayer<Spec, In, Index, A, batch_norm_kind<Spec>::sync>,
    BatchNormLayer<Spec, In, Index, batch_norm_kind<Spec>::rank, A, batch_norm_kind<Spec>::sync>>;

}  // namespace detail

template <BatchNormSpec Spec, class In, std::size_t Index>
struct Bind<Spec, In, Index> : detail::batch_norm_layer_t<Spec, In, Index, Act::identity> {};
template <BatchNormSpec Spec, class In, std::size_t Index>
struct Bind<Fused<Spec, ReLU>, In, Index> : detail::batch_norm_layer_t<Spec, In, Index, Act::relu> {
};

}  // namespace loom
