// Gradient clipping by global norm (PyTorch's clip_grad_norm_): when the
// norm of every gradient of the network, over all its stages, exceeds
// max_norm, every gradient is scaled by max_norm / (norm + 1e-6).
//
// The norm is summed layer by layer, in double, in the network's order: a
// pipeline stage fills in its own layers' squares, the stages add their
// vectors (each entry has one non-zero term, so the sum is exact), and every
// stage then adds the layers up in the same order as one device does. The
// clipped gradients are therefore bit-identical under every policy that
// holds the same gradients.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>

#include "../core/meta.hpp"
#include "../net/sequential.hpp"

namespace loom {

namespace detail {

// Where each layer with parameters begins in Net's flat buffer.
template <class Net>
inline constexpr auto norm_segments = [] {
  using layers = typename Net::executed;
  constexpr std::size_t count = [] {
    std::size_t c = 0;
    static_for<layers::size>([&](auto i) { c += type_at_t<i, layers>::param_count > 0; });
    return c;
  }();
  std::array<std::size_t, count> starts{};
  std::size_t k = 0;
  static_for<layers::size>([&](auto i) {
    if (type_at_t<i, layers>::param_count > 0)
      starts[k++] = list_info<layers>::param_offsets[i];
  });
  return starts;
}();

// The squared norm of each of LocalNet's layers' gradients (`grads`, which
// begin at `offset` in the whole network) into their entries of `squares`,
// one per segment of the whole network (`starts`).
template <class LocalNet>
void add_layer_squares(std::span<const float> grads, std::size_t offset,
                       std::span<const std::size_t> starts, std::span<double> squares,
                       LayerRange range = {0, LocalNet::executed::size}) {
  using layers = typename LocalNet::executed;
  static_for<layers::size>([&](auto i) {
    using L = type_at_t<i, layers>;
    if (i < range.first || i >= range.last) return;
    // A tied copy (TiedLinear) holds the same gradient as the layer it
    // ties to, after the engine's sum: the tensor counts once.
    if constexpr (L::param_count > 0 && !TiesWeight<L>) {
      const std::size_t begin =
          list_info<layers>::param_offsets[i] - list_info<layers>::param_offsets[range.first];
      const auto at = std::ranges::lower_bound(starts, offset + begin) - starts.begin();
      double sum = 0.0;
      for (std::size_t j = begin; j < begin + L::param_count; ++j)
        sum += static_cast<double>(grads[j]) * static_cast<double>(grads[j]);
      squares[static_cast<std::size_t>(at)] = sum;
    }
  });
}

}  // namespace detail

inline double global_norm(std::span<const double> layer_squares) {
  double sum = 0.0;
  for (const double s : layer_squares) sum += s;
  return std::sqrt(sum);
}

// The factor clip_grad_norm_ scales gradients of global norm `norm` by (1:
// unchanged, as for a non-finite norm, which scaling cannot make finite).
inline float clip_factor(double norm, double max_norm) {
  const double coefficient = max_norm / (norm + 1e-6);
  if (!std::isfinite(norm) || !(coefficient < 1.0)) return 1.0f;
  return static_cast<float>(coefficient);
}

// Scales `grads` as clip_grad_norm_ would for a global norm `norm`; returns
// the factor (1: unchanged). A non-finite norm (an infinite or NaN gradient)
// leaves them as they are: scaling cannot make them finite. The trainer
// checks the gradients before clipping and skips or raises for such a step
// (FitOptions::on_nonfinite; fp16 skips it as an overflow).
inline float clip_gradients(std::span<float> grads, double norm, double max_norm) {
  const float factor = clip_factor(norm, max_norm);
  if (factor != 1.0f)
    for (float& g : grads) g *= factor;
  return factor;
}

// One device (or a data-parallel replica) holding all of Net's gradients.
template <class Net>
float clip_gradients(std::span<float> grads, double max_norm) {
  std::array<double, detail::norm_segments<Net>.size()> squares{};
  detail::add_layer_squares<Net>(grads, 0, detail::norm_segments<Net>, squares);
  return clip_gradients(grads, global_norm(squares), max_norm);
}

}  // namespace loom
