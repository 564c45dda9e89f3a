// Dropout<P>: in training, zeroes each element with probability P and scales
// the rest by 1 / (1 - P); in evaluation, the identity. The mask is a pure
// function of (seed, layer, step, global sample index, element): every
// policy and device count drops the same elements as one device, and
// backward regenerates the mask instead of storing it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../core/host_device.hpp"
#include "layer.hpp"

namespace loom {

template <double P_>
struct Dropout {
  static_assert(P_ >= 0.0 && P_ < 1.0, "Dropout<P>: P must be in [0, 1)");
  static constexpr double p = P_;
};

template <double P, class In, std::size_t Index>
struct Bind<Dropout<P>, In, Index> : LayerBase<Dropout<P>, In, In, Index> {
  static constexpr bool contextual = true;
  static constexpr std::size_t forward_flops = In::size;
  static constexpr std::size_t backward_flops = In::size;
  static constexpr std::string_view kind = "dropout";

  // The CUDA runner reads the step from device memory, without a Pass: both
  // draw their masks through stream_at.
  LOOM_HOST_DEVICE static std::uint64_t stream_at(std::uint64_t step) {
    return mix64(stream_key(RngPurpose::dropout, Index) ^ mix64(step));
  }
  static std::uint64_t stream(const Pass& pass) { return stream_at(pass.step); }
  LOOM_HOST_DEVICE static bool keep(std::uint64_t seed, std::uint64_t stream, std::size_t sample,
                                    std::size_t i) {
    return uniform01(seed, stream, sample * In::size + i) >= P;
  }

  template <class T>
  static void apply(const T* in, T* out, std::size_t n, const Pass& pass) {
    const T scale = static_cast<T>(1.0 / (1.0 - P));
    const std::uint64_t key = stream(pass);
    for (std::size_t s = 0; s < n; ++s)
      for (std::size_t i = 0; i < In::size; ++i) {
        const std::size_t at = s * In::size + i;
        // A dropped NaN stays NaN (x * 0, as PyTorch's mask product), so the
        // loss check still sees it.
        out[at] = in[at] * (keep(pass.seed, key, pass.first_sample + s, i) ? scale : T(0));
      }
  }

  template <class T>
  static void forward(const T*, const T* x, T* y, T*, std::size_t n,
                      const LayerContext<T>& context) {
    if (context.pass.training)
      apply(x, y, n, context.pass);
    else
      std::copy_n(x, n * In::size, y);
  }

  template <class T>
  static void backward(const T*, const T*, const T*, const T* dy, T* dx, T*, T*, std::size_t n,
                       bool, const LayerContext<T>& context) {
    if (dx == nullptr) return;
    if (context.pass.training)
      apply(dy, dx, n, context.pass);
    else
      std::copy_n(dy, n * In::size, dx);
  }
};

}  // namespace loom
