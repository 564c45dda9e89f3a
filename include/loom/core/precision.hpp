// Compute precisions. Master weights, gradients and optimizer state stay
// fp32; bf16 and fp16 are what a layer's inputs, weights and outputs are
// rounded to. The CPU backend emulates them by rounding fp32 values to the
// nearest representable one (ties to even, as the hardware converts), so
// every precision's logic, fp16's overflow included, runs and is tested
// without a GPU.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class Precision { fp32, bf16, fp16 };

constexpr std::string_view precision_name(Precision p) {
  return p == Precision::fp32 ? "fp32" : p == Precision::bf16 ? "bf16" : "fp16";
}

// The nearest bfloat16 (8-bit exponent, 7-bit mantissa); NaN stays NaN.
inline float round_to_bf16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::bit_cast<float>(u & 0xffff0000u);
}

// The nearest IEEE half (5-bit exponent, 10-bit mantissa): beyond 65504
// (from 65520, the tie that rounds up to 2^16) it is infinite, below 2^-14
// its subnormals are steps of 2^-24.
inline float round_to_fp16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = u & 0x80000000u;
  std::uint32_t a = u ^ sign;
  if (a >= 0x7f800000u) return x;  // infinite or NaN
  if (a < 0x38800000u) {
    // 0.5 has a float step of 2^-24: the addition rounds to it, ties to even.
    const float r = (std::bit_cast<float>(a) + 0.5f) - 0.5f;
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(r) | sign);
  }
  a += 0xfffu + ((a >> 13) & 1u);
  a &= ~0x1fffu;
  if (a >= 0x47800000u) a = 0x7f800000u;
  return std::bit_cast<float>(a | sign);
}

inline void round_to(Precision p, float* values, std::size_t n) {
  if (p == Precision::bf16)
    for (std::size_t i = 0; i < n; ++i) values[i] = round_to_bf16(values[i]);
  else if (p == Precision::fp16)
    for (std::size_t i = 0; i < n; ++i) values[i] = round_to_fp16(values[i]);
}

// Doubles (gradient checks) are never rounded: the precisions are float's.
inline void round_to(Precision, double*, std::size_t) {}

// fp16's dynamic loss scaling (optim/loss_scaler.hpp): its options, a type
// of core because the trainer's options and the scaler take it.
struct LossScaling {
  float initial_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::size_t growth_interval = 2000;
  // 1: an overflow at scale 1 is a gradient beyond fp16's largest value
  // (65504) itself, a run diverging rather than small gradients to keep; a
  // smaller scale would only hide it.
  float min_scale = 1.0f;
  // 2^24: 64 times the scale LeNet's fp16 run ends at (2^18, README), yet a
  // run whose gradients never overflow (all zero, a frozen network) cannot
  // grow it to infinity, where scaled zeros become NaN and every step is
  // skipped.
  float max_scale = 0x1p24f;
};

}  // namespace loom
