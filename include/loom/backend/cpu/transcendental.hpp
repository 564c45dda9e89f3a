// exp, tanh, the logistic sigmoid and erf in float for the CPU, written so that
// the compiler vectorises a loop of them: glibc's expf/tanhf are calls, one
// value at a time, and took a third of the GRU training step (perf, batch
// 128). No branch, no table, no float-to-int conversion: range reduction by
// Cody-Waite and the 1.5 * 2^23 rounding trick, polynomials fitted for
// minimax relative error, selects instead of ifs. The arithmetic is IEEE
// +, -, *, / (fused into FMAs alike in both where the target has them and
// contraction is on), so a vector lane and the scalar tail compute the same
// bits.
//
// Accuracy, over every finite float against double std::exp/std::tanh
// (measured when this was written, without FMA): tanh within 1.52 ulp,
// sigmoid within 2.40, exp of a non-positive argument within 0.99;
// tests/unit checks the bounds on a sweep. NaN passes through; results
// below FLT_MIN (e^x for x < ln FLT_MIN = -87.3365) flush to zero.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace loom::cpu {

// c ? a : b through a bit mask. A float ?: whose arms compute is a branch to
// g++ (an arm may raise a floating-point exception, so it is not run
// speculatively), and a branch stops the loop's vectorisation.
inline float select(bool c, float a, float b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<std::uint32_t>(a) & mask) |
                              (std::bit_cast<std::uint32_t>(b) & ~mask));
}

// e^x for x <= 0 (x = -inf gives 0).
inline float exp_nonpositive(float x) {
  constexpr float log2e = 1.44269504089f;
  // ln 2 in two parts: k * ln2_hi is exact for |k| < 2^15.
  constexpr float ln2_hi = 0.693359375f;
  constexpr float ln2_lo = -2.12194440e-4f;
  // Adding 1.5 * 2^23 rounds to an integer, held in the low mantissa bits.
  constexpr float round_magic = 12582912.0f;
  constexpr std::uint32_t magic_bits = 0x4B400000u;
  // ln FLT_MIN rounded up: below it e^x is no normal float, and 2^k's bits
  // below need k >= -126. Clamped, then flushed to zero.
  constexpr float lowest = -87.33654022f;

  const float xc = select(x < lowest, lowest, x);
  const float shifted = xc * log2e + round_magic;
  const float k = shifted - round_magic;
  const float r = (xc - k * ln2_hi) - k * ln2_lo;  // |r| <= ln(2)/2
  // e^r = 1 + r + r^2 P(r): P fitted on [-ln2/2, ln2/2], relative error 3e-9.
  float p = 1.38146188e-3f;
  p = p * r + 8.36870988e-3f;
  p = p * r + 4.16683873e-2f;
  p = p * r + 1.66665207e-1f;
  p = p * r + 4.99999935e-1f;
  const float er = (p * r) * r + r + 1.0f;
  // 2^k from k's bits (unsigned arithmetic: defined for NaN's garbage too).
  const std::uint32_t k_bits = std::bit_cast<std::uint32_t>(shifted) - magic_bits;
  const float scale = std::bit_cast<float>((k_bits + 127u) << 23);
  const float e = er * scale;
  return select(x < lowest, 0.0f, e);
}

// 1 / (1 + e^-x), from e^-|x| (which never overflows).
inline float sigmoid(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float d = 1.0f + e;
  return select(x >= 0.0f, 1.0f, e) / d;
}

inline float tanh(float x) {
  const float a = std::fabs(x);
  // Small |x|: x + x^3 Q(x^2), Q fitted on [0, 0.625^2] (relative error of
  // tanh 4e-9); there 1 - 2/(e^2x + 1) would cancel.
  const float s = a * a;
  float q = -5.70497837e-3f;
  q = q * s + 2.06390787e-2f;
  q = q * s - 5.37397122e-2f;
  q = q * s + 1.33314422e-1f;
  q = q * s - 3.33332819e-1f;
  const float small = (q * s) * a + a;
  // Otherwise (1 - e^-2a) / (1 + e^-2a): an error in e grows by at most 0.63 there.
  const float e = exp_nonpositive(-2.0f * a);
  const float large = (1.0f - e) / (1.0f + e);
  const float t = select(a < 0.625f, small, large);
  return std::copysign(t, x);
}

// erf(x) as x P(x^2) / Q(x^2) on [-4, 4] (beyond, erf is +-1 in float), the
// rational approximation Eigen and XLA use for float: GELU's, which glibc's
// erff (a call per value) left at a tenth of a GPT's training step.
// Within 7.85 ulp of double erf over every finite float (the worst at
// |x| = 3.27, where erf is 0.99999 and an ulp is 6e-8), 4.7e-7 absolutely.
inline float erf(float x) {
  const float xc = select(x > 4.0f, 4.0f, select(x < -4.0f, -4.0f, x));
  const float s = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * s + 2.77068142495902e-08f;
  p = p * s - 2.10102402082508e-06f;
  p = p * s - 5.69250639462346e-05f;
  p = p * s - 7.34990630326855e-04f;
  p = p * s - 2.95459980854025e-03f;
  p = p * s - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * s - 2.13374055278905e-04f;
  q = q * s - 1.68282697438203e-03f;
  q = q * s - 7.37332916720468e-03f;
  q = q * s - 1.42647390514189e-02f;
  return xc * p / q;
}

}  // namespace loom::cpu
