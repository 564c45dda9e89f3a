// The helper every loom test includes: Catch2, seeded random inputs and the
// one tolerance rule (|got - ref| <= abs + rel * |ref|) used across the suite.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <loom/core/rng.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace loom::test {

// Uniform values in [lo, hi), a pure function of (seed, index).
template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(lo + (hi - lo) * uniform01(seed, 0x7E57, i));
  return v;
}

struct Tolerance {
  double abs = 0.0;
  double rel = 0.0;
};

// Compares element-wise and reports the first offending index, so a failure
// says where, not just that.
template <class A, class B>
void require_close(const A& got, const B& ref, Tolerance tol, const std::string& what = "") {
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    const double r = static_cast<double>(ref[i]);
    if (!(std::abs(g - r) <= tol.abs + tol.rel * std::abs(r))) {
      std::ostringstream msg;
      msg << what << " differs at index " << i << ": got " << g << ", expected " << r << " (abs "
          << tol.abs << ", rel " << tol.rel << ")";
      FAIL(msg.str());
    }
  }
  SUCCEED();
}

template <class A, class B>
void require_equal(const A& got, const B& ref, const std::string& what = "") {
  require_close(got, ref, Tolerance{0.0, 0.0}, what);
}

// d f / d v[i] for every i by central differences of step h, f taking
// the whole vector (the gradient checks' reference, in double).
template <class F>
std::vector<double> central_differences(std::vector<double> v, F&& f, double h = 1e-6) {
  std::vector<double> grad(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + h;
    const double up = f(v);
    v[i] = keep - h;
    const double down = f(v);
    v[i] = keep;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

}  // namespace loom::test
