// Sums and maxima of a row in a fixed order the compiler vectorises. One
// running sum is a chain of dependent adds, 4 cycles each, that no compiler
// may reorder (the float result would change); Lanes running sums, term c
// into sum c % Lanes, added pairwise at the end, are independent chains a
// vector holds, in an order that does not depend on the vector width. The
// callers take 16 lanes of float and 8 of double: two AVX2 registers'
// worth, so that two vector chains are in flight. Single running sums left
// a GPT's norms and attention softmax at about a tenth of its CPU training
// step (benchmarks/RESULTS.md, 2026-12-06, seventh).
#pragma once

#include <algorithm>
#include <cstddef>

namespace loom::cpu {

// term(0) + ... + term(n - 1), each term(c) an Acc, as Lanes running sums.
template <std::size_t Lanes, class Acc, class Term>
inline Acc lane_sum(std::size_t n, Term&& term) {
  static_assert(Lanes > 0 && (Lanes & (Lanes - 1)) == 0, "lane_sum: Lanes is a power of 2");
  Acc part[Lanes] = {};
  const std::size_t whole = n / Lanes * Lanes;
  for (std::size_t c = 0; c < whole; c += Lanes)
    for (std::size_t j = 0; j < Lanes; ++j) part[j] += term(c + j);
  for (std::size_t c = whole; c < n; ++c) part[c - whole] += term(c);
  for (std::size_t width = Lanes / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) part[j] += part[j + width];
  return part[0];
}

// The largest of x[0..n), n >= 1 (a NaN after the first element is passed
// over, as std::max passes it). A maximum is exact, so any order gives the
// same value; Lanes of them only let the compiler take vector maxima.
template <std::size_t Lanes, class T>
inline T lane_max(const T* x, std::size_t n) {
  static_assert(Lanes > 0 && (Lanes & (Lanes - 1)) == 0, "lane_max: Lanes is a power of 2");
  T part[Lanes];
  for (std::size_t j = 0; j < Lanes; ++j) part[j] = x[0];
  const std::size_t whole = n / Lanes * Lanes;
  for (std::size_t c = 0; c < whole; c += Lanes)
    for (std::size_t j = 0; j < Lanes; ++j) part[j] = std::max(part[j], x[c + j]);
  for (std::size_t c = whole; c < n; ++c) part[c - whole] = std::max(part[c - whole], x[c]);
  for (std::size_t width = Lanes / 2; width > 0; width /= 2)
    for (std::size_t j = 0; j < width; ++j) part[j] = std::max(part[j], part[j + width]);
  return part[0];
}

}  // namespace loom::cpu
