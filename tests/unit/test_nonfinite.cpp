// Numerical faults on one device: a step whose loss or gradients go
// non-finite raises a loom::Error naming the step and the first input,
// weight, output or gradient that went bad, keeping the weights of the step
// before; FitOptions::on_nonfinite = NonFinite::skip skips it instead.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "nonfinite_test.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

using namespace loom;
namespace test = loom::test;
using loom::test::fashion;
using loom::test::error_of;
using loom::test::head;
using loom::test::without;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;
using SmallCnn = Sequential<Input<1, 28, 28>, Conv2d<4, 5>, ReLU, MaxPool2d<2>, Flatten,
                            Linear<32>, ReLU, Linear<10>>;
using test::OverflowingNet;
using Block = Sequential<Input<1, 28, 28>, Conv2d<4, 3, 1, 1>, ReLU,
                         Residual<Conv2d<4, 3, 1, 1>, ReLU, Conv2d<4, 3, 1, 1>>, ReLU, Flatten,
                         Linear<10>>;
// The same block inside a Series: a block inside a block.
using Nested = Sequential<Input<1, 28, 28>, Conv2d<4, 3, 1, 1>, ReLU,
                          Series<Residual<Conv2d<4, 3, 1, 1>, ReLU, Conv2d<4, 3, 1, 1>>, ReLU>,
                          Flatten, Linear<10>>;

constexpr float not_a_number = std::numeric_limits<float>::quiet_NaN();

std::vector<float> weights_of(const std::span<const float> p) { return {p.begin(), p.end()}; }

template <class Net, class Policy>
std::vector<float> weights_of(Trainer<Net, Policy>& trainer) {
  return weights_of(std::as_const(trainer.model()).parameters());
}

struct Record {
  std::vector<StepInfo>* steps;
  std::vector<EpochInfo>* epochs;
  void on_step(const StepInfo& s) { steps->push_back(s); }
  void on_epoch_end(const EpochInfo& e) { epochs->push_back(e); }
};

}  // namespace

TEST_CASE("nonfinite: a NaN pixel names the input and step, and skip trains as if the batch were not there") {
  auto bad = head(fashion().train, 256);
  bad.images[(64 + 3) * 784 + 100] = not_a_number;  // batch 2 (step 2), its sample 3
  const FitOptions fit{.epochs = 1, .batch_size = 64, .shuffle = false};
  const std::string expected =
      "the training loss became nan at epoch 1, step 2: the input batch holds nan (sample 3, "
      "element 100 of 784)";

  SECTION("raise") {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    REQUIRE_THAT(error_of(trainer, bad, fit),
                 Catch::Contains(expected +
                                 "; the weights are kept from the step before. Lower the "
                                 "learning rate or check the input data "
                                 "(FitOptions::on_nonfinite = NonFinite::skip skips such steps)"));
    Trainer<Mlp> one_step(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    one_step.fit(head(fashion().train, 64), fit);
    test::require_equal(weights_of(trainer), weights_of(one_step), "weights of step 1");
    REQUIRE(trainer.nonfinite_steps() == 0);
  }
  SECTION("skip") {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    std::vector<StepInfo> steps;
    std::vector<EpochInfo> epochs;
    auto skipping = fit;
    skipping.on_nonfinite = NonFinite::skip;
    trainer.fit(bad, skipping, Record{&steps, &epochs});
    REQUIRE(steps.size() == 4);
    REQUIRE(trainer.nonfinite_steps() == 1);
    REQUIRE(trainer.skipped_steps() == 0);  // fp16's overflows only
    REQUIRE(steps[1].skipped);
    REQUIRE(steps[1].nonfinite == expected);
    REQUIRE(std::isnan(steps[1].step_loss));
    REQUIRE(!steps[0].skipped);
    REQUIRE(steps[2].nonfinite.empty());
    // As if batch 2 had never been there: the same weights, bit for bit,
    // and the epoch's loss and accuracy over the other batches.
    Trainer<Mlp> reference(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    std::vector<StepInfo> reference_steps;
    std::vector<EpochInfo> reference_epochs;
    reference.fit(without(bad, 64, 64), fit, Record{&reference_steps, &reference_epochs});
    test::require_equal(weights_of(trainer), weights_of(reference), "weights");
    REQUIRE(epochs.at(0).loss == reference_epochs.at(0).loss);
    REQUIRE(epochs.at(0).accuracy == reference_epochs.at(0).accuracy);
    REQUIRE(epochs.at(0).samples == 256);
    REQUIRE(steps[3].loss == reference_steps[2].loss);
  }
  SECTION("callbacks: Progress prints the skip, Metrics logs it") {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
    std::ostringstream out;
    test::TempDir dir;
    auto skipping = fit;
    skipping.on_nonfinite = NonFinite::skip;
    trainer.fit(bad, skipping,
                callbacks::Progress({.out = &out, .style = callbacks::Progress::Style::lines}),
                callbacks::Metrics({.path = dir.file("metrics.jsonl")}));
    REQUIRE(out.str().find("skipped: " + expected + "\n") != std::string::npos);
    std::ifstream metrics(dir.file("metrics.jsonl"));
    std::string line;
    std::vector<nlohmann::json> lines;
    while (std::getline(metrics, line)) lines.push_back(nlohmann::json::parse(line));
    REQUIRE(lines.at(1)["skipped"] == true);
    REQUIRE(lines.at(1)["nonfinite"] == expected);
    REQUIRE(!lines.at(0).contains("nonfinite"));
  }
}

TEST_CASE("nonfinite: a run resumed from a checkpoint counts the steps skipped before it") {
  auto bad = head(fashion().train, 256);
  bad.images[(64 + 3) * 784 + 100] = not_a_number;  // step 2 of each epoch
  const FitOptions fit{
      .epochs = 2, .batch_size = 64, .shuffle = false, .on_nonfinite = NonFinite::skip};
  Trainer<Mlp> whole(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  whole.fit(bad, fit);
  REQUIRE(whole.nonfinite_steps() == 2);
  test::TempDir dir;
  const std::string path = dir.file("skipped.safetensors");
  {
    Trainer<Mlp> first(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    first.fit(bad, fit, test::StopAfter{3},
              callbacks::Checkpoint(
                  {.path = path, .every_steps = 3, .every_epoch = false, .at_end = false}));
    REQUIRE(first.nonfinite_steps() == 1);
  }
  Trainer<Mlp> second(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  second.load(path);
  REQUIRE(second.nonfinite_steps() == 1);
  second.fit(bad, fit);
  REQUIRE(second.nonfinite_steps() == whole.nonfinite_steps());
  test::require_equal(weights_of(second), weights_of(whole), "weights");
}

TEST_CASE("nonfinite: the batch that went bad is named under gradient accumulation") {
  // Step 1 is batches 1 and 2; the NaN is in batch 1, whose outputs batch 2
  // overwrites before the step ends.
  auto bad = head(fashion().train, 128);
  bad.images[5 * 784 + 7] = not_a_number;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  const auto before = weights_of(trainer);
  REQUIRE_THAT(error_of(trainer, bad,
                        {.epochs = 1, .batch_size = 32, .shuffle = false, .accumulation_steps = 2}),
               Catch::Contains("the training loss became nan at epoch 1, step 1: the input batch "
                           "holds nan (sample 5, element 7 of 784); the weights are kept"));
  test::require_equal(weights_of(trainer), before, "weights");
}

TEST_CASE("nonfinite: the first layer whose output overflows is named") {
  // Layer 5 (Linear<32>, fused with its ReLU) gets weights of 1e37: its
  // outputs overflow to inf; the conv, pool and flatten before stay finite.
  Trainer<SmallCnn> trainer(devices::cpu(1), {.lr = 0.01f});
  test::set_tensor<SmallCnn>(trainer.model().parameters(), "5.linear.weight", 1e37f);
  const auto before = weights_of(trainer);
  REQUIRE_THAT(error_of(trainer, head(fashion().train, 64), {.batch_size = 32, .shuffle = false}),
               Catch::Contains("the training loss became nan at epoch 1, step 1: layer 5 (linear) "
                           "output became inf (sample 0 of the batch, element 0 of 32); the "
                           "weights are kept from the step before"));
  test::require_equal(weights_of(trainer), before, "weights");
}

TEST_CASE("nonfinite: a weight set to NaN is named") {
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  trainer.model().parameters()[64 * 784 + 64 + 5] = not_a_number;  // layer 4's weight, element 5
  REQUIRE_THAT(error_of(trainer, head(fashion().train, 64), {.batch_size = 64}),
               Catch::Contains("the training loss became nan at epoch 1, step 1: layer 4 (linear) "
                           "holds a weight that is nan (its weight, element 5 of 640): an earlier "
                           "update overflowed, or it was set so; the weights are kept"));
}

TEST_CASE("nonfinite: a Residual block's body layer is named") {
  Trainer<Block> trainer(devices::cpu(1), {.lr = 0.01f});
  test::set_tensor<Block>(trainer.model().parameters(), "3.residual.body.2.conv.weight", 1e38f);
  REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 16), {.batch_size = 16}),
                      Catch::Contains("the training loss became nan at epoch 1, step 1: body "
                                        "layer 3 (conv) of the Residual block at layer 3 output "
                                        "became inf (sample 0 of the batch, element "));
}

TEST_CASE("nonfinite: a layer inside a block inside a block is named by its path") {
  Trainer<Nested> trainer(devices::cpu(1), {.lr = 0.01f});
  test::set_tensor<Nested>(trainer.model().parameters(), "3.series.0.residual.body.2.conv.weight",
                           1e38f);
  const auto before = weights_of(trainer);
  REQUIRE_THAT(error_of(trainer, head(fashion().train, 16), {.batch_size = 16}),
               Catch::Contains("the training loss became nan at epoch 1, step 1: body layer 3 "
                               "(conv) of the Residual block that is layer 1 of the Series block "
                               "at layer 3 output became inf (sample 0 of the batch, element "));
  test::require_equal(weights_of(trainer), before, "weights");
}

TEST_CASE("nonfinite: a gradient that overflows under a finite loss is caught before the update") {
  const std::string expected =
      "the gradients became non-finite at epoch 1, step 1 under a finite loss: the gradient of "
      "layer 2 (linear) became inf (its weight, element 0 of 6272); the weights are kept from "
      "the step before";
  SECTION("raise") {
    Trainer<OverflowingNet> trainer(devices::cpu(1), {.lr = 0.01f});
    test::overflowing_gradient(trainer.model().parameters());
    const auto before = weights_of(trainer);
    REQUIRE_THAT(error_of(trainer, test::ones(64), {.batch_size = 64}), Catch::Contains(expected));
    test::require_equal(weights_of(trainer), before, "weights");
  }
  SECTION("raise, with gradient clipping") {
    Trainer<OverflowingNet> trainer(devices::cpu(1), {.lr = 0.01f});
    test::overflowing_gradient(trainer.model().parameters());
    const auto before = weights_of(trainer);
    REQUIRE_THAT(error_of(trainer, test::ones(64), {.batch_size = 64, .max_grad_norm = 1.0f}),
                 Catch::Contains(expected));
    test::require_equal(weights_of(trainer), before, "weights");
  }
  SECTION("skip: every step is skipped and the weights and momentum stay") {
    Trainer<OverflowingNet> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    test::overflowing_gradient(trainer.model().parameters());
    const auto before = weights_of(trainer);
    std::vector<StepInfo> steps;
    std::vector<EpochInfo> epochs;
    trainer.fit(test::ones(192), {.batch_size = 64, .on_nonfinite = NonFinite::skip},
                Record{&steps, &epochs});
    REQUIRE(trainer.nonfinite_steps() == 3);
    REQUIRE(steps.size() == 3);
    REQUIRE(steps[2].nonfinite.starts_with("the gradients became non-finite at epoch 1, step 3"));
    REQUIRE(std::isfinite(steps[2].step_loss));
    test::require_equal(weights_of(trainer), before, "weights");
    const auto velocity = trainer.optimizer().buffer(0);
    REQUIRE(std::all_of(velocity.begin(), velocity.end(), [](float v) { return v == 0.0f; }));
    REQUIRE(epochs.at(0).loss == 0.0);  // no step counted
  }
}

TEST_CASE("nonfinite: a learning rate that blows up stops with the last good step's weights") {
  // Weights before each step, taken by a callback.
  struct Keep {
    std::vector<float>* weights;
    void on_step_begin(const StepBegin&, Trainer<Mlp>& trainer) {
      *weights = weights_of(std::as_const(trainer.model()).parameters());
    }
  };
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 1e6f, .momentum = 0.9f});
  std::vector<float> kept;
  std::string error;
  try {
    trainer.fit(head(fashion().train, 2048), {.epochs = 4, .batch_size = 64}, Keep{&kept});
  } catch (const Error& e) {
    error = e.what();
  }
  INFO(error);
  REQUIRE(error.find(" at epoch 1, step ") != std::string::npos);
  REQUIRE(error.find("; the weights are kept from the step before") != std::string::npos);
  test::require_equal(weights_of(trainer), kept, "weights before the failed step");
}
