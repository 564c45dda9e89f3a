// Elementwise activations as layers: Tanh, Sigmoid and GELU (the exact,
// erf form, as PyTorch's default). Each is one pass each way; Tanh and
// Sigmoid differentiate through their output, GELU through its input.
#pragma once

#include <cmath>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include "../backend/cpu/transcendental.hpp"
#include "../core/host_device.hpp"
#include "layer.hpp"

namespace loom {

struct Tanh {};
struct Sigmoid {};
struct GELU {};

namespace detail {

// float on the CPU takes cpu::tanh and cpu::sigmoid, which a loop
// vectorises (backend/cpu/transcendental.hpp); double, the gradient checks'
// reference, keeps the standard functions, and so does device code, where
// CUDA's tanhf and expf are already fast.
template <class T>
inline constexpr bool cpu_float_math =
#if defined(__CUDA_ARCH__)
    false;
#else
    std::is_same_v<T, float>;
#endif

struct TanhFn {
  static constexpr std::string_view kind = "tanh";
  template <class T>
  LOOM_HOST_DEVICE static T forward(T x) {
    if constexpr (cpu_float_math<T>)
      return cpu::tanh(x);
    else
      return std::tanh(x);
  }
  template <class T>
  LOOM_HOST_DEVICE static T backward(T, T y, T dy) {
    return dy * (T(1) - y * y);
  }
};

struct SigmoidFn {
  static constexpr std::string_view kind = "sigmoid";
  template <class T>
  LOOM_HOST_DEVICE static T forward(T x) {
    if constexpr (cpu_float_math<T>) {
      return cpu::sigmoid(x);
    } else {
      // exp of a negative argument only, so large |x| neither overflows nor loses the NaN.
      if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
      const T e = std::exp(x);
      return e / (T(1) + e);
    }
  }
  template <class T>
  LOOM_HOST_DEVICE static T backward(T, T y, T dy) {
    return dy * y * (T(1) - y);
  }
};

struct GeluFn {
  static constexpr std::string_view kind = "gelu";
  template <class T>
  LOOM_HOST_DEVICE static T forward(T x) {
    return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
  }
  // d/dx x Phi(x) = Phi(x) + x phi(x).
  template <class T>
  LOOM_HOST_DEVICE static T backward(T x, T, T dy) {
    const T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
    T pdf;
    if constexpr (cpu_float_math<T>)
      pdf = T(0.39894228040143267794) * cpu::exp_nonpositive(T(-0.5) * x * x);
    else
      pdf = T(0.39894228040143267794) * std::exp(T(-0.5) * x * x);
    return dy * (cdf + x * pdf);
  }

 private:
  template <class T>
  LOOM_HOST_DEVICE static T erf(T x) {
    if constexpr (cpu_float_math<T>)
      return cpu::erf(x);
    else
      return std::erf(x);
  }
};

template <class Spec, class Fn, class In, std::size_t Index>
struct PointwiseLayer : LayerBase<Spec, In, In, Index> {
  static constexpr std::size_t forward_flops = 4 * In::size;
  static constexpr std::size_t backward_flops = 4 * In::size;
  static constexpr std::string_view kind = Fn::kind;

  template <class T>
  LOOM_CPU_KERNEL static void forward(const T*, const T* x, T* y, T*, std::size_t n) {
    for (std::size_t i = 0; i < n * In::size; ++i) y[i] = Fn::forward(x[i]);
  }

  template <class T>
  LOOM_CPU_KERNEL static void backward(const T*, const T* x, const T* y, const T* dy, T* dx, T*,
                                       T*, std::size_t n, bool) {
    if (dx == nullptr) return;
    for (std::size_t i = 0; i < n * In::size; ++i) dx[i] = Fn::backward(x[i], y[i], dy[i]);
  }
};

}  // namespace detail

template <class In, std::size_t Index>
struct Bind<Tanh, In, Index> : detail::PointwiseLayer<Tanh, detail::TanhFn, In, Index> {};
template <class In, std::size_t Index>
struct Bind<Sigmoid, In, Index> : detail::PointwiseLayer<Sigmoid, detail::SigmoidFn, In, Index> {};
template <class In, std::size_t Index>
struct Bind<GELU, In, Index> : detail::PointwiseLayer<GELU, detail::GeluFn, In, Index> {};

}  // namespace loom
