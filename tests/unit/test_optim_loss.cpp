// SGD against hand-computed updates; softmax cross-entropy against hand
// values and finite differences.
#include <cmath>
#include <loom/loom.hpp>
#include <vector>

#include "loom_test.hpp"

using namespace loom;

TEST_CASE("sgd: plain, momentum, weight decay and Nesterov match hand-computed steps") {
  SECTION("plain SGD: w -= lr * g") {
    std::vector<float> w{1.0f, -2.0f};
    const std::vector<float> g{0.5f, 0.25f};
    SGD::State<float> sgd({.lr = 0.1f}, 2);
    sgd.step(w, g);
    REQUIRE(w[0] == Approx(0.95f));
    REQUIRE(w[1] == Approx(-2.025f));
    REQUIRE(sgd.velocity().empty());
  }
  SECTION("momentum 0.9 with weight decay 0.01, two steps") {
    std::vector<double> w{1.0};
    const std::vector<double> g{0.5};
    SGD::State<double> sgd({.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f}, 1);
    sgd.step(w, g);
    // g' = 0.5 + 0.01 * 1 = 0.51; v = 0.51; w = 1 - 0.051
    REQUIRE(w[0] == Approx(0.949).epsilon(1e-7));
    sgd.step(w, g);
    // g' = 0.5 + 0.00949; v = 0.9 * 0.51 + 0.50949 = 0.96849; w = 0.949 - 0.096849
    REQUIRE(sgd.velocity()[0] == Approx(0.96849).epsilon(1e-7));
    REQUIRE(w[0] == Approx(0.852151).epsilon(1e-7));
  }
  SECTION("Nesterov steps along g + momentum * v") {
    std::vector<double> w{1.0};
    const std::vector<double> g{0.5};
    SGD::State<double> sgd({.lr = 0.1f, .momentum = 0.5f, .nesterov = true}, 1);
    sgd.step(w, g);
    // v = 0.5; step = 0.5 + 0.5 * 0.5 = 0.75
    REQUIRE(w[0] == Approx(0.925).epsilon(1e-7));
    sgd.step(w, g);
    // v = 0.25 + 0.5 = 0.75; step = 0.5 + 0.375 = 0.875
    REQUIRE(w[0] == Approx(0.8375).epsilon(1e-7));
  }
  SECTION("bad options are errors") {
    REQUIRE_THROWS_WITH(SGD::State<float>({.lr = 0.0f}, 1), Catch::Contains("learning rate"));
    REQUIRE_THROWS_WITH(SGD::State<float>({.lr = 0.1f, .momentum = 1.0f}, 1),
                        Catch::Contains("momentum"));
    REQUIRE_THROWS_WITH(SGD::State<float>({.lr = 0.1f, .nesterov = true}, 1),
                        Catch::Contains("Nesterov"));
    SGD::State<float> sgd({.lr = 0.1f}, 2);
    std::vector<float> w(2), g(3);
    REQUIRE_THROWS_WITH(sgd.step(w, g), Catch::Contains("2 weights but 3 gradients"));
  }
}

TEST_CASE("loss: softmax cross-entropy values, gradient and accuracy count") {
  // Row 0: logits (0, ln 3) -> p = (1/4, 3/4); label 1: loss = -ln(3/4).
  // Row 1: logits (2, 2)    -> p = (1/2, 1/2); label 0: loss = ln 2, a tie
  // counts as class 0 (first maximum).
  const std::vector<double> logits{0.0, std::log(3.0), 2.0, 2.0};
  const std::vector<std::int32_t> labels{1, 0};
  std::vector<double> grad(4);
  const auto sums =
      SoftmaxCrossEntropy::evaluate<double>(logits.data(), labels.data(), 2, 2, 4, grad.data());
  REQUIRE(sums.loss == Approx(-std::log(0.75) + std::log(2.0)).epsilon(1e-12));
  REQUIRE(sums.correct == 2);
  // Scaled by 1 / global batch (4 here: these rows are half of it).
  test::require_close(grad, std::vector<double>{0.25 / 4, -0.25 / 4, -0.5 / 4, 0.5 / 4},
                      {1e-15, 1e-12}, "dlogits");
}

TEST_CASE("loss: gradient matches finite differences, large logits stay finite") {
  const auto logits = test::random_vector<double>(3 * 7, 5, -30.0, 30.0);
  const std::vector<std::int32_t> labels{6, 0, 3};
  std::vector<double> grad(logits.size());
  const auto sums =
      SoftmaxCrossEntropy::evaluate<double>(logits.data(), labels.data(), 3, 7, 3, grad.data());
  REQUIRE(std::isfinite(sums.loss));
  std::vector<double> numeric(logits.size());
  auto v = logits;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + 1e-6;
    const double up =
        SoftmaxCrossEntropy::evaluate<double>(v.data(), labels.data(), 3, 7, 3, nullptr).loss;
    v[i] = keep - 1e-6;
    const double down =
        SoftmaxCrossEntropy::evaluate<double>(v.data(), labels.data(), 3, 7, 3, nullptr).loss;
    v[i] = keep;
    numeric[i] = (up - down) / 2e-6 / 3.0;
  }
  test::require_close(grad, numeric, {1e-8, 1e-6}, "dlogits");
}

TEST_CASE("loss: a label outside the classes is an error") {
  const std::vector<float> logits(10);
  const std::vector<std::int32_t> labels{0, 5};
  REQUIRE_THROWS_WITH(
      SoftmaxCrossEntropy::evaluate<float>(logits.data(), labels.data(), 2, 5, 2, nullptr),
      Catch::Contains("label 5 of sample 1 is outside the network's 5 classes"));
}

namespace {

// 3 samples x 4 positions x 5 classes: sample 0 has every frame, sample 1
// two (positions 2 and 3 past its length), sample 2 three; -1 ignores a
// position. Counted: 4 + 1 + 2 = 7 positions.
using PositionOut = Shape<4, 5>;
const std::vector<std::int32_t> position_labels{1, 4, 0, 2, 3, -1, 1, 1, -1, 0, 4, 2};
const std::vector<std::int32_t> position_frames{4, 2, 3};

Targets position_targets() {
  Targets t;
  t.sequences = position_labels.data();
  t.max_target = 4;
  t.frames = position_frames.data();
  return t;
}

// Brute force: -log softmax at every counted position, summed.
double position_loss_reference(const std::vector<double>& logits) {
  double sum = 0.0;
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t p = 0; p < static_cast<std::size_t>(position_frames[i]); ++p) {
      const std::int32_t label = position_labels[i * 4 + p];
      if (label < 0) continue;
      const double* row = logits.data() + (i * 4 + p) * 5;
      double total = 0.0;
      for (std::size_t c = 0; c < 5; ++c) total += std::exp(row[c]);
      sum -= std::log(std::exp(row[label]) / total);
    }
  return sum;
}

}  // namespace

TEST_CASE("PositionCrossEntropy: the sums over counted positions, against a brute-force reference") {
  const auto logits = test::random_vector<double>(3 * 4 * 5, 17, -3.0, 3.0);
  const auto sums = PositionCrossEntropy::compute<PositionOut, double>(
      logits.data(), 3, position_targets(), 1.0, nullptr);
  REQUIRE(sums.loss == Approx(position_loss_reference(logits)).epsilon(1e-12));
  REQUIRE(sums.denominator == 7.0);
  std::size_t correct = 0;
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t p = 0; p < static_cast<std::size_t>(position_frames[i]); ++p) {
      const std::int32_t label = position_labels[i * 4 + p];
      if (label < 0) continue;
      const double* row = logits.data() + (i * 4 + p) * 5;
      correct += std::max_element(row, row + 5) - row == label ? 1 : 0;
    }
  REQUIRE(sums.correct == correct);
  // Its mean is over positions, whatever the samples.
  STATIC_REQUIRE(denominator_of<PositionCrossEntropy> == Denominator::positions);
  STATIC_REQUIRE(denominator_of<SoftmaxCrossEntropy> == Denominator::samples);
  STATIC_REQUIRE(denominator_of<CTCLoss> == Denominator::samples);
}

TEST_CASE("PositionCrossEntropy: the gradient matches finite differences in double, zero where "
          "not counted") {
  const auto logits = test::random_vector<double>(3 * 4 * 5, 23, -4.0, 4.0);
  std::vector<double> grad(logits.size(), 7.0);  // every entry written, the uncounted with 0
  PositionCrossEntropy::compute<PositionOut, double>(logits.data(), 3, position_targets(), 0.5,
                                                     grad.data());
  std::vector<double> numeric(logits.size());
  auto v = logits;
  const auto loss = [&] {
    return PositionCrossEntropy::compute<PositionOut, double>(v.data(), 3, position_targets(),
                                                              1.0, nullptr)
        .loss;
  };
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + 1e-6;
    const double up = loss();
    v[i] = keep - 1e-6;
    const double down = loss();
    v[i] = keep;
    numeric[i] = 0.5 * (up - down) / 2e-6;  // grad_scale 0.5
  }
  test::require_close(grad, numeric, {1e-8, 1e-6}, "dlogits");
  // Sample 1's positions 2 and 3 lie past its frames; position 1 is ignored.
  for (std::size_t p : {1u, 2u, 3u})
    for (std::size_t c = 0; c < 5; ++c) REQUIRE(grad[(4 + p) * 5 + c] == 0.0);
}

TEST_CASE("PositionCrossEntropy: a label past the classes is a loom::Error naming sample and "
          "position") {
  auto labels = position_labels;
  labels[2 * 4 + 1] = 5;
  Targets t = position_targets();
  t.sequences = labels.data();
  REQUIRE_THROWS_WITH(PositionCrossEntropy::check_targets<PositionOut>(t, 3),
                      Catch::Contains("PositionCrossEntropy: sample 2 has label 5 at position 1 "
                                      "but the network outputs 5 classes"));
  data::Dataset set;
  set.name = "positions";
  set.count = 3;
  set.height = 4;
  set.width = 2;
  set.classes = 5;
  set.images.assign(3 * 8, 0.0f);
  set.max_target = 4;
  set.targets = labels;
  REQUIRE(set.target_kind() == TargetKind::class_per_position);
  REQUIRE_THROWS_WITH(data::check_targets(set),
                      Catch::Contains("dataset 'positions': sample 2 has label 5 at position 1; "
                                      "expected 0..4 for 5 classes (or < 0: ignored)"));
}

TEST_CASE("loss: which losses a backend may run as a softmax per row, and over how many rows") {
  // The GPU runs these on the device (gpu/stage.cuh); CTC stays on the host.
  REQUIRE(detail::loss_ops<SoftmaxCrossEntropy, Shape<10>>().softmax_rows() == 1);
  REQUIRE(detail::loss_ops<PositionCrossEntropy, Shape<16, 256>>().softmax_rows() == 16);
  REQUIRE(detail::loss_ops<PositionCrossEntropy, PositionOut>().softmax_rows() == 4);
  REQUIRE(detail::loss_ops<CTC<>, Shape<16, 28>>().softmax_rows() == 0);
}
