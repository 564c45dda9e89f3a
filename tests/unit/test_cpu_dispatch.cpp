// LOOM_CPU_KERNEL's clones compute the baseline's bits. This file is
// compiled at -O3, as the examples and benchmarks are (the other test
// programs at -O1, where g++ does not vectorise), and built in the main
// build as well as the sanitizers' (which run the baseline alone): there
// g++ clones each kernel for AVX2, which this CPU runs if it has it. An
// AVX-512 clone fails this test (its fused multiply-adds round
// differently; tried). Each kernel's output is compared bit for bit with the same
// arithmetic one element at a time, through functions g++ may neither
// inline nor vectorise.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/loom.hpp>
#include <string_view>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;

namespace {

#define LOOM_TEST_STRING(...) #__VA_ARGS__
#define LOOM_TEST_EXPANDED(...) LOOM_TEST_STRING(__VA_ARGS__)
// What LOOM_CPU_KERNEL expands to in this file: target_clones where g++ dispatches.
constexpr std::string_view kernel_attribute = LOOM_TEST_EXPANDED(LOOM_CPU_KERNEL);

const char* clone_run() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "default";
}

// Finite floats of every magnitude and sign, and the edges GELU and the
// logistic meet: saturation, 0, NaN.
std::vector<float> inputs() {
  std::vector<float> xs;
  for (std::uint64_t bits = 0; bits < (1ull << 32); bits += 65537) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    if (std::isfinite(x)) xs.push_back(x);
  }
  for (const float x : {0.0f, -0.0f, 4.0f, -4.0f, 9.5f, -9.5f, 88.0f, -88.0f,
                        std::numeric_limits<float>::quiet_NaN()})
    xs.push_back(x);
  return xs;
}

std::size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    count += std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]);
  return count;
}

template <class Fn>
[[gnu::noinline]] float forward_one(float x) {
  return Fn::forward(x);
}
template <class Fn>
[[gnu::noinline]] float backward_one(float x, float y, float dy) {
  return Fn::backward(x, y, dy);
}

template <class Spec, class Fn>
void check_pointwise(const std::vector<float>& xs) {
  using Layer = detail::PointwiseLayer<Spec, Fn, Shape<1>, 0>;
  const auto dy = random_vector<float>(xs.size(), 5, -2.0, 2.0);
  std::vector<float> y(xs.size()), dx(xs.size()), y_one(xs.size()), dx_one(xs.size());
  Layer::template forward<float>(nullptr, xs.data(), y.data(), nullptr, xs.size());
  Layer::template backward<float>(nullptr, xs.data(), y.data(), dy.data(), dx.data(), nullptr,
                                  nullptr, xs.size(), false);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    y_one[i] = forward_one<Fn>(xs[i]);
    dx_one[i] = backward_one<Fn>(xs[i], y_one[i], dy[i]);
  }
  INFO(Fn::kind << " over " << xs.size() << " floats");
  CHECK(differing(y, y_one) == 0);
  CHECK(differing(dx, dx_one) == 0);
}

[[gnu::noinline]] void adam_one(float& w, float g, float& m, float& v, const cpu::AdamStep& s) {
  const cpu::AdamScalars k = cpu::adam_scalars(s);
  const auto step_size = static_cast<float>(k.step_size);
  const auto correction2 = static_cast<float>(k.correction2);
  const auto b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2);
  const auto l2 = static_cast<float>(s.decoupled ? 0.0 : s.weight_decay);
  const float grad = g + l2 * w;
  m = b1 * m + static_cast<float>(1.0 - s.beta1) * grad;
  v = b2 * v + static_cast<float>(1.0 - s.beta2) * grad * grad;
  w = w * static_cast<float>(k.decay) -
      step_size * m / (std::sqrt(v) * correction2 + static_cast<float>(s.eps));
}

}  // namespace

TEST_CASE("cpu dispatch: the clone this CPU runs computes the baseline's bits") {
  INFO("LOOM_CPU_KERNEL: " << kernel_attribute << "; this CPU runs the clone " << clone_run());
#if defined(__x86_64__) && defined(__gnu_linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__AVX2__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // Where g++ can dispatch, it does: the kernels below are clones.
  CHECK(kernel_attribute.find("target_clones") != std::string_view::npos);
#endif
  const auto xs = inputs();
  check_pointwise<GELU, detail::GeluFn>(xs);
  check_pointwise<Tanh, detail::TanhFn>(xs);
  check_pointwise<Sigmoid, detail::SigmoidFn>(xs);

  // Adam, with L2 decay (where a fused multiply-add would change the
  // gradient's rounding) and AdamW's.
  for (const bool decoupled : {false, true}) {
    INFO("decoupled " << decoupled);
    const std::size_t n = 4099;
    auto w = random_vector<float>(n, 6, -1.0, 1.0);
    const auto g = random_vector<float>(n, 7, -1e-3, 1e-3);
    auto m = random_vector<float>(n, 8, -1e-3, 1e-3);
    auto v = random_vector<float>(n, 9, 0.0, 1e-6);
    auto w_one = w, m_one = m, v_one = v;
    const cpu::AdamStep step{.lr = 1e-3,
                             .beta1 = 0.9,
                             .beta2 = 0.999,
                             .eps = 1e-8,
                             .weight_decay = 0.1,
                             .decoupled = decoupled,
                             .t = 7};
    cpu::adam_update(w.data(), g.data(), m.data(), v.data(), n, step);
    for (std::size_t i = 0; i < n; ++i) adam_one(w_one[i], g[i], m_one[i], v_one[i], step);
    CHECK(differing(w, w_one) == 0);
    CHECK(differing(m, m_one) == 0);
    CHECK(differing(v, v_one) == 0);
  }
}
