// Whole networks: gradients of the mean cross-entropy against finite
// differences in double, seeded initialisation, and the arena.
#include <cmath>
#include <loom/loom.hpp>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;

namespace {

// Small enough for finite differences over every parameter, and exercising
// every layer kind, padding, strides and both fusions.
using Small = Sequential<Input<2, 8, 8>, Conv2d<3, 3, 1, 1>, ReLU, MaxPool2d<2>, Conv2d<4, 3, 2, 1>,
                         ReLU, AvgPool2d<2>, Flatten, Linear<6>, ReLU, Linear<5>>;

template <class Net>
double mean_loss(Model<Net, double>& model, const std::vector<double>& x,
                 const std::vector<std::int32_t>& labels, bool with_gradient) {
  const std::size_t n = labels.size();
  const double* logits = model.forward(x.data(), n);
  const auto sums =
      SoftmaxCrossEntropy::evaluate<double>(logits, labels.data(), n, Net::output_shape::size, n,
                                            with_gradient ? model.output_gradient() : nullptr);
  if (with_gradient) model.backward();
  return sums.loss / static_cast<double>(n);
}

template <class Net>
void check_network_gradient() {
  constexpr std::size_t n = 4;
  Model<Net, double> model(7);
  const auto x = random_vector<double>(n * Net::input_shape::size, 8);
  const std::vector<std::int32_t> labels{0, 3, 4, 1};
  mean_loss(model, x, labels, true);
  const std::vector<double> analytic(model.gradients().begin(), model.gradients().end());

  std::vector<double> numeric(analytic.size());
  auto params = model.parameters();
  const double eps = 1e-6;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double keep = params[i];
    params[i] = keep + eps;
    const double up = mean_loss(model, x, labels, false);
    params[i] = keep - eps;
    const double down = mean_loss(model, x, labels, false);
    params[i] = keep;
    numeric[i] = (up - down) / (2 * eps);
  }
  test::require_close(analytic, numeric, {1e-7, 1e-5}, "d(mean loss)/d(parameters)");
}

}  // namespace

TEST_CASE("model: whole-network gradient matches finite differences in double") {
  check_network_gradient<Small>();
  check_network_gradient<Unfused<Small>>();
}

TEST_CASE("model: seeded initialisation") {
  Model<Small, float> a(42), b(42), c(43);
  Model<Small, double> d(42);
  test::require_equal(a.parameters(), b.parameters(), "same seed");
  REQUIRE_FALSE(std::equal(a.parameters().begin(), a.parameters().end(), c.parameters().begin()));
  // float weights are the double weights rounded once: the same on every backend.
  for (std::size_t i = 0; i < a.parameters().size(); ++i)
    REQUIRE(a.parameters()[i] == static_cast<float>(d.parameters()[i]));

  using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                           MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
  Model<LeNet, double> lenet(1);
  const auto p = lenet.parameters();
  auto stats = [&](std::size_t first, std::size_t count) {
    double max_abs = 0, sum_sq = 0;
    for (std::size_t i = first; i < first + count; ++i) {
      max_abs = std::max(max_abs, std::abs(p[i]));
      sum_sq += p[i] * p[i];
    }
    return std::pair{max_abs, std::sqrt(sum_sq / static_cast<double>(count))};
  };
  // conv1 is followed by ReLU: He uniform, limit sqrt(6 / 25), std limit/sqrt(3).
  const auto [conv1_max, conv1_std] = stats(0, 500);
  REQUIRE(conv1_max <= std::sqrt(6.0 / 25));
  REQUIRE(conv1_std == Approx(std::sqrt(6.0 / 25) / std::sqrt(3.0)).epsilon(0.1));
  // Biases start at zero.
  for (std::size_t i = 500; i < 520; ++i) REQUIRE(p[i] == 0.0);
  // The last Linear has no ReLU after it: Glorot uniform, limit sqrt(6 / 510).
  const std::size_t last = LeNet::parameter_count - 5010;
  const auto [fc2_max, fc2_std] = stats(last, 5000);
  REQUIRE(fc2_max <= std::sqrt(6.0 / 510));
  REQUIRE(fc2_std == Approx(std::sqrt(6.0 / 510) / std::sqrt(3.0)).epsilon(0.05));
}

TEST_CASE("model: forward grows the arena on demand and smaller batches reuse it") {
  Model<Small, float> model(3);
  REQUIRE(model.capacity() == 0);
  const auto x = random_vector<float>(8 * Small::input_shape::size, 4);
  std::vector<float> first(model.forward(x.data(), 8), model.forward(x.data(), 8) + 8 * 5);
  REQUIRE(model.capacity() == 8);
  const float* out = model.forward(x.data(), 3);
  REQUIRE(model.capacity() == 8);
  // Each sample's output depends only on that sample.
  for (std::size_t i = 0; i < 3 * 5; ++i) REQUIRE(out[i] == Approx(first[i]).epsilon(1e-6));
  REQUIRE_THROWS_WITH(model.forward(x.data(), 0), Catch::Contains("empty batch"));
}

TEST_CASE(
    "model: a batch of 150 (three convolution chunks) equals three accumulated micro-batches") {
  // The arena is sized from the plan for 150 samples; the gradient of the
  // mean loss over 150 must equal the sum over micro-batches of 50, each
  // scaled by 1/150 and accumulated (as pipeline micro-batches will be).
  constexpr std::size_t n = 150, micro = 50;
  const auto x = random_vector<float>(n * Small::input_shape::size, 12);
  std::vector<std::int32_t> labels(n);
  for (std::size_t i = 0; i < n; ++i) labels[i] = static_cast<std::int32_t>(i * 7 % 5);

  Model<Small, float> whole(5);
  const float* logits = whole.forward(x.data(), n);
  const std::vector<float> outputs(logits, logits + n * 5);
  SoftmaxCrossEntropy::evaluate<float>(logits, labels.data(), n, 5, n, whole.output_gradient());
  whole.backward();

  Model<Small, float> parts(5);
  for (std::size_t first = 0; first < n; first += micro) {
    const float* part = parts.forward(x.data() + first * Small::input_shape::size, micro);
    test::require_close(
        std::vector<float>(part, part + micro * 5),
        std::vector<float>(outputs.begin() + static_cast<long>(first * 5),
                           outputs.begin() + static_cast<long>((first + micro) * 5)),
        {1e-6, 1e-5}, "outputs of samples from " + std::to_string(first));
    SoftmaxCrossEntropy::evaluate<float>(part, labels.data() + first, micro, 5, n,
                                         parts.output_gradient());
    parts.backward(first > 0);
  }
  test::require_close(parts.gradients(), whole.gradients(), {1e-7, 1e-4}, "gradients");
}

TEST_CASE("model: backward before forward is an error") {
  Model<Small, float> model(3, 4);
  REQUIRE_THROWS_WITH(model.backward(), Catch::Contains("before forward"));
}

// AddressSanitizer's allocator reports an impossible allocation and stops the
// program instead of throwing std::bad_alloc, so this runs in plain builds only.
#if !defined(__SANITIZE_ADDRESS__)
TEST_CASE("model: a batch whose activations cannot fit in host memory is a clear error") {
  Model<Small> model;
  const std::size_t batch = std::size_t{1} << 40;  // petabytes of activations
  REQUIRE_THROWS_WITH(model.reserve(batch),
                      Catch::StartsWith("loom: out of host memory: Model activations needs ") &&
                          Catch::Contains(" bytes; use a smaller batch size"));
  model.reserve(4);  // still usable
  REQUIRE(model.capacity() == 4);
}
#endif
