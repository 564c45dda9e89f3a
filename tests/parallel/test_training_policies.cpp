// AdamW, learning-rate schedules, gradient clipping and checkpoints under
// every policy, on CPU worker devices and real data: each trains to the
// single-device weights, and a checkpoint written under one policy resumes
// under another.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

using namespace loom;
namespace test = loom::test;
using test::fashion;
using test::head;
using test::StopAfter;
using test::TempDir;

namespace {

using Mlp3 = Sequential<Input<1, 28, 28>, Flatten, Linear<48>, ReLU, Linear<24>, ReLU, Dropout<0.1>,
                        Linear<10>>;
using Schedule = callbacks::LrSchedule<schedules::Warmup<schedules::Cosine>>;

const AdamW::Options adamw{.lr = 0.002f};
const Schedule schedule{.schedule = {.steps = 2, .start_factor = 0.5, .after = {}}};
// 480 samples in batches of 60: 8 steps an epoch, two epochs. The norm
// bound is below the gradients' (about 1 to 3 here), so every step clips.
const FitOptions fit{.epochs = 2, .batch_size = 60, .seed = 5, .max_grad_norm = 0.5f};

template <class Policy>
Trainer<Mlp3, Policy, AdamW> make(std::size_t devices, std::uint64_t seed = 7) {
  auto workers = devices::cpu(devices);
  for (auto& d : workers) d.threads = 1;
  return Trainer<Mlp3, Policy, AdamW>(workers, adamw, {.seed = seed});
}

std::vector<float> copy(std::span<const float> values) { return {values.begin(), values.end()}; }

// Reads the weights through model() after step 2, as a logging callback might.
struct Peek {
  template <class T>
  void on_step(const StepInfo& step, T& trainer) {
    if (step.step == 2) seen = trainer.model().parameters()[3];
  }
  float seen = 0.0f;
};

// Sums of the same gradients in another order: float rounding, grown over
// 16 Adam steps. The absolute part, applied to every weight, is set by one
// weight (index 18129, in the first Linear) whose first gradient cancels to
// 8e-8 beside its neighbours' 1e-3: its rounding, which the order of the
// sums decides, is then a few thousandths of it, and Adam's first step
// divides it by |g| + eps with eps (1e-8) of the same size. On AMD Zen's
// OpenBLAS kernels it ends 3.9e-6 apart under Hybrid, every other weight
// within 2e-6 + 1e-4 relative; a step taken the other way would be 2e-3
// apart (lr 0.002).
const test::Tolerance tolerance{1e-5, 1e-4};

}  // namespace

TEST_CASE("training policies: AdamW with a schedule and clipping trains to one device's weights") {
  const auto train = head(fashion().train, 480);
  auto single = make<SingleDevice>(1);
  single.fit(train, fit, schedule);
  const auto reference = copy(single.model().parameters());
  REQUIRE(single.steps() == 16);
  {
    // The bound is in force: without it the weights end elsewhere.
    auto unclipped = make<SingleDevice>(1);
    FitOptions free = fit;
    free.max_grad_norm = 0.0f;
    unclipped.fit(train, free, schedule);
    const auto other = copy(unclipped.model().parameters());
    double largest = 0.0;
    for (std::size_t i = 0; i < other.size(); ++i)
      largest = std::max(largest, double(std::abs(other[i] - reference[i])));
    REQUIRE(largest > 1e-3);
  }

  SECTION("DataParallel over 3") {
    auto trainer = make<DataParallel<>>(3);
    trainer.fit(train, fit, schedule);
    test::require_close(trainer.model().parameters(), reference, tolerance, "DataParallel");
  }
  SECTION("ModelSplit, 3 stages, 1F1B") {
    auto trainer = make<ModelSplit<Balanced<3>, OneFOneB<4>>>(3);
    trainer.fit(train, fit, schedule);
    test::require_close(trainer.model().parameters(), reference, tolerance, "ModelSplit");
  }
  SECTION("Hybrid, 2 replicas x 2 stages") {
    auto trainer = make<Hybrid<2, ModelSplit<Balanced<2>>>>(4);
    trainer.fit(train, fit, schedule);
    test::require_close(trainer.model().parameters(), reference, tolerance, "Hybrid");
  }
}

TEST_CASE("training policies: AdamW chosen at run time (AnyOptimizer) trains as the AdamW type") {
  const auto train = head(fashion().train, 240);
  const auto same = [&]<class Policy>(std::size_t devices, const char* what) {
    auto workers = devices::cpu(devices);
    for (auto& d : workers) d.threads = 1;
    auto typed = make<Policy>(devices);
    Trainer<Mlp3, Policy, AnyOptimizer> chosen(workers, adamw, {.seed = 7});
    typed.fit(train, fit, schedule);
    chosen.fit(train, fit, schedule);
    test::require_equal(chosen.model().parameters(), typed.model().parameters(), what);
  };
  same.template operator()<DataParallel<>>(2, "DataParallel over 2");
  same.template operator()<ModelSplit<Balanced<3>, OneFOneB<4>>>(3, "ModelSplit, 3 stages");
  same.template operator()<Hybrid<replicas_from_devices, ModelSplit<Balanced<2>>>>(
      4, "Hybrid, 2 replicas x 2 stages");
}

TEST_CASE("training policies: a checkpoint moves between policies and device counts mid-fit") {
  TempDir dir;
  const auto train = head(fashion().train, 480);
  auto single = make<SingleDevice>(1);
  single.fit(train, fit, schedule);

  // DataParallel over 2 trains 5 steps and saves; its checkpoint holds what
  // its replicas hold.
  {
    auto data = make<DataParallel<>>(2);
    data.fit(train, fit, schedule, StopAfter{5},
             callbacks::Checkpoint({.path = dir.file("a.safetensors"), .every_steps = 5}));
    auto check = make<SingleDevice>(1, 99);
    check.load(dir.file("a.safetensors"), false);
    test::require_equal(check.model().parameters(), data.model().parameters(), "saved weights");
    test::require_equal(check.optimizer().buffer(1),
                        data.data_parallel().replica_optimizer(1).buffer(1), "saved exp_avg_sq");
    REQUIRE(check.optimizer().steps() == 5);
  }
  // ModelSplit over 3 stages goes on to step 11 (into the second epoch);
  // its stages' weights and moments are gathered into one file.
  {
    auto split = make<ModelSplit<Balanced<3>>>(3, 99);
    split.load(dir.file("a.safetensors"));
    split.fit(train, fit, schedule, StopAfter{11},
              callbacks::Checkpoint({.path = dir.file("b.safetensors"), .every_steps = 11}));
    REQUIRE(split.position().epoch == 2);
  }
  // Hybrid 2 x 2 finishes the fit.
  auto hybrid = make<Hybrid<2, ModelSplit<Balanced<2>>>>(4, 99);
  hybrid.load(dir.file("b.safetensors"));
  hybrid.fit(train, fit, schedule);
  REQUIRE(hybrid.steps() == 16);
  test::require_close(hybrid.model().parameters(), single.model().parameters(), tolerance,
                      "weights after DataParallel -> ModelSplit -> Hybrid");
}

TEST_CASE("training policies: bf16 and fp16 under every policy, every rank skipping the same steps") {
  const auto train = head(fashion().train, 1200);
  const auto test_set = head(fashion().test, 500);
  // fp16 from a scale far too large: the first steps overflow and are
  // skipped, on every rank together, until the scale has backed off.
  const TrainerOptions fp16{.seed = 7,
                            .precision = Precision::fp16,
                            .loss_scaling = {.initial_scale = 0x1p30f, .max_scale = 0x1p30f}};
  const TrainerOptions bf16{.seed = 7, .precision = Precision::bf16};
  const FitOptions one_epoch{.epochs = 1, .batch_size = 60};
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  const auto first_batch = head(train, 60);
  auto one_device = devices::cpu(1);
  one_device.front().threads = 1;
  Trainer<Mlp3, SingleDevice, SGD> single_step(one_device, sgd, bf16);
  single_step.fit(first_batch, one_epoch);

  const auto check = [&]<class Policy>(std::size_t devices) {
    auto workers = devices::cpu(devices);
    for (auto& d : workers) d.threads = 1;
    // Each replica or micro-batch rounds its own share's gradients: bf16's
    // 8-bit mantissa, not fp32's rounding, bounds the difference after a
    // step. (Twenty steps of SGD with momentum grow it into noise: test
    // accuracy then spreads over 5 points between seeds, policies and
    // precisions alike, so the epoch is held only to learning.)
    Trainer<Mlp3, Policy, SGD> step(workers, sgd, bf16);
    step.fit(first_batch, one_epoch);
    test::require_close(step.model().parameters(), single_step.model().parameters(), {1e-4, 1e-2},
                        std::string(Policy::name) + " bf16 weights after a step");
    Trainer<Mlp3, Policy, SGD> reduced(workers, sgd, bf16);
    reduced.fit(train, one_epoch);
    REQUIRE(reduced.evaluate(test_set).accuracy > 0.6);
    Trainer<Mlp3, Policy, SGD> half(workers, sgd, fp16);
    half.fit(train, one_epoch);
    REQUIRE(half.skipped_steps() >= 8);
    REQUIRE(half.loss_scale() == std::ldexp(1.0f, 30 - static_cast<int>(half.skipped_steps())));
    // About half the epoch's 20 steps were skipped; chance is 0.1.
    REQUIRE(half.evaluate(test_set).accuracy > 0.45);
  };
  SECTION("DataParallel over 2: the replicas stay equal") {
    check.template operator()<DataParallel<>>(2);
    auto workers = devices::cpu(2);
    Trainer<Mlp3, DataParallel<>, SGD> half(workers, sgd, fp16);
    half.fit(train, one_epoch);
    test::require_equal(half.data_parallel().replica_model(1).parameters(),
                        half.data_parallel().replica_model(0).parameters(), "replica weights");
  }
  SECTION("ModelSplit, 3 stages") { check.template operator()<ModelSplit<Balanced<3>>>(3); }
  SECTION("Hybrid 2 x 2") { check.template operator()<Hybrid<2, ModelSplit<Balanced<2>>>>(4); }
}

TEST_CASE("training policies: a pipeline's checkpoint holds weights edited through model()") {
  TempDir dir;
  auto split = make<ModelSplit<Balanced<3>>>(3);
  split.fit(head(fashion().train, 120), {.epochs = 1, .batch_size = 60});
  split.model().parameters()[5] = 42.0f;
  split.save(dir.file("edited.safetensors"));
  auto check = make<SingleDevice>(1, 99);
  check.load(dir.file("edited.safetensors"), false);
  REQUIRE(check.model().parameters()[5] == 42.0f);
  // The stages took the edit too.
  REQUIRE(split.model_split().stage_parameters(0)[5] == 42.0f);
}

TEST_CASE("training policies: reading model() in a callback does not roll a pipeline back") {
  TempDir dir;
  const auto train = head(fashion().train, 480);
  auto peeked = make<ModelSplit<Balanced<3>>>(3);
  Peek peek;
  peeked.fit(train, fit, schedule, peek, StopAfter{6},
             callbacks::Checkpoint({.path = dir.file("peeked.safetensors"), .every_steps = 6}));
  auto plain = make<ModelSplit<Balanced<3>>>(3);
  plain.fit(train, fit, schedule, StopAfter{6});
  REQUIRE(peek.seen != 0.0f);
  auto check = make<SingleDevice>(1, 99);
  check.load(dir.file("peeked.safetensors"), false);
  test::require_equal(check.model().parameters(), plain.model().parameters(),
                      "the checkpoint after step 6");
}

namespace {

// Trains 2 steps, doubles every weight through model() (calling it twice,
// as a reader then a writer might), trains 2 more: every policy must
// follow one device doing the same. (SGD: Adam's g / sqrt(v) would turn
// the rounding noise of the near-zero gradients of border pixels into
// whole steps.)
template <class Policy>
std::vector<float> edited_between_fits(std::size_t devices) {
  auto workers = devices::cpu(devices);
  for (auto& d : workers) d.threads = 1;
  Trainer<Mlp3, Policy> trainer(workers, {.lr = 0.05f, .momentum = 0.9f}, {.seed = 7});
  const FitOptions short_fit{.epochs = 1, .batch_size = 60, .seed = 5};
  trainer.fit(head(fashion().train, 120), short_fit);
  const float first = trainer.model().parameters()[0];
  for (float& w : trainer.model().parameters()) w *= 2.0f;
  REQUIRE(trainer.model().parameters()[0] == 2.0f * first);  // a second call keeps the change
  trainer.fit(head(fashion().train, 120), short_fit);
  return copy(trainer.model().parameters());
}

}  // namespace

TEST_CASE("training policies: weights changed through model() between fits reach every device") {
  const auto single = edited_between_fits<SingleDevice>(1);
  test::require_close(edited_between_fits<DataParallel<>>(3), single, tolerance, "DataParallel(3)");
  test::require_close(edited_between_fits<ModelSplit<Balanced<3>>>(3), single, tolerance,
                      "ModelSplit(3)");
  test::require_close(edited_between_fits<Hybrid<2, ModelSplit<Balanced<2>>>>(4), single, tolerance,
                      "Hybrid 2x2");
}
