// Every layer: forward against the plain-loop reference (in double and in
// float), backward against central finite differences in double, and the
// accumulate flag of backward.
#include <cmath>
#include <limits>
#include <loom/loom.hpp>
#include <vector>

#include "layer_reference.hpp"
#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;
using loom::test::require_close;

namespace {

constexpr std::size_t batch = 3;

template <class L, class T>
struct Run {
  std::vector<T> params, x, y, work;

  Run(const std::vector<double>& p, const std::vector<double>& in)
      : params(p.begin(), p.end()),
        x(in.begin(), in.end()),
        y(batch * L::output_shape::size),
        work(batch * L::workspace + 1) {
    L::template forward<T>(params.data(), x.data(), y.data(), work.data(), batch);
  }
};

template <class L>
std::vector<double> forward_double(const std::vector<double>& p, const std::vector<double>& x) {
  return Run<L, double>(p, x).y;
}

// Forward in double must match the reference to rounding; float to 1e-5.
template <class L>
void check_forward(const std::vector<double>& params, const std::vector<double>& x,
                   const std::vector<double>& expected) {
  require_close(Run<L, double>(params, x).y, expected, {1e-12, 1e-12}, "double forward");
  require_close(Run<L, float>(params, x).y, expected, {1e-5, 1e-5}, "float forward");
}

// L(x, p) = sum(forward(x, p) * r): backward with dy = r gives dL/dx and
// dL/dp, compared with central differences over every element.
template <class L>
void check_gradients(std::uint64_t seed) {
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  auto params = random_vector<double>(L::param_count, seed + 1, -0.5, 0.5);
  auto x = random_vector<double>(batch * in, seed + 2);
  const auto r = random_vector<double>(batch * out, seed + 3);

  Run<L, double> run(params, x);
  std::vector<double> dx(batch * in, -99.0), dparams(L::param_count, -99.0);
  L::template backward<double>(run.params.data(), run.x.data(), run.y.data(), r.data(), dx.data(),
                               dparams.data(), run.work.data(), batch, false);

  auto objective = [&](const std::vector<double>& p, const std::vector<double>& v) {
    const auto y = forward_double<L>(p, v);
    double sum = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  const double eps = 1e-6;
  auto numeric = [&](std::vector<double>& v, bool is_param) {
    std::vector<double> grad(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + eps;
      const double up = is_param ? objective(v, x) : objective(params, v);
      v[i] = keep - eps;
      const double down = is_param ? objective(v, x) : objective(params, v);
      v[i] = keep;
      grad[i] = (up - down) / (2 * eps);
    }
    return grad;
  };
  require_close(dx, numeric(x, false), {1e-7, 1e-6}, "dL/dx");
  if constexpr (L::param_count > 0) {
    require_close(dparams, numeric(params, true), {1e-7, 1e-6}, "dL/dparams");

    // accumulate = true adds to what is there instead of overwriting it.
    std::vector<double> accumulated(L::param_count, 0.25);
    L::template backward<double>(run.params.data(), run.x.data(), run.y.data(), r.data(), nullptr,
                                 accumulated.data(), run.work.data(), batch, true);
    for (auto& g : dparams) g += 0.25;
    require_close(accumulated, dparams, {1e-12, 1e-12}, "accumulated gradient");
  }
}

template <class L>
std::vector<double> conv_expected(const test::ConvDims& d, const std::vector<double>& params,
                                  const std::vector<double>& x) {
  const std::size_t weights = d.out * d.c * d.k * d.k;
  return test::conv_reference(d, x, {params.begin(), params.begin() + static_cast<long>(weights)},
                              {params.begin() + static_cast<long>(weights), params.end()});
}

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t C,
          std::size_t H, std::size_t W>
void check_conv(std::uint64_t seed) {
  using Plain = Bind<Conv2d<Out, K, S, P>, Shape<C, H, W>, 1>;
  using WithRelu = Bind<Fused<Conv2d<Out, K, S, P>, ReLU>, Shape<C, H, W>, 1>;
  const test::ConvDims d{batch, C, H, W, Out, K, S, P};
  REQUIRE(Plain::output_shape::dims[1] == d.oh());
  REQUIRE(Plain::output_shape::dims[2] == d.ow());
  const auto params = random_vector<double>(Plain::param_count, seed, -0.5, 0.5);
  const auto x = random_vector<double>(batch * C * H * W, seed + 9);
  const auto expected = conv_expected<Plain>(d, params, x);
  check_forward<Plain>(params, x, expected);
  check_forward<WithRelu>(params, x, test::relu_reference(expected));
  check_gradients<Plain>(seed);
  check_gradients<WithRelu>(seed);
}

}  // namespace

TEST_CASE(
    "layers: Conv2d forward matches direct convolution, backward matches finite differences") {
  SECTION("3x3, stride 1, no padding") { check_conv<4, 3, 1, 0, 2, 7, 6>(10); }
  SECTION("5x5 as in LeNet") { check_conv<3, 5, 1, 0, 1, 9, 9>(20); }
  SECTION("3x3, stride 2, padding 1") { check_conv<3, 3, 2, 1, 3, 7, 8>(30); }
  SECTION("1x1") { check_conv<5, 1, 1, 0, 4, 3, 3>(40); }
  SECTION("2x2, stride 3, padding 2 (windows that skip pixels)") {
    check_conv<2, 2, 3, 2, 2, 6, 5>(50);
  }
}

TEST_CASE("layers: Linear forward matches the plain product, backward matches finite differences") {
  using Plain = Bind<Linear<7>, Shape<11>, 1>;
  using WithRelu = Bind<Fused<Linear<7>, ReLU>, Shape<11>, 1>;
  const auto params = random_vector<double>(Plain::param_count, 60, -0.5, 0.5);
  const auto x = random_vector<double>(batch * 11, 61);
  const auto expected = test::linear_reference(
      batch, 11, 7, x, {params.begin(), params.begin() + 77}, {params.begin() + 77, params.end()});
  check_forward<Plain>(params, x, expected);
  check_forward<WithRelu>(params, x, test::relu_reference(expected));
  check_gradients<Plain>(62);
  check_gradients<WithRelu>(63);
}

TEST_CASE("layers: Linear over Positions x Features acts per position, each row a sample's") {
  // 4 positions of 11 features: the plain product of every (sample,
  // position) row, as PyTorch's Linear over the last dimension.
  using Plain = Bind<Linear<7>, Shape<4, 11>, 1>;
  using WithRelu = Bind<Fused<Linear<7>, ReLU>, Shape<4, 11>, 1>;
  STATIC_REQUIRE(Plain::output_shape::rank == 2);
  STATIC_REQUIRE(Plain::output_shape::dims[0] == 4);
  STATIC_REQUIRE(Plain::output_shape::dims[1] == 7);
  STATIC_REQUIRE(Plain::param_count == 7 * 11 + 7);
  STATIC_REQUIRE(Plain::forward_flops == 4 * Bind<Linear<7>, Shape<11>, 1>::forward_flops);
  const auto params = random_vector<double>(Plain::param_count, 64, -0.5, 0.5);
  const auto x = random_vector<double>(batch * 4 * 11, 65);
  const auto expected =
      test::linear_reference(batch * 4, 11, 7, x, {params.begin(), params.begin() + 77},
                             {params.begin() + 77, params.end()});
  check_forward<Plain>(params, x, expected);
  check_forward<WithRelu>(params, x, test::relu_reference(expected));
  check_gradients<Plain>(66);
  check_gradients<WithRelu>(67);
}

TEST_CASE("layers: MaxPool2d and AvgPool2d") {
  SECTION("2x2 windows, stride 2") {
    using Max = Bind<MaxPool2d<2>, Shape<3, 6, 5>, 1>;
    using Avg = Bind<AvgPool2d<2>, Shape<3, 6, 5>, 1>;
    STATIC_REQUIRE(std::is_same_v<Max::output_shape, Shape<3, 3, 2>>);
    const auto x = random_vector<double>(batch * 90, 70);
    check_forward<Max>({}, x, test::pool_reference(true, batch * 3, 6, 5, 2, 2, x));
    check_forward<Avg>({}, x, test::pool_reference(false, batch * 3, 6, 5, 2, 2, x));
    check_gradients<Max>(71);
    check_gradients<Avg>(72);
  }
  SECTION("overlapping 3x3 windows, stride 2") {
    using Max = Bind<MaxPool2d<3, 2>, Shape<2, 7, 7>, 1>;
    using Avg = Bind<AvgPool2d<3, 2>, Shape<2, 7, 7>, 1>;
    STATIC_REQUIRE(std::is_same_v<Max::output_shape, Shape<2, 3, 3>>);
    const auto x = random_vector<double>(batch * 98, 73);
    check_forward<Max>({}, x, test::pool_reference(true, batch * 2, 7, 7, 3, 2, x));
    check_forward<Avg>({}, x, test::pool_reference(false, batch * 2, 7, 7, 3, 2, x));
    check_gradients<Max>(74);
    check_gradients<Avg>(75);
  }
}

TEST_CASE("layers: ReLU") {
  using L = Bind<ReLU, Shape<4, 5>, 1>;
  const auto x = random_vector<double>(batch * 20, 80);
  check_forward<L>({}, x, test::relu_reference(x));
  check_gradients<L>(81);
}

TEST_CASE("layers: Flatten aliases its input and reshapes the type") {
  using L = Bind<Flatten, Shape<2, 3, 4>, 1>;
  STATIC_REQUIRE(std::is_same_v<L::output_shape, Shape<24>>);
  STATIC_REQUIRE(L::in_place);
  STATIC_REQUIRE(L::param_count == 0);
}

TEST_CASE("layers: the first layer's backward skips the input gradient") {
  using L = Bind<Conv2d<2, 3>, Shape<1, 5, 5>, 1>;
  const auto params = random_vector<double>(L::param_count, 90);
  const auto x = random_vector<double>(batch * 25, 91);
  const auto r = random_vector<double>(batch * L::output_shape::size, 92);
  Run<L, double> run(params, x);
  std::vector<double> with_dx(L::param_count), without_dx(L::param_count), dx(batch * 25);
  L::backward<double>(run.params.data(), run.x.data(), run.y.data(), r.data(), dx.data(),
                      with_dx.data(), run.work.data(), batch, false);
  L::backward<double>(run.params.data(), run.x.data(), run.y.data(), r.data(), nullptr,
                      without_dx.data(), run.work.data(), batch, false);
  test::require_equal(without_dx, with_dx, "parameter gradients");
}

TEST_CASE("layers: Conv2d over more samples than one chunk equals sample-by-sample runs") {
  // 150 samples: two full chunks of 64 and a partial one.
  constexpr std::size_t n = 2 * cpu::conv_chunk + 22;
  using L = Bind<Fused<Conv2d<4, 3, 1, 1>, ReLU>, Shape<2, 6, 5>, 1>;
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  const auto params = random_vector<double>(L::param_count, 100, -0.5, 0.5);
  const auto x = random_vector<double>(n * in, 101);
  const auto dy = random_vector<double>(n * out, 102);
  std::vector<double> y(n * out), dx(n * in), dparams(L::param_count), work(n * L::workspace);
  L::forward<double>(params.data(), x.data(), y.data(), work.data(), n);
  L::backward<double>(params.data(), x.data(), y.data(), dy.data(), dx.data(), dparams.data(),
                      work.data(), n, false);

  std::vector<double> y1(out), dx1(in), dp1(L::param_count), dparams_sum(L::param_count, 0.0);
  for (std::size_t s = 0; s < n; ++s) {
    L::forward<double>(params.data(), x.data() + s * in, y1.data(), work.data(), 1);
    L::backward<double>(params.data(), x.data() + s * in, y1.data(), dy.data() + s * out,
                        dx1.data(), dp1.data(), work.data(), 1, false);
    test::require_close(std::vector<double>(y.begin() + static_cast<long>(s * out),
                                            y.begin() + static_cast<long>((s + 1) * out)),
                        y1, {1e-13, 1e-12}, "output of sample " + std::to_string(s));
    test::require_close(std::vector<double>(dx.begin() + static_cast<long>(s * in),
                                            dx.begin() + static_cast<long>((s + 1) * in)),
                        dx1, {1e-13, 1e-12}, "input gradient of sample " + std::to_string(s));
    for (std::size_t i = 0; i < dp1.size(); ++i) dparams_sum[i] += dp1[i];
  }
  test::require_close(dparams, dparams_sum, {1e-12, 1e-12},
                      "parameter gradient summed over chunks");
}

TEST_CASE("layers: a NaN input reaches the output of MaxPool2d and ReLU") {
  // NaN in the last position of its window: a plain `v > max` would drop it.
  using Pool = Bind<MaxPool2d<2>, Shape<1, 2, 2>, 1>;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x{1.0f, 2.0f, 3.0f, nan};
  float y = 0.0f;
  Pool::forward<float>(nullptr, x.data(), &y, nullptr, 1);
  REQUIRE(std::isnan(y));
  using Relu = Bind<ReLU, Shape<2>, 1>;
  const std::vector<float> r{nan, -1.0f};
  std::vector<float> out(2);
  Relu::forward<float>(nullptr, r.data(), out.data(), nullptr, 1);
  REQUIRE(std::isnan(out[0]));
  REQUIRE(out[1] == 0.0f);
}
