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
#include "temp_dir.hpp"

using namespace loom;
namespace test = loom::test;
using test::fashion;
using test::head;
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

struct StopAfter {
  std::uint64_t k;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() == k) trainer.stop();
  }
};

// Sums of the same gradients in another order: float rounding, grown over
// 16 Adam steps.
const test::Tolerance tolerance{2e-6, 1e-4};

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
