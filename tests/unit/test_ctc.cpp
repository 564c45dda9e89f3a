// cpu::ctc_loss against a brute-force sum over alignments and central finite
// differences; float against double; padding, zero_infinity and the error
// messages; greedy decoding and edit distance on known cases. The comparison
// with PyTorch is ctc_torch.py's test (ctc_torch_check.cpp).
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/backend/cpu/ctc.hpp>
#include <vector>

#include "loom_test.hpp"

namespace cpu = loom::cpu;
namespace test = loom::test;

namespace {

// A batch with padded targets, as a data loader would hand it over.
struct CtcBatch {
  std::size_t max_frames = 0, classes = 0, max_target = 0;
  std::vector<std::int32_t> frames, targets, lengths;

  CtcBatch(std::size_t max_frames_, std::size_t classes_,
           const std::vector<std::vector<std::int32_t>>& labels, std::vector<std::int32_t> frames_)
      : max_frames(max_frames_), classes(classes_), frames(std::move(frames_)) {
    for (const auto& l : labels) max_target = std::max(max_target, l.size());
    targets.assign(labels.size() * max_target, 0);
    for (std::size_t i = 0; i < labels.size(); ++i) {
      lengths.push_back(static_cast<std::int32_t>(labels[i].size()));
      std::copy(labels[i].begin(), labels[i].end(), targets.begin() + i * max_target);
    }
  }
  std::size_t n() const { return frames.size(); }
  std::size_t size() const { return n() * max_frames * classes; }

  template <class T>
  cpu::CtcSums loss(const std::vector<T>& x, T grad_scale, T* grad, bool zero_infinity = false,
                    std::size_t first_sample = 0) const {
    return cpu::ctc_loss(x.data(), n(), max_frames, classes, frames.data(), targets.data(),
                         max_target, lengths.data(), grad_scale, grad, zero_infinity, first_sample);
  }
};

// -log of the probability summed over every frame labelling that collapses
// (repeats merged, blanks dropped) to `target`: C^T labellings.
double brute_force_loss(const std::vector<double>& x, std::size_t frames, std::size_t classes,
                        const std::vector<std::int32_t>& target) {
  std::vector<double> p(frames * classes);
  for (std::size_t t = 0; t < frames; ++t) {
    double total = 0;
    for (std::size_t c = 0; c < classes; ++c) total += std::exp(x[t * classes + c]);
    for (std::size_t c = 0; c < classes; ++c)
      p[t * classes + c] = std::exp(x[t * classes + c]) / total;
  }
  std::size_t paths = 1;
  for (std::size_t t = 0; t < frames; ++t) paths *= classes;
  double likelihood = 0;
  for (std::size_t code = 0; code < paths; ++code) {
    std::vector<std::int32_t> collapsed;
    double prob = 1;
    std::size_t rest = code;
    std::int32_t previous = 0;
    for (std::size_t t = 0; t < frames; ++t) {
      const auto c = static_cast<std::int32_t>(rest % classes);
      rest /= classes;
      prob *= p[t * classes + static_cast<std::size_t>(c)];
      if (c != 0 && c != previous) collapsed.push_back(c);
      previous = c;
    }
    if (collapsed == target) likelihood += prob;
  }
  return -std::log(likelihood);
}

}  // namespace

TEST_CASE("ctc: the loss equals a brute-force sum over all alignments (T <= 5, C = 3)") {
  struct Case {
    std::size_t frames;
    std::vector<std::int32_t> target;
  };
  const std::vector<Case> cases{{1, {2}},    {3, {1}},       {4, {1, 2}},    {3, {1, 1}},
                                {5, {1, 1}}, {5, {2, 1, 2}}, {5, {1, 1, 2}}, {4, {2, 2}}};
  std::uint64_t seed = 1;
  for (const auto& c : cases) {
    CAPTURE(c.frames, c.target);
    const auto x = test::random_vector<double>(c.frames * 3, seed++, -2.0, 2.0);
    const CtcBatch batch(c.frames, 3, {c.target}, {static_cast<std::int32_t>(c.frames)});
    const auto sums = batch.loss(x, 1.0, static_cast<double*>(nullptr));
    REQUIRE(sums.infinite == 0);
    const double expected = brute_force_loss(x, c.frames, 3, c.target);
    REQUIRE(sums.loss * static_cast<double>(c.target.size()) == Approx(expected).epsilon(1e-12));
  }
}

TEST_CASE("ctc: the gradient equals central finite differences (double, repeats, padding)") {
  // Different frames and target lengths; {4, 1, 4, 4} has a repeat and needs
  // 5 of its 7 frames, {2, 2} needs 3 of 3: both near their limits.
  const CtcBatch batch(8, 5, {{1, 2, 2}, {3}, {4, 1, 4, 4}, {2, 2}}, {8, 6, 7, 3});
  auto x = test::random_vector<double>(batch.size(), 11, -2.0, 2.0);
  const double grad_scale = 0.25;
  std::vector<double> grad(batch.size(), std::numeric_limits<double>::quiet_NaN());
  const auto sums = batch.loss(x, grad_scale, grad.data());
  REQUIRE(sums.infinite == 0);
  REQUIRE(std::isfinite(sums.loss));
  std::vector<double> numeric(batch.size());
  const double h = 1e-5;
  for (std::size_t k = 0; k < x.size(); ++k) {
    const double keep = x[k];
    x[k] = keep + h;
    const double up = batch.loss(x, 1.0, static_cast<double*>(nullptr)).loss;
    x[k] = keep - h;
    const double down = batch.loss(x, 1.0, static_cast<double*>(nullptr)).loss;
    x[k] = keep;
    numeric[k] = grad_scale * (up - down) / (2 * h);
  }
  test::require_close(grad, numeric, {1e-9, 1e-6}, "dlogits");
}

TEST_CASE("ctc: float agrees with double") {
  const CtcBatch batch(30, 12, {{1, 2, 3, 4, 5}, {7, 7, 7}, {11}, {3, 9, 3, 9, 3, 9, 10, 1}},
                       {30, 17, 5, 24});
  const auto xd = test::random_vector<double>(batch.size(), 21, -4.0, 4.0);
  const std::vector<float> xf(xd.begin(), xd.end());
  std::vector<double> gd(batch.size());
  std::vector<float> gf(batch.size());
  const auto sd = batch.loss(xd, 1.0 / 4, gd.data());
  const auto sf = batch.loss(xf, 1.0f / 4, gf.data());
  REQUIRE(sf.loss == Approx(sd.loss).epsilon(1e-6));
  test::require_close(gf, gd, {1e-7, 1e-5}, "float dlogits against double");
}

TEST_CASE("ctc: the gradient is exactly zero at frames beyond each sample's length") {
  const CtcBatch batch(10, 6, {{1, 2}, {5, 5, 3}, {4}}, {4, 10, 1});
  const auto x = test::random_vector<float>(batch.size(), 31, -3.0, 3.0);
  std::vector<float> grad(batch.size(), std::numeric_limits<float>::quiet_NaN());
  batch.loss(x, 1.0f, grad.data());
  for (std::size_t i = 0; i < batch.n(); ++i)
    for (std::size_t t = 0; t < batch.max_frames; ++t)
      for (std::size_t c = 0; c < batch.classes; ++c) {
        const float g = grad[(i * batch.max_frames + t) * batch.classes + c];
        CAPTURE(i, t, c);
        if (t >= static_cast<std::size_t>(batch.frames[i]))
          REQUIRE(g == 0.0f);
        else
          REQUIRE(std::isfinite(g));
      }
  // Each used frame's gradient sums to zero over the classes (softmax minus
  // occupancy, both summing to one).
  for (std::size_t t = 0; t < 4; ++t) {
    double total = 0;
    for (std::size_t c = 0; c < batch.classes; ++c) total += grad[t * batch.classes + c];
    REQUIRE(std::abs(total) < 1e-6);
  }
}

TEST_CASE("ctc: zero_infinity zeroes a sample too short for its target and counts it") {
  // {1, 1, 1} needs 5 frames (3 labels, 2 repeats) and has 4.
  const CtcBatch batch(6, 4, {{1, 2}, {1, 1, 1}, {3, 2, 1}}, {6, 4, 5});
  const CtcBatch others(6, 4, {{1, 2}, {3, 2, 1}}, {6, 5});
  const auto x = test::random_vector<double>(batch.size(), 41);
  std::vector<double> x_others(x.begin(), x.begin() + 24);
  x_others.insert(x_others.end(), x.begin() + 48, x.end());

  std::vector<double> grad(batch.size(), 7.0), grad_others(others.size());
  const auto sums = batch.loss(x, 0.5, grad.data(), true);
  const auto expected = others.loss(x_others, 0.5, grad_others.data());
  REQUIRE(sums.infinite == 1);
  REQUIRE(sums.loss == Approx(expected.loss).epsilon(1e-14));
  for (std::size_t k = 24; k < 48; ++k) REQUIRE(grad[k] == 0.0);
  std::vector<double> kept(grad.begin(), grad.begin() + 24);
  kept.insert(kept.end(), grad.begin() + 48, grad.end());
  test::require_equal(kept, grad_others, "the other samples' gradients");

  REQUIRE_THROWS_WITH(
      batch.loss(x, 0.5, grad.data(), false, 6),
      Catch::StartsWith("loom: ctc_loss: sample 7 has target length 3 with 2 repeats, which needs "
                        "5 frames, but has 4 frames; give it more frames") &&
          Catch::Contains("set zero_infinity") && Catch::EndsWith("]"));
}

TEST_CASE("ctc: labels outside 1..classes-1 and bad lengths are loom::Errors naming the sample") {
  const auto x = test::random_vector<float>(2 * 5 * 4, 51);
  const CtcBatch high(5, 4, {{1, 2}, {3, 4}}, {5, 5});
  REQUIRE_THROWS_WITH(high.loss(x, 1.0f, static_cast<float*>(nullptr), false, 100),
                      Catch::StartsWith("loom: ctc_loss: label 4 at position 1 of sample 101 is "
                                        "outside 1..3 (class 0 is the blank)"));
  const CtcBatch blank(5, 4, {{0, 2}, {3}}, {5, 5});
  REQUIRE_THROWS_WITH(blank.loss(x, 1.0f, static_cast<float*>(nullptr)),
                      Catch::StartsWith("loom: ctc_loss: label 0 at position 0 of sample 0 is "
                                        "outside 1..3"));
  CtcBatch frames(5, 4, {{1}, {3}}, {5, 6});
  REQUIRE_THROWS_WITH(frames.loss(x, 1.0f, static_cast<float*>(nullptr)),
                      Catch::StartsWith("loom: ctc_loss: sample 1 has 6 frames, outside 1..5"));
  CtcBatch lengths(5, 4, {{1}, {3}}, {5, 5});
  lengths.lengths[0] = 0;
  REQUIRE_THROWS_WITH(lengths.loss(x, 1.0f, static_cast<float*>(nullptr)),
                      Catch::StartsWith("loom: ctc_loss: sample 0 has target length 0, outside "
                                        "1..1"));
}

TEST_CASE("ctc: greedy decoding merges repeats and drops blanks, within each sample's frames") {
  constexpr std::size_t max_frames = 9, classes = 4;
  const std::vector<std::vector<std::int32_t>> best{{0, 1, 1, 0, 1, 2, 2, 0, 3},
                                                    {3, 3, 3, 0, 0, 2, 1, 1, 1}};
  std::vector<double> logits(2 * max_frames * classes, -1.0);
  for (std::size_t i = 0; i < 2; ++i)
    for (std::size_t t = 0; t < max_frames; ++t)
      logits[(i * max_frames + t) * classes + static_cast<std::size_t>(best[i][t])] = 2.0;
  const std::vector<std::int32_t> frames{9, 6};
  std::vector<std::vector<std::int32_t>> out{{9, 9, 9, 9, 9}};
  cpu::greedy_decode(logits.data(), 2, max_frames, classes, frames.data(), out);
  REQUIRE(out.size() == 2);
  REQUIRE(out[0] == std::vector<std::int32_t>{1, 1, 2, 3});
  REQUIRE(out[1] == std::vector<std::int32_t>{3, 2});
}

TEST_CASE("ctc: edit distance counts insertions, deletions and substitutions") {
  using V = std::vector<std::int32_t>;
  auto distance = [](const V& hyp, const V& ref) { return cpu::edit_distance(hyp, ref); };
  REQUIRE(distance({1, 2, 3}, {1, 2, 3}) == 0);
  REQUIRE(distance({1, 2, 3}, {1, 3}) == 1);
  REQUIRE(distance({1, 3}, {1, 2, 3}) == 1);
  REQUIRE(distance({}, {4, 5}) == 2);
  REQUIRE(distance({4, 5, 6}, {}) == 3);
  REQUIRE(distance({1, 2, 3, 4}, {2, 3, 4, 5}) == 2);
  REQUIRE(distance({3, 1, 2}, {1, 2, 3}) == 2);
  REQUIRE(distance({1, 9, 3}, {1, 2, 3}) == 1);
  // "kitten" -> "sitting", the textbook 3
  REQUIRE(distance({11, 9, 20, 20, 5, 14}, {19, 9, 20, 20, 9, 14, 7}) == 3);
}
