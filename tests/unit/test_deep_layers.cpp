// The layers ResNets and sequence models need: Tanh, Sigmoid, GELU,
// BatchNorm, GlobalAvgPool, Dropout, Reshape, Residual and the other blocks
// (Series, a named Block, nested blocks), GRU and LSTM. Each
// is checked inside a Model in double: backward against central finite
// differences of every parameter and input, forward against values or a
// plain-loop reference written here.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;
using loom::test::require_close;

namespace {

constexpr Pass training{.training = true, .seed = 7, .step = 3};

// L(x, p) = sum(forward(x, p) * r) in double. backward with dy = r gives
// dL/dp and dL/dx; both must match central differences to 1e-6.
template <class Net>
void check_gradients(std::size_t batch, std::uint64_t seed, const Pass& pass = training) {
  Model<Net, double> model(seed, batch);
  auto params = model.parameters();
  const auto randomized = random_vector<double>(params.size(), seed + 1, -0.5, 0.5);
  // Random parameters rather than the initial ones, so that BatchNorm's
  // gamma and beta are not 1 and 0 and biases are not zero.
  for (std::size_t i = 0; i < params.size(); ++i) params[i] += randomized[i];
  auto x = random_vector<double>(batch * Model<Net, double>::input_size, seed + 2);
  const auto r = random_vector<double>(batch * Model<Net, double>::output_size, seed + 3);

  auto objective = [&] {
    const double* y = model.forward(x.data(), batch, 0, pass);
    double sum = 0;
    for (std::size_t i = 0; i < r.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  objective();
  std::copy(r.begin(), r.end(), model.output_gradient());
  std::vector<double> dx(x.size(), -99.0);
  model.backward(0, false, dx.data());
  const std::vector<double> dparams(model.gradients().begin(), model.gradients().end());

  constexpr double h = 1e-6;
  auto numeric = [&](double& v) {
    const double keep = v;
    v = keep + h;
    const double up = objective();
    v = keep - h;
    const double down = objective();
    v = keep;
    return (up - down) / (2 * h);
  };
  std::vector<double> fd_params(params.size()), fd_x(x.size());
  for (std::size_t i = 0; i < params.size(); ++i) fd_params[i] = numeric(params[i]);
  for (std::size_t i = 0; i < x.size(); ++i) fd_x[i] = numeric(x[i]);
  require_close(dparams, fd_params, {1e-6, 1e-5}, "parameter gradient");
  require_close(dx, fd_x, {1e-6, 1e-5}, "input gradient");
}

template <class Net>
std::vector<double> run(Model<Net, double>& model, const std::vector<double>& x, std::size_t batch,
                        const Pass& pass = training) {
  const double* y = model.forward(x.data(), batch, 0, pass);
  return {y, y + batch * Model<Net, double>::output_size};
}

double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }

}  // namespace

TEST_CASE("deep layers: Tanh, Sigmoid and GELU values and gradients") {
  using Acts = Sequential<Input<6>, Linear<5>, Tanh, Linear<4>, Sigmoid, Linear<3>, GELU>;
  check_gradients<Acts>(3, 11);

  Model<Sequential<Input<5>, GELU>, double> gelu;
  const std::vector<double> x{-3.0, -1.0, 0.0, 1.0, 2.5};
  const auto y = run(gelu, x, 1);
  require_close(y,
                std::vector<double>{-0.00404969409489, -0.158655253931457, 0.0, 0.841344746068543,
                                    2.48447583668556},
                {1e-12, 1e-10}, "GELU");
  // float's GELU (cpu::erf, cpu::exp_nonpositive) against double's, both ways.
  Model<Sequential<Input<64>, GELU>, float> gelu32(0, 2);
  Model<Sequential<Input<64>, GELU>, double> gelu64(0, 2);
  const auto wide = random_vector<double>(128, 19, -6.0, 6.0);
  const std::vector<float> wide32(wide.begin(), wide.end());
  const std::vector<double> rounded(wide32.begin(), wide32.end());
  const float* y32 = gelu32.forward(wide32.data(), 2, 0, training);
  require_close(std::vector<double>(y32, y32 + 128), run(gelu64, rounded, 2), {1e-6, 1e-6},
                "float GELU");
  const auto dy = random_vector<double>(128, 20);
  std::copy(dy.begin(), dy.end(), gelu32.output_gradient());
  std::copy(dy.begin(), dy.end(), gelu64.output_gradient());
  std::vector<float> dx32(128);
  std::vector<double> dx64(128);
  gelu32.backward(0, false, dx32.data());
  gelu64.backward(0, false, dx64.data());
  require_close(std::vector<double>(dx32.begin(), dx32.end()), dx64, {1e-6, 1e-6},
                "float GELU gradient");
  Model<Sequential<Input<4>, Sigmoid>, float> sig;
  const std::vector<float> extremes{-800.0f, 800.0f, 0.0f, std::numeric_limits<float>::quiet_NaN()};
  const float* s = sig.forward(extremes.data(), 1);
  CHECK(s[0] == 0.0f);
  CHECK(s[1] == 1.0f);
  CHECK(s[2] == 0.5f);
  CHECK(std::isnan(s[3]));
}

namespace {

// ln FLT_MIN rounded up: below it the functions flush e^x to zero.
constexpr float exp_lowest = -87.33654022f;

// |got - exact| in units of the last place at exact: the gap between the
// float at or below |exact| and the next one up.
double ulps(float got, double exact) {
  float below = static_cast<float>(std::fabs(exact));
  if (below > std::fabs(exact)) below = std::nextafter(below, 0.0f);
  const double ulp = std::nextafter(below, std::numeric_limits<float>::infinity()) - below;
  return std::fabs(static_cast<double>(got) - exact) / ulp;
}

// Finite floats: every 4099th bit pattern, plus every float near the
// places where the functions change method (|x| = 0.625 in tanh, the
// exponent's clamp at ln FLT_MIN) and near 0.
std::vector<float> sweep() {
  std::vector<float> xs;
  for (std::uint64_t bits = 0; bits < (1ull << 32); bits += 4099) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    if (std::isfinite(x)) xs.push_back(x);
  }
  for (const float centre : {0.625f, -0.625f, exp_lowest, -43.5f, 0.0f, 1e-30f}) {
    float x = centre;
    for (int i = 0; i < 20000; ++i) x = std::nextafter(x, -std::numeric_limits<float>::infinity());
    for (int i = 0; i < 40000; ++i, x = std::nextafter(x, std::numeric_limits<float>::infinity()))
      xs.push_back(x);
  }
  return xs;
}

// One call at a time, which no loop can vectorise.
[[gnu::noinline]] float tanh_alone(float x) { return cpu::tanh(x); }
[[gnu::noinline]] float sigmoid_alone(float x) { return cpu::sigmoid(x); }

}  // namespace

TEST_CASE("deep layers: the CPU's float tanh, sigmoid and exp keep their ulp bounds, pass NaN and saturate") {
  const auto xs = sweep();
  double tanh_worst = 0, sigmoid_worst = 0, exp_worst = 0;
  for (const float x : xs) {
    tanh_worst = std::max(tanh_worst, ulps(cpu::tanh(x), std::tanh(static_cast<double>(x))));
    // Below ln FLT_MIN sigmoid and exp flush what would be subnormal to zero.
    if (x >= exp_lowest) {
      sigmoid_worst = std::max(sigmoid_worst,
                               ulps(cpu::sigmoid(x), 1 / (1 + std::exp(-static_cast<double>(x)))));
    }
    if (x <= 0.0f && x >= exp_lowest)
      exp_worst = std::max(exp_worst, ulps(cpu::exp_nonpositive(x), std::exp(static_cast<double>(x))));
  }
  INFO("worst: tanh " << tanh_worst << ", sigmoid " << sigmoid_worst << ", exp " << exp_worst
                      << " ulp over " << xs.size() << " floats");
  // Exhaustively over every finite float: 1.52, 2.40 and 0.99 ulp.
  CHECK(tanh_worst <= 2.0);
  CHECK(sigmoid_worst <= 2.5);
  CHECK(exp_worst <= 1.0);

  constexpr float inf = std::numeric_limits<float>::infinity();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(cpu::tanh(nan)));
  CHECK(std::isnan(cpu::sigmoid(nan)));
  CHECK(std::isnan(cpu::exp_nonpositive(nan)));
  CHECK(cpu::tanh(inf) == 1.0f);
  CHECK(cpu::tanh(-inf) == -1.0f);
  CHECK(cpu::tanh(20.0f) == 1.0f);
  CHECK(std::signbit(cpu::tanh(-0.0f)));
  CHECK(cpu::tanh(-0.0f) == 0.0f);
  CHECK(cpu::sigmoid(inf) == 1.0f);
  CHECK(cpu::sigmoid(-inf) == 0.0f);
  CHECK(cpu::sigmoid(-100.0f) == 0.0f);
  CHECK(cpu::sigmoid(0.0f) == 0.5f);
  CHECK(cpu::exp_nonpositive(0.0f) == 1.0f);
  CHECK(cpu::exp_nonpositive(-inf) == 0.0f);
  CHECK(cpu::exp_nonpositive(-88.0f) == 0.0f);

  // A vectorised loop (the layers' and the cells') gives the bits that one
  // call at a time gives, so where a value falls in a vector changes nothing.
  // (g++ vectorises these loops in the Release build; at -O1, as in the
  // sanitizer builds, they stay scalar and this holds trivially.)
  std::vector<float> tanh_loop(xs.size()), sigmoid_loop(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) tanh_loop[i] = cpu::tanh(xs[i]);
  for (std::size_t i = 0; i < xs.size(); ++i) sigmoid_loop[i] = cpu::sigmoid(xs[i]);
  std::size_t differing = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    differing += std::bit_cast<std::uint32_t>(tanh_loop[i]) !=
                 std::bit_cast<std::uint32_t>(tanh_alone(xs[i]));
    differing += std::bit_cast<std::uint32_t>(sigmoid_loop[i]) !=
                 std::bit_cast<std::uint32_t>(sigmoid_alone(xs[i]));
  }
  CHECK(differing == 0);
}

namespace {
[[gnu::noinline]] float erf_alone(float x) { return cpu::erf(x); }
}  // namespace

TEST_CASE("deep layers: the CPU's float erf (GELU's) keeps its bounds, saturates and passes NaN") {
  auto xs = sweep();
  for (const float centre : {4.0f, -4.0f, 3.2f}) {  // the clamp, and the worst region
    float x = centre;
    for (int i = 0; i < 20000; ++i, x = std::nextafter(x, 0.0f)) xs.push_back(x);
  }
  double worst = 0, worst_abs = 0;
  for (const float x : xs) {
    const double exact = std::erf(static_cast<double>(x));
    // Where erf is subnormal an ulp is no measure; the absolute bound holds there.
    if (std::fabs(x) > 1e-37f) worst = std::max(worst, ulps(cpu::erf(x), exact));
    worst_abs = std::max(worst_abs, std::fabs(static_cast<double>(cpu::erf(x)) - exact));
  }
  INFO("worst: " << worst << " ulp, " << worst_abs << " absolutely, over " << xs.size()
                 << " floats");
  // Exhaustively over every finite float: 7.85 ulp (at 3.27), 4.68e-7.
  CHECK(worst <= 8.0);
  CHECK(worst_abs <= 5e-7);
  constexpr float inf = std::numeric_limits<float>::infinity();
  CHECK(std::isnan(cpu::erf(std::numeric_limits<float>::quiet_NaN())));
  CHECK(cpu::erf(inf) == 1.0f);
  CHECK(cpu::erf(-inf) == -1.0f);
  CHECK(cpu::erf(10.0f) == 1.0f);
  CHECK(std::signbit(cpu::erf(-0.0f)));
  CHECK(cpu::erf(0.0f) == 0.0f);
  std::vector<float> loop(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) loop[i] = cpu::erf(xs[i]);
  std::size_t differing = 0;
  for (std::size_t i = 0; i < xs.size(); ++i)
    differing += std::bit_cast<std::uint32_t>(loop[i]) != std::bit_cast<std::uint32_t>(erf_alone(xs[i]));
  CHECK(differing == 0);
}

TEST_CASE("deep layers: the float GELU layer keeps erf's bounds over every float it runs on") {
  // Through the layer's loop, vectorised, not the scalar function (whose
  // bounds the erf test checks); LOOM_CPU_KERNEL's clones compute these
  // bits too (test_cpu_dispatch.cpp).
  using Gelu = detail::PointwiseLayer<GELU, detail::GeluFn, Shape<1>, 0>;
  const auto xs = sweep();
  std::vector<float> y(xs.size()), dx(xs.size());
  const std::vector<float> ones(xs.size(), 1.0f);
  Gelu::forward<float>(nullptr, xs.data(), y.data(), nullptr, xs.size());
  Gelu::backward<float>(nullptr, xs.data(), y.data(), ones.data(), dx.data(), nullptr, nullptr,
                        xs.size(), false);
  double worst = 0, worst_gradient = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double x = xs[i];
    const double cdf = 0.5 * (1.0 + std::erf(x / std::sqrt(2.0)));
    // The value's error relative to |x| (erf's 4.7e-7 at most, halved;
    // where GELU(x) is subnormal, rounding's), its derivative's absolutely.
    if (std::fabs(x) > 1e-37) worst = std::max(worst, std::fabs(y[i] - x * cdf) / std::fabs(x));
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * 3.14159265358979323846);
    worst_gradient = std::max(worst_gradient, std::fabs(dx[i] - (cdf + x * pdf)));
  }
  INFO("worst: " << worst << " of |x|, gradient " << worst_gradient << ", over " << xs.size()
                 << " floats");
  CHECK(worst <= 3e-7);
  CHECK(worst_gradient <= 3e-7);
}

TEST_CASE("deep layers: the CPU's lane sums keep their fixed order, lane maxima the maximum") {
  const auto values = random_vector<double>(80, 41, -10.0, 10.0);
  const std::vector<float> x(values.begin(), values.end());
  for (std::size_t n = 0; n <= x.size(); ++n) {
    INFO("n = " << n);
    // The order lane_sum promises: term c into sum c % 16, then halves added pairwise.
    float part[16] = {};
    for (std::size_t c = 0; c < n; ++c) part[c % 16] += x[c];
    for (std::size_t width = 8; width > 0; width /= 2)
      for (std::size_t j = 0; j < width; ++j) part[j] += part[j + width];
    const float sum = cpu::lane_sum<16, float>(n, [&](std::size_t c) { return x[c]; });
    CHECK(std::bit_cast<std::uint32_t>(sum) == std::bit_cast<std::uint32_t>(part[0]));
    double exact = 0;
    for (std::size_t c = 0; c < n; ++c) exact += x[c];
    CHECK(std::fabs(sum - exact) <= 1e-5 * (1.0 + std::fabs(exact)));
    if (n == 0) continue;
    CHECK(cpu::lane_max<16>(x.data(), n) == *std::max_element(x.begin(), x.begin() + n));
    std::vector<float> negative(x.begin(), x.begin() + n);
    for (float& v : negative) v = -std::fabs(v) - 1.0f;
    negative[n / 2] = -0.5f;
    CHECK(cpu::lane_max<16>(negative.data(), n) == -0.5f);
  }
  const std::vector<float> lowest{-std::numeric_limits<float>::infinity(), -3.0f};
  CHECK(cpu::lane_max<16>(lowest.data(), 2) == -3.0f);
}

TEST_CASE("deep layers: BatchNorm2d in training normalises per channel and updates running statistics") {
  using Net = Sequential<Input<3, 4, 5>, BatchNorm2d>;
  constexpr std::size_t batch = 6, plane = 20, channels = 3;
  Model<Net, double> model;
  static_assert(Net::parameter_count == 6 && Net::state_count == 6);
  auto params = model.parameters();
  for (std::size_t c = 0; c < channels; ++c) {
    params[c] = 0.5 + static_cast<double>(c);  // gamma
    params[channels + c] = -1.0 + static_cast<double>(c);  // beta
  }
  const auto x = random_vector<double>(batch * channels * plane, 5, -2.0, 3.0);
  const auto y = run(model, x, batch);
  for (std::size_t c = 0; c < channels; ++c) {
    double mean = 0, var = 0, ymean = 0, yvar = 0;
    const double count = batch * plane;
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t i = 0; i < plane; ++i) {
        mean += x[(s * channels + c) * plane + i] / count;
        ymean += y[(s * channels + c) * plane + i] / count;
      }
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t i = 0; i < plane; ++i) {
        var += std::pow(x[(s * channels + c) * plane + i] - mean, 2) / count;
        yvar += std::pow(y[(s * channels + c) * plane + i] - ymean, 2) / count;
      }
    CHECK(std::abs(ymean - params[channels + c]) < 1e-12);
    CHECK(std::abs(yvar - params[c] * params[c] * var / (var + 1e-5)) < 1e-12);
    // PyTorch's update: momentum 0.1, the unbiased variance.
    CHECK(std::abs(model.state()[c] - 0.1 * mean) < 1e-12);
    CHECK(std::abs(model.state()[channels + c] - (0.9 + 0.1 * var * count / (count - 1))) < 1e-12);
  }

  // Evaluation uses the running statistics: (x - m) / sqrt(v + eps) * gamma + beta.
  const auto e = run(model, x, batch, Pass{});
  for (std::size_t c = 0; c < channels; ++c) {
    const double m = model.state()[c], v = model.state()[channels + c];
    const double at = x[c * plane + 1];
    CHECK(std::abs(e[c * plane + 1] - ((at - m) / std::sqrt(v + 1e-5) * params[c] +
                                       params[channels + c])) < 1e-12);
  }
}

TEST_CASE("deep layers: BatchNorm gradients in training and evaluation") {
  check_gradients<Sequential<Input<2, 3, 3>, BatchNorm2d, Tanh>>(4, 21);
  check_gradients<Sequential<Input<2, 3, 3>, BatchNorm2d, Tanh>>(4, 22, Pass{});
  check_gradients<Sequential<Input<6>, Linear<5>, BatchNorm1d, Sigmoid, Linear<3>>>(5, 23);
}

TEST_CASE("deep layers: GlobalAvgPool and Reshape") {
  using Net = Sequential<Input<2, 2, 3>, GlobalAvgPool>;
  static_assert(std::is_same_v<Net::output_shape, Shape<2>>);
  Model<Net, double> model;
  std::vector<double> x(12);
  for (std::size_t i = 0; i < 12; ++i) x[i] = static_cast<double>(i);
  require_close(run(model, x, 1), std::vector<double>{2.5, 8.5}, {1e-15, 0}, "means");
  check_gradients<Sequential<Input<3, 4, 4>, Conv2d<2, 3, 1, 1>, GlobalAvgPool, Linear<3>>>(2, 31);

  using Rows = Sequential<Input<1, 4, 6>, Reshape<4, 6>, GRU<3>>;
  static_assert(std::is_same_v<type_at_t<0, Rows::layers>::output_shape, Shape<4, 6>>);
  static_assert(type_at_t<0, Rows::layers>::in_place);
}

TEST_CASE("deep layers: Dropout drops P of the elements, scales the rest, and its mask is a function of the global sample") {
  using Net = Sequential<Input<1000>, Dropout<0.25>>;
  constexpr std::size_t batch = 8;
  Model<Net, double> model;
  const auto x = random_vector<double>(batch * 1000, 41, 1.0, 2.0);

  const auto eval = run(model, x, batch, Pass{});
  require_close(eval, x, {0, 0}, "evaluation is the identity");

  const auto y = run(model, x, batch);
  std::size_t dropped = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (y[i] == 0.0)
      ++dropped;
    else
      REQUIRE(y[i] == x[i] * (1.0 / 0.75));
  }
  // 8000 draws: 2000 expected, standard deviation 39.
  CHECK(dropped > 1800);
  CHECK(dropped < 2200);
  require_close(run(model, x, batch), y, {0, 0}, "the same pass draws the same mask");
  const auto other_step = run(model, x, batch, Pass{.training = true, .seed = 7, .step = 4});
  CHECK(other_step != y);
  const auto other_seed = run(model, x, batch, Pass{.training = true, .seed = 8, .step = 3});
  CHECK(other_seed != y);

  // Samples 5..7 as their own batch (a replica's or micro-batch's share) draw
  // what they drew as part of the whole batch.
  const std::vector<double> tail(x.begin() + 5 * 1000, x.end());
  Pass share = training;
  share.first_sample = 5;
  require_close(run(model, tail, 3, share), std::vector<double>(y.begin() + 5 * 1000, y.end()),
                {0, 0}, "a share's mask");

  check_gradients<Sequential<Input<10>, Linear<8>, Dropout<0.5>, Tanh, Linear<3>>>(4, 42);
}

TEST_CASE("deep layers: Residual adds the body to the identity or to a projection") {
  using Same = Sequential<Input<2, 5, 5>, Residual<Conv2d<2, 3, 1, 1>, BatchNorm2d, Tanh, Conv2d<2, 3, 1, 1>>>;
  using Bound = type_at_t<0, Same::layers>;
  static_assert(Bound::identity);
  static_assert(Same::parameter_count == 2 * (2 * 2 * 9 + 2) + 4);
  static_assert(Same::state_count == 4);
  check_gradients<Same>(3, 51);

  // Channels 2 -> 4 and 6 x 6 -> 3 x 3: a strided 1 x 1 convolution shortcut.
  using Down = Sequential<Input<2, 6, 6>, Residual<Conv2d<4, 3, 2, 1>, BatchNorm2d, Tanh>, Tanh>;
  using DownBound = type_at_t<0, Down::layers>;
  static_assert(!DownBound::identity);
  static_assert(std::is_same_v<Down::output_shape, Shape<4, 3, 3>>);
  static_assert(std::is_same_v<DownBound::shortcut::spec, Conv2d<4, 1, 2>>);
  check_gradients<Down>(3, 52);
  check_gradients<Down>(3, 53, Pass{});

  using Flat = Sequential<Input<6>, Residual<Linear<4>, Tanh>, Residual<Linear<4>, Sigmoid>>;
  static_assert(std::is_same_v<type_at_t<0, Flat::layers>::shortcut::spec, Linear<4>>);
  static_assert(type_at_t<1, Flat::layers>::identity);
  check_gradients<Flat>(4, 54);

  // The identity block's output is exactly body(x) + x, with the block's weights.
  using Body = Sequential<Input<6>, Linear<6>, Tanh>;
  using Block = Sequential<Input<6>, Residual<Linear<6>, Tanh>>;
  Model<Body, double> body;
  Model<Block, double> block(3);
  std::copy(block.parameters().begin(), block.parameters().end(), body.parameters().begin());
  const auto x = random_vector<double>(12, 55);
  const auto fx = run(body, x, 2);
  std::vector<double> expected(12);
  for (std::size_t i = 0; i < 12; ++i) expected[i] = fx[i] + x[i];
  require_close(run(block, x, 2), expected, {0, 0}, "body(x) + x");
}

namespace {

// A ResNet "basic block" as a user names one: a Residual of two
// convolutions, then its ReLU, the channels read off the block's input.
struct BasicBlock : NamedBlock {
  template <class In>
  using layers = TypeList<Residual<Conv2d<In::dims[0], 3, 1, 1>, BatchNorm2d, ReLU,
                                   Conv2d<In::dims[0], 3, 1, 1>, BatchNorm2d>,
                          ReLU>;
  static constexpr std::string_view kind = "basic";
  static constexpr std::string_view name = "basic block";
};

// Net A's forward on `batch` Fashion-MNIST images, and its backward with
// the output gradient r, give exactly what B's do with A's weights: B is
// A with its blocks written out (the same parameters, in the same order).
template <class A, class B>
void require_same_numbers(std::size_t batch, const Pass& pass = training) {
  static_assert(A::parameter_count == B::parameter_count && A::state_count == B::state_count);
  Model<A, double> a(61, batch);
  Model<B, double> b(62, batch);
  std::ranges::copy(a.parameters(), b.parameters().begin());
  const auto& images = test::fashion().train.images;
  const std::vector<double> x(images.begin(),
                              images.begin() + static_cast<std::ptrdiff_t>(batch * 784));
  const auto ya = run(a, x, batch, pass);
  const auto yb = run(b, x, batch, pass);
  test::require_equal(ya, yb, "outputs");
  const auto r = random_vector<double>(ya.size(), 63);
  std::ranges::copy(r, a.output_gradient());
  std::ranges::copy(r, b.output_gradient());
  std::vector<double> dxa(x.size()), dxb(x.size());
  a.backward(0, false, dxa.data());
  b.backward(0, false, dxb.data());
  test::require_equal(a.gradients(), b.gradients(), "weight gradients");
  test::require_equal(dxa, dxb, "input gradients");
  test::require_equal(a.state(), b.state(), "running statistics");
}

}  // namespace

TEST_CASE("blocks: a Series runs its layers as the network written out does, bit for bit") {
  using Nested = Sequential<Input<1, 28, 28>, Series<Flatten, Linear<32>, ReLU>,
                            Series<Linear<16>, Series<Tanh, Linear<12>>, Sigmoid>, Linear<10>>;
  using Flat = Sequential<Input<1, 28, 28>, Flatten, Linear<32>, ReLU, Linear<16>, Tanh,
                          Linear<12>, Sigmoid, Linear<10>>;
  // One layer each: a pipeline cuts between them, messages count them.
  STATIC_REQUIRE(Nested::layer_count == 3);
  STATIC_REQUIRE(Nested::executed::size == 3);
  using First = type_at_t<0, Nested::layers>;
  STATIC_REQUIRE(std::is_same_v<First::output_shape, Shape<32>>);
  // Its layers are numbered 64 x 1 + 1, 2, ...; the ReLU is fused into the Linear.
  STATIC_REQUIRE(type_at_t<1, First::children>::index == 66);
  STATIC_REQUIRE(First::chain::count == 2);
  STATIC_REQUIRE(Nested::forward_flops[1] == Flat::forward_flops[3] + Flat::forward_flops[4] +
                                               Flat::forward_flops[5] + Flat::forward_flops[6]);
  require_same_numbers<Nested, Flat>(5);
}

TEST_CASE("blocks: a named block and blocks inside blocks train as written out, bit for bit") {
  using Named = Sequential<Input<1, 28, 28>, Conv2d<4, 3, 2, 1>, ReLU, BasicBlock,
                           Series<BasicBlock, BasicBlock>, GlobalAvgPool, Linear<10>>;
  using Residuals = Residual<Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<4, 3, 1, 1>,
                             BatchNorm2d>;
  using Written = Sequential<Input<1, 28, 28>, Conv2d<4, 3, 2, 1>, ReLU, Residuals, ReLU,
                             Residuals, ReLU, Residuals, ReLU, GlobalAvgPool, Linear<10>>;
  STATIC_REQUIRE(type_at_t<2, Named::layers>::kind == "basic");
  require_same_numbers<Named, Written>(4);
  require_same_numbers<Named, Written>(4, Pass{});

  // Tensor names say the path: the block, its child, the Residual's body.
  const auto table = tensor_table<Named>();
  REQUIRE(table[2].name == "3.basic.0.residual.body.0.conv.weight");
  REQUIRE(std::ranges::count_if(table, [](const TensorSlot& t) {
            return t.name == "4.series.1.basic.0.residual.body.4.batchnorm.running_var";
          }) == 1);
}

TEST_CASE("blocks: gradients through nested blocks match finite differences") {
  check_gradients<Sequential<Input<6>, Series<Linear<5>, Tanh, Residual<Linear<5>, Sigmoid>>,
                             Linear<3>>>(4, 64);
  // A Series that ends, or starts, with a layer that only renames the shape.
  check_gradients<Sequential<Input<2, 3, 3>, Series<Conv2d<2, 3, 1, 1>, Tanh, Flatten>,
                             Linear<3>>>(3, 65);
  check_gradients<Sequential<Input<2, 3, 3>, Series<Flatten, Linear<4>, GELU>, Linear<3>>>(3,
                                                                                            66);
  check_gradients<Sequential<Input<2, 4, 4>, BasicBlock, GlobalAvgPool, Linear<2>>>(3, 67);
}

namespace {

// PyTorch's GRU and LSTM equations, one sample and one step at a time.
std::vector<double> recurrent_reference(bool lstm, const std::vector<double>& p,
                                        const std::vector<double>& x, std::size_t batch,
                                        std::size_t steps, std::size_t F, std::size_t H,
                                        bool sequence) {
  const std::size_t G = lstm ? 4 : 3;
  const double* w_ih = p.data();
  const double* w_hh = w_ih + G * H * F;
  const double* b_ih = w_hh + G * H * H;
  const double* b_hh = b_ih + G * H;
  std::vector<double> out;
  for (std::size_t s = 0; s < batch; ++s) {
    std::vector<double> h(H, 0.0), c(H, 0.0);
    for (std::size_t t = 0; t < steps; ++t) {
      const double* xt = x.data() + (s * steps + t) * F;
      std::vector<double> xi(G * H), hh(G * H);
      for (std::size_t g = 0; g < G * H; ++g) {
        xi[g] = b_ih[g];
        hh[g] = b_hh[g];
        for (std::size_t f = 0; f < F; ++f) xi[g] += w_ih[g * F + f] * xt[f];
        for (std::size_t k = 0; k < H; ++k) hh[g] += w_hh[g * H + k] * h[k];
      }
      std::vector<double> next(H);
      for (std::size_t j = 0; j < H; ++j) {
        if (lstm) {
          const double i = sigmoid(xi[j] + hh[j]), f = sigmoid(xi[H + j] + hh[H + j]);
          const double g = std::tanh(xi[2 * H + j] + hh[2 * H + j]);
          const double o = sigmoid(xi[3 * H + j] + hh[3 * H + j]);
          c[j] = f * c[j] + i * g;
          next[j] = o * std::tanh(c[j]);
        } else {
          const double r = sigmoid(xi[j] + hh[j]), z = sigmoid(xi[H + j] + hh[H + j]);
          const double n = std::tanh(xi[2 * H + j] + r * hh[2 * H + j]);
          next[j] = (1 - z) * n + z * h[j];
        }
      }
      h = next;
      if (sequence || t + 1 == steps) out.insert(out.end(), h.begin(), h.end());
    }
  }
  return out;
}

template <class Net>
void check_recurrent_forward(bool lstm, bool sequence) {
  constexpr std::size_t batch = 3, steps = 5, F = 4, H = 6;
  Model<Net, double> model(9);
  const auto x = random_vector<double>(batch * steps * F, 61, -2.0, 2.0);
  const std::vector<double> p(model.parameters().begin(), model.parameters().end());
  require_close(run(model, x, batch), recurrent_reference(lstm, p, x, batch, steps, F, H, sequence),
                {1e-13, 1e-12}, lstm ? "LSTM" : "GRU");
  Model<Net, float> single(9);
  const std::vector<float> xf(x.begin(), x.end());
  const float* y = single.forward(xf.data(), batch);
  require_close(std::vector<float>(y, y + batch * Model<Net, float>::output_size),
                recurrent_reference(lstm, p, x, batch, steps, F, H, sequence), {1e-5, 1e-5},
                "float");
}

}  // namespace

TEST_CASE("deep layers: GRU and LSTM forward match PyTorch's equations step by step") {
  using G = Sequential<Input<5, 4>, GRU<6>>;
  using GS = Sequential<Input<5, 4>, GRU<6, true>>;
  using L = Sequential<Input<5, 4>, LSTM<6>>;
  using LS = Sequential<Input<5, 4>, LSTM<6, true>>;
  static_assert(G::parameter_count == 3 * 6 * (4 + 6 + 2));
  static_assert(L::parameter_count == 4 * 6 * (4 + 6 + 2));
  static_assert(std::is_same_v<GS::output_shape, Shape<5, 6>>);
  check_recurrent_forward<G>(false, false);
  check_recurrent_forward<GS>(false, true);
  check_recurrent_forward<L>(true, false);
  check_recurrent_forward<LS>(true, true);
}

TEST_CASE("deep layers: GRU and LSTM gradients through time") {
  check_gradients<Sequential<Input<5, 3>, GRU<4>>>(3, 71);
  check_gradients<Sequential<Input<5, 3>, LSTM<4>>>(3, 72);
  // Stacked: the first layer's every step feeds the second.
  check_gradients<Sequential<Input<4, 3>, GRU<4, true>, LSTM<3, true>, Flatten, Linear<2>>>(2, 73);
  check_gradients<Sequential<Input<1, 4, 3>, Reshape<4, 3>, LSTM<3, true>, GRU<4>, Linear<2>>>(2, 74);
}

TEST_CASE("deep layers: gradients accumulate over micro-batches") {
  using Net = Sequential<Input<2, 4, 4>, Residual<Conv2d<2, 3, 1, 1>, BatchNorm2d, ReLU>,
                         GlobalAvgPool, Reshape<2, 1>, GRU<3>, Linear<2>>;
  Model<Net, double> model(5, 4);
  const auto x = random_vector<double>(4 * 32, 81);
  const auto r = random_vector<double>(4 * 2, 82);
  auto pass_of = [&](std::size_t first, std::size_t n, bool accumulate) {
    model.forward(x.data() + first * 32, n, 0, training);
    std::copy_n(r.begin() + static_cast<std::ptrdiff_t>(first * 2), n * 2, model.output_gradient());
    model.backward(accumulate);
  };
  pass_of(0, 2, false);
  const std::vector<double> first(model.gradients().begin(), model.gradients().end());
  pass_of(2, 2, false);
  std::vector<double> sum(first);
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += model.gradients()[i];
  pass_of(0, 2, false);
  pass_of(2, 2, true);
  require_close(model.gradients(), sum, {1e-14, 1e-12}, "accumulated");
}

TEST_CASE("deep layers: the fused ResNet block equals the unfused one bit for bit") {
  using Net = Sequential<Input<2, 6, 6>, Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU,
                         Residual<Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<4, 3, 1, 1>,
                                  BatchNorm2d>,
                         ReLU, Residual<Conv2d<8, 3, 2, 1>, BatchNorm2d, ReLU>, GlobalAvgPool,
                         Linear<3>>;
  // Conv+ReLU and BatchNorm+ReLU fuse, at the top level and inside blocks.
  static_assert(Net::executed::size == Net::layers::size - 1);
  using Block = type_at_t<3, Net::layers>;
  static_assert(Block::body::size == Block::layers::size - 1);
  static_assert(type_at_t<1, Block::body>::kind == "batchnorm" &&
                type_at_t<1, Block::body>::activation == Act::relu);

  Model<Net, float> fused(4, 5);
  Model<Unfused<Net>, float> unfused(4, 5);
  const auto x = random_vector<float>(5 * 72, 91);
  const auto r = random_vector<float>(5 * 3, 92);
  for (const Pass& pass : {training, Pass{}}) {
    const float* a = fused.forward(x.data(), 5, 0, pass);
    const float* b = unfused.forward(x.data(), 5, 0, pass);
    REQUIRE(std::vector<float>(a, a + 15) == std::vector<float>(b, b + 15));
    std::copy(r.begin(), r.end(), fused.output_gradient());
    std::copy(r.begin(), r.end(), unfused.output_gradient());
    std::vector<float> dxa(x.size()), dxb(x.size());
    fused.backward(0, false, dxa.data());
    unfused.backward(0, false, dxb.data());
    REQUIRE(dxa == dxb);
    REQUIRE(std::ranges::equal(fused.gradients(), unfused.gradients()));
    REQUIRE(std::ranges::equal(fused.state(), unfused.state()));
  }
}

namespace {

// Two replicas holding the same samples: every sum doubles.
struct TwinReplicas final : ReplicaSum {
  int calls = 0;
  void sum(std::span<double> values) override {
    ++calls;
    for (double& v : values) v *= 2;
  }
};

}  // namespace

TEST_CASE("deep layers: SyncBatchNorm sums its statistics over the replicas") {
  using Sync = Sequential<Input<3, 4, 4>, SyncBatchNorm2d, Tanh>;
  using Plain = Sequential<Input<3, 4, 4>, BatchNorm2d, Tanh>;
  static_assert(Sync::syncs && !Plain::syncs);
  static_assert(Sequential<Input<3, 4, 4>, Residual<SyncBatchNorm2d>>::syncs);
  // Without replicas it is BatchNorm, bit for bit.
  check_gradients<Sync>(4, 101);
  Model<Sync, double> sync;
  Model<Plain, double> plain;
  const auto x = random_vector<double>(4 * 48, 102);
  const auto r = random_vector<double>(4 * 48, 103);
  require_close(run(sync, x, 4), run(plain, x, 4), {0, 0}, "no replicas");

  // Twin replicas see a batch twice its size with the same statistics: the
  // output and input gradient are one replica's, the running variance
  // takes the larger count's correction, the parameter gradients stay local.
  TwinReplicas twins;
  Pass pass = training;
  pass.replicas = &twins;
  require_close(run(sync, x, 4, pass), run(plain, x, 4), {1e-12, 1e-10}, "twin replicas");
  CHECK(twins.calls == 1);
  std::vector<double> dx_sync(x.size()), dx_plain(x.size());
  std::copy(r.begin(), r.end(), sync.output_gradient());
  sync.backward(0, false, dx_sync.data());
  std::copy(r.begin(), r.end(), plain.output_gradient());
  plain.backward(0, false, dx_plain.data());
  CHECK(twins.calls == 3);  // the backward's statistics, then its gradient sums
  require_close(dx_sync, dx_plain, {1e-12, 1e-10}, "input gradient");
  require_close(sync.gradients(), plain.gradients(), {1e-12, 1e-10}, "parameter gradients");
  // Each model ran two training forwards on x; the second of `sync` saw a
  // count of 128 rather than 64, so its running variance took 128/127 of
  // the batch variance where `plain`'s took 64/63.
  for (std::size_t c = 0; c < 3; ++c) {
    double mean = 0, var = 0;
    for (std::size_t s = 0; s < 4; ++s)
      for (std::size_t i = 0; i < 16; ++i) mean += x[(s * 3 + c) * 16 + i] / 64;
    for (std::size_t s = 0; s < 4; ++s)
      for (std::size_t i = 0; i < 16; ++i) var += std::pow(x[(s * 3 + c) * 16 + i] - mean, 2) / 64;
    CHECK(std::abs((sync.state()[3 + c] - plain.state()[3 + c]) -
                   0.1 * var * (128.0 / 127.0 - 64.0 / 63.0)) < 1e-12);
    CHECK(std::abs(sync.state()[c] - plain.state()[c]) < 1e-12);
  }
}
