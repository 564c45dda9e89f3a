// bf16 and fp16 on the CPU backend: rounding to each format, a network that
// computes in it, training with fp32 master weights, and fp16's dynamic
// loss scaling (skipped steps, back-off, growth, its bounds, resume).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

using namespace loom;
using loom::test::fashion;
using loom::test::head;
using loom::test::StopAfter;

namespace {

using Logistic = Sequential<Input<1, 28, 28>, Flatten, Linear<10>>;
using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;

std::vector<float> copy(std::span<const float> values) { return {values.begin(), values.end()}; }

bool same_bits(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

// The loss scale after each step, and whether the step was skipped.
struct RecordScale {
  std::vector<float>* scales;
  std::vector<bool>* skipped;
  template <class T>
  void on_step(const StepInfo& step, T& trainer) {
    skipped->push_back(step.skipped);
    scales->push_back(trainer.loss_scale());
  }
};

}  // namespace

TEST_CASE("precision: rounding to fp16 and bf16, ties to even, overflow and subnormals") {
  const float inf = std::numeric_limits<float>::infinity();
  REQUIRE(round_to_fp16(65504.0f) == 65504.0f);
  REQUIRE(round_to_fp16(65519.0f) == 65504.0f);
  REQUIRE(round_to_fp16(65520.0f) == inf);  // the tie rounds to 2^16: out of range
  REQUIRE(round_to_fp16(-7e4f) == -inf);
  REQUIRE(round_to_fp16(1.0f + 0x1p-11f) == 1.0f);                  // tie: to the even 1
  REQUIRE(round_to_fp16(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);    // tie: to the even 1 + 2^-9
  REQUIRE(round_to_fp16(0x1p-24f) == 0x1p-24f);                     // the smallest subnormal
  REQUIRE(round_to_fp16(0x1p-25f) == 0.0f);
  REQUIRE(round_to_fp16(3 * 0x1p-25f) == 0x1p-23f);
  REQUIRE(same_bits(round_to_fp16(-0.0f), -0.0f));
  REQUIRE(std::isnan(round_to_fp16(std::numeric_limits<float>::quiet_NaN())));
  REQUIRE(round_to_bf16(1.0f + 0x1p-8f) == 1.0f);
  REQUIRE(round_to_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
  REQUIRE(round_to_bf16(std::numeric_limits<float>::max()) == inf);
  REQUIRE(round_to_bf16(1e38f) == 0x1.2cp+126f);
  REQUIRE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));

  SECTION("fp16 agrees with the compiler's _Float16 conversion on a million floats") {
    std::size_t checked = 0;
    for (std::uint32_t i = 0; i < 1000000; ++i) {
      const auto bits = static_cast<std::uint32_t>(hash_key(1, 2, i));
      const float x = std::bit_cast<float>(bits);
      if (std::isnan(x)) continue;
      const float expected = static_cast<float>(static_cast<_Float16>(x));
      if (!same_bits(round_to_fp16(x), expected)) FAIL("fp16 of " << x << " (bits " << bits << ")");
      ++checked;
    }
    REQUIRE(checked > 990000);
  }
}

TEST_CASE("precision: a bf16 network rounds its input, its weights and each layer's output") {
  const auto data = head(fashion().test, 32);
  Model<Logistic, float> reduced(3), reference(3);
  reduced.set_precision(Precision::bf16);
  // The same layer in fp32 with bf16 weights and input, its output rounded.
  for (float& w : reference.parameters()) w = round_to_bf16(w);
  auto input = copy(data.images);
  round_to(Precision::bf16, input.data(), input.size());
  REQUIRE(input != copy(data.images));  // the pixels are not all on bf16's grid
  const float* got = reduced.forward(data.images.data(), 32);
  const float* want = reference.forward(input.data(), 32);
  for (std::size_t i = 0; i < 320; ++i) REQUIRE(same_bits(got[i], round_to_bf16(want[i])));
  // The master weights are untouched.
  Model<Logistic, float> fresh(3);
  test::require_equal(reduced.parameters(), fresh.parameters(), "fp32 master weights");

  SECTION("gradients passed back are rounded too, the loss gradient first") {
    Model<Mlp, float> mlp(4);
    mlp.set_precision(Precision::bf16);
    mlp.forward(data.images.data(), 32);
    SoftmaxCrossEntropy::evaluate<float>(mlp.forward(data.images.data(), 32), data.labels.data(),
                                         32, 10, 32, mlp.output_gradient());
    std::vector<float> dx(32 * 784);
    mlp.backward(0, false, dx.data());
    for (const float g : mlp.gradients()) REQUIRE(same_bits(g, round_to_bf16(g)));
    for (const float g : dx) REQUIRE(same_bits(g, round_to_bf16(g)));

    // The one layer's backward reads the loss gradient where the loss wrote
    // it, and leaves it there: rounded.
    SoftmaxCrossEntropy::evaluate<float>(reduced.forward(data.images.data(), 32),
                                         data.labels.data(), 32, 10, 32,
                                         reduced.output_gradient());
    const auto loss_gradient = copy({reduced.output_gradient(), 320});
    std::size_t off_grid = 0;
    for (const float g : loss_gradient) off_grid += !same_bits(g, round_to_bf16(g));
    REQUIRE(off_grid > 0);
    reduced.backward(0, false, dx.data());
    for (std::size_t i = 0; i < 320; ++i)
      REQUIRE(same_bits(reduced.output_gradient()[i], round_to_bf16(loss_gradient[i])));
  }
}

TEST_CASE("precision: bf16 training with fp32 master weights learns as fp32 does") {
  const auto train = head(fashion().train, 3000);
  const auto test = head(fashion().test, 1000);
  auto run = [&](Precision precision) {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f},
                         {.seed = 1, .precision = precision});
    trainer.fit(train, {.epochs = 2, .batch_size = 50});
    return std::pair{trainer.evaluate(test).accuracy, copy(trainer.model().parameters())};
  };
  const auto [fp32, fp32_weights] = run(Precision::fp32);
  const auto [bf16, bf16_weights] = run(Precision::bf16);
  const auto [fp16, fp16_weights] = run(Precision::fp16);
  REQUIRE(fp32 > 0.75);
  REQUIRE(std::abs(bf16 - fp32) < 0.02);
  REQUIRE(std::abs(fp16 - fp32) < 0.02);
  REQUIRE(bf16_weights != fp32_weights);  // it really computed in another precision
  REQUIRE(fp16_weights != bf16_weights);
  // The master weights are fp32: they are not all bf16 values.
  std::size_t off_grid = 0;
  for (const float w : bf16_weights) off_grid += !same_bits(w, round_to_bf16(w));
  REQUIRE(off_grid > bf16_weights.size() / 2);
}

TEST_CASE("precision: fp16 skips the steps whose scaled gradients overflow, backs off and grows") {
  const auto train = head(fashion().train, 1200);  // 24 steps of 50
  const auto test = head(fashion().test, 1000);
  std::vector<float> scales;
  std::vector<bool> skipped;
  SECTION("a scale far too large: skipped steps leave the weights alone, then it trains") {
    // This network's gradients overflow fp16 from a scale of about 2^17:
    // 2^30 is far too large.
    const TrainerOptions fp16{.seed = 1,
                              .precision = Precision::fp16,
                              .loss_scaling = {.initial_scale = 0x1p30f, .max_scale = 0x1p30f}};
    {
      Trainer<Mlp> first(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, fp16);
      const auto initial = copy(first.model().parameters());
      first.fit(train, {.epochs = 1, .batch_size = 50}, StopAfter{1});
      REQUIRE(first.skipped_steps() == 1);
      REQUIRE(first.loss_scale() == 0x1p29f);
      test::require_equal(first.model().parameters(), initial, "weights after a skipped step");
      for (const float v : first.optimizer().velocity()) REQUIRE(v == 0.0f);
    }
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, fp16);
    trainer.fit(train, {.epochs = 1, .batch_size = 50}, RecordScale{&scales, &skipped});
    REQUIRE(scales.size() == 24);
    const auto skips = trainer.skipped_steps();
    REQUIRE(skips >= 8);  // 2^30 must come down to 2^22 or less
    REQUIRE(skips < 20);
    // Each skip halves the scale (2000 good steps would double it).
    std::size_t seen = 0;
    for (std::size_t i = 0; i < scales.size(); ++i) {
      seen += skipped[i];
      REQUIRE(scales[i] == std::ldexp(1.0f, 30 - static_cast<int>(seen)));
    }
    REQUIRE(skipped.front());
    REQUIRE_FALSE(skipped.back());
    REQUIRE(trainer.evaluate(test).accuracy > 0.6);
  }
  SECTION("growth_interval good steps in a row double the scale") {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f},
                         {.seed = 1,
                          .precision = Precision::fp16,
                          .loss_scaling = {.initial_scale = 1.0f, .growth_interval = 3}});
    trainer.fit(train, {.epochs = 1, .batch_size = 50}, RecordScale{&scales, &skipped});
    REQUIRE(trainer.skipped_steps() == 0);
    for (std::size_t i = 0; i < scales.size(); ++i)
      REQUIRE(scales[i] == std::ldexp(1.0f, static_cast<int>((i + 1) / 3)));
  }
  SECTION("growth stops at max_scale") {
    Trainer<Mlp> trainer(
        devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f},
        {.seed = 1,
         .precision = Precision::fp16,
         .loss_scaling = {.initial_scale = 1.0f, .growth_interval = 3, .max_scale = 4.0f}});
    trainer.fit(train, {.epochs = 1, .batch_size = 50}, RecordScale{&scales, &skipped});
    REQUIRE(scales.size() == 24);
    for (std::size_t i = 0; i < scales.size(); ++i)
      REQUIRE(scales[i] == std::min(std::ldexp(1.0f, static_cast<int>((i + 1) / 3)), 4.0f));
  }
  SECTION("the scale stays within its bounds, a checkpoint's scale too") {
    LossScaler scaler({.initial_scale = 4.0f,
                       .growth_factor = 3.0f,
                       .growth_interval = 1,
                       .min_scale = 1.5f,
                       .max_scale = 20.0f});
    scaler.update(false);
    REQUIRE(scaler.scale() == 12.0f);
    scaler.update(false);
    REQUIRE(scaler.scale() == 20.0f);  // not 36
    scaler.update(false);
    REQUIRE(scaler.scale() == 20.0f);
    for (const float expected : {10.0f, 5.0f, 2.5f, 1.5f}) {  // 1.5, not 1.25
      REQUIRE_FALSE(scaler.at_min_scale());
      scaler.update(true);
      REQUIRE(scaler.scale() == expected);
    }
    REQUIRE(scaler.at_min_scale());
    scaler.update(true);
    REQUIRE(scaler.scale() == 1.5f);
    scaler.restore(100.0f, 0);
    REQUIRE(scaler.scale() == 20.0f);
    scaler.restore(0.25f, 0);
    REQUIRE(scaler.scale() == 1.5f);
  }
  SECTION("bad scaling options") {
    REQUIRE_THROWS_WITH(LossScaler({.backoff_factor = 1.0f}),
                        Catch::Contains("backoff_factor must be in (0, 1)"));
    REQUIRE_THROWS_WITH(LossScaler({.initial_scale = 0.0f}),
                        Catch::Contains("initial_scale must be positive"));
    REQUIRE_THROWS_WITH(LossScaler({.min_scale = 0.0f}),
                        Catch::Contains("LossScaling: min_scale and max_scale must be positive "
                                        "and finite, got 0 and 1.67772e+07"));
    REQUIRE_THROWS_WITH(LossScaler({.max_scale = std::numeric_limits<float>::infinity()}),
                        Catch::Contains("got 1 and inf"));
    REQUIRE_THROWS_WITH(LossScaler({.initial_scale = 0x1p25f}),
                        Catch::Contains("LossScaling: initial_scale 3.35544e+07 must lie within "
                                        "min_scale 1 and max_scale 1.67772e+07; widen the bounds"));
    REQUIRE_THROWS_WITH(LossScaler({.initial_scale = 0.5f}),
                        Catch::Contains("initial_scale 0.5 must lie within min_scale 1"));
  }
}

TEST_CASE("precision: LeNet's fp16 scale from 2^24, growing every 4 good steps, skips and grows") {
  // The course the GPU's fp16 tests (cuda/test_cuda_training.cu,
  // `overflowing`) follow step by step: it must both skip and grow.
  using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                           MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
  std::vector<float> scales;
  std::vector<bool> skipped;
  Trainer<LeNet> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f},
                         {.seed = 6,
                          .precision = Precision::fp16,
                          .loss_scaling = {.initial_scale = 0x1p24f, .growth_interval = 4}});
  trainer.fit(head(fashion().train, 1280), {.epochs = 1, .batch_size = 64, .seed = 3},
              RecordScale{&scales, &skipped});
  REQUIRE(scales.size() == 20);
  REQUIRE(skipped.front());  // 2^24 / 64 is beyond fp16's 65504
  REQUIRE(trainer.skipped_steps() >= 3);
  REQUIRE(trainer.skipped_steps() < 20);
  REQUIRE(std::ranges::adjacent_find(scales, std::less<>{}) != scales.end());  // it grew
}

TEST_CASE("precision: an fp16 step that overflows at min_scale is a non-finite step") {
  // This network's gradients overflow fp16 from a scale of about 2^17: with
  // the scale bounded below by 2^28, the third step overflows at the bound.
  const auto train = head(fashion().train, 1200);
  const TrainerOptions fp16{
      .seed = 1,
      .precision = Precision::fp16,
      .loss_scaling = {.initial_scale = 0x1p30f, .min_scale = 0x1p28f, .max_scale = 0x1p30f}};
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, fp16);
  const auto initial = copy(trainer.model().parameters());
  SECTION("raise: the error says the minimum scale did not help") {
    std::string error;
    try {
      trainer.fit(train, {.epochs = 1, .batch_size = 50});
    } catch (const Error& e) {
      error = e.what();
    }
    REQUIRE_THAT(error, Catch::Contains("the gradients became non-finite at epoch 1, step 3 under "
                                       "a finite loss, even at fp16's minimum loss scale "
                                       "268435456 (LossScaling::min_scale): the gradient of "
                                       "layer ") &&
                            Catch::Contains("; the weights are kept from the step before"));
    REQUIRE(trainer.skipped_steps() == 2);
    REQUIRE(trainer.loss_scale() == 0x1p28f);
  }
  SECTION("skip: counted as non-finite, the scale kept") {
    std::vector<float> scales;
    std::vector<bool> skipped;
    trainer.fit(train, {.epochs = 1, .batch_size = 50, .on_nonfinite = NonFinite::skip},
                RecordScale{&scales, &skipped});
    REQUIRE(scales.size() == 24);
    REQUIRE(std::ranges::count(skipped, true) == 24);
    REQUIRE(trainer.skipped_steps() == 2);
    REQUIRE(trainer.nonfinite_steps() == 22);
    REQUIRE(trainer.loss_scale() == 0x1p28f);
  }
  test::require_equal(trainer.model().parameters(), initial, "weights");
}

TEST_CASE("precision: an fp16 run resumed from a checkpoint keeps its loss scale, bit for bit") {
  test::TempDir dir;
  const auto train = head(fashion().train, 600);
  const TrainerOptions fp16{.seed = 2,
                            .precision = Precision::fp16,
                            .loss_scaling = {.initial_scale = 0x1p36f,
                                             .growth_interval = 4,
                                             .max_scale = 0x1p36f}};
  const FitOptions fit{.epochs = 2, .batch_size = 50};
  Trainer<Mlp> whole(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, fp16);
  whole.fit(train, fit);
  {
    Trainer<Mlp> first(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, fp16);
    first.fit(train, fit, StopAfter{9},
              callbacks::Checkpoint({.path = dir.file("fp16.safetensors"), .every_steps = 9}));
  }
  TrainerOptions other_seed = fp16;  // the checkpoint's seed wins
  other_seed.seed = 99;
  Trainer<Mlp> second(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, other_seed);
  second.load(dir.file("fp16.safetensors"));
  second.fit(train, fit);
  REQUIRE(whole.skipped_steps() > 0);
  REQUIRE(second.skipped_steps() == whole.skipped_steps());
  REQUIRE(second.loss_scale() == whole.loss_scale());
  test::require_equal(second.model().parameters(), whole.model().parameters(), "weights");
}

TEST_CASE("precision: accumulated micro-batches add their rounded gradients in fp32") {
  const auto data = head(fashion().train, 64);
  const auto step = [&](Model<Mlp, float>& model, std::size_t first, bool accumulate) {
    const float* logits = model.forward(data.images.data() + first * 784, 32);
    SoftmaxCrossEntropy::evaluate<float>(logits, data.labels.data() + first, 32, 10, 64,
                                         model.output_gradient());
    model.backward(accumulate);
  };
  Model<Mlp, float> both(5), first(5), second(5);
  for (auto* model : {&both, &first, &second}) model->set_precision(Precision::bf16);
  step(both, 0, false);
  step(both, 32, true);
  step(first, 0, false);
  step(second, 32, false);
  const auto a = first.gradients(), b = second.gradients(), sum = both.gradients();
  std::size_t off_grid = 0;
  for (std::size_t i = 0; i < sum.size(); ++i) {
    REQUIRE(same_bits(sum[i], a[i] + b[i]));
    off_grid += !same_bits(sum[i], round_to_bf16(sum[i]));
  }
  REQUIRE(off_grid > 0);  // the sum is fp32's, not bf16's
}

TEST_CASE("precision: a Residual block rounds its body's layers as the network rounds its own") {
  // The block against its body run as a network of its own: the body's
  // every output and passed-back gradient rounded, then the block's sum.
  using Block = Sequential<Input<784>, Residual<Linear<16>, ReLU, Linear<784>>>;
  using Body = Sequential<Input<784>, Linear<16>, ReLU, Linear<784>>;
  const auto data = head(fashion().test, 8);
  const float* x = data.images.data();
  Model<Block, float> block(6);
  Model<Body, float> body(6);
  REQUIRE(block.parameters().size() == body.parameters().size());
  std::ranges::copy(block.parameters(), body.parameters().begin());
  block.set_precision(Precision::bf16);
  body.set_precision(Precision::bf16);

  const float* y = block.forward(x, 8, 0, {.training = true});
  const float* inner = body.forward(x, 8, 0, {.training = true});
  for (std::size_t k = 0; k < 8 * 784; ++k)
    REQUIRE(same_bits(y[k], round_to_bf16(inner[k] + round_to_bf16(x[k]))));

  // d(0.5 |y|^2)/dy = y, already on bf16's grid.
  std::ranges::copy_n(y, 8 * 784, block.output_gradient());
  std::ranges::copy_n(y, 8 * 784, body.output_gradient());
  std::vector<float> dx_block(8 * 784), dx_body(8 * 784);
  block.backward(0, false, dx_block.data());
  body.backward(0, false, dx_body.data());
  test::require_equal(block.gradients(), body.gradients(), "weight gradients");
  for (std::size_t k = 0; k < 8 * 784; ++k)
    REQUIRE(same_bits(dx_block[k], round_to_bf16(y[k] + dx_body[k])));

  SECTION("a projection's output and input gradient are rounded before the body's are added") {
    using Projected = Sequential<Input<784>, Residual<Linear<16>, ReLU, Linear<32>>>;
    using Narrow = Sequential<Input<784>, Linear<16>, ReLU, Linear<32>>;
    using Shortcut = Sequential<Input<784>, Linear<32>>;
    Model<Projected, float> projected(7);
    Model<Narrow, float> narrow(7);
    Model<Shortcut, float> shortcut(7);
    const auto params = projected.parameters();
    const std::size_t split = narrow.parameters().size();
    REQUIRE(params.size() == split + shortcut.parameters().size());
    std::ranges::copy(params.first(split), narrow.parameters().begin());
    std::ranges::copy(params.subspan(split), shortcut.parameters().begin());
    projected.set_precision(Precision::fp16);
    narrow.set_precision(Precision::fp16);
    shortcut.set_precision(Precision::fp16);

    const float* got = projected.forward(x, 8, 0, {.training = true});
    const float* a = narrow.forward(x, 8, 0, {.training = true});
    const float* b = shortcut.forward(x, 8, 0, {.training = true});
    std::vector<float> out(got, got + 8 * 32);
    for (std::size_t k = 0; k < 8 * 32; ++k) REQUIRE(same_bits(out[k], round_to_fp16(b[k] + a[k])));

    for (auto* g : {projected.output_gradient(), narrow.output_gradient(),
                    shortcut.output_gradient()})
      std::ranges::copy(out, g);
    std::vector<float> dx(8 * 784), dx_narrow(8 * 784), dx_shortcut(8 * 784);
    projected.backward(0, false, dx.data());
    narrow.backward(0, false, dx_narrow.data());
    shortcut.backward(0, false, dx_shortcut.data());
    for (std::size_t k = 0; k < 8 * 784; ++k)
      REQUIRE(same_bits(dx[k], round_to_fp16(dx_shortcut[k] + dx_narrow[k])));
  }
}
