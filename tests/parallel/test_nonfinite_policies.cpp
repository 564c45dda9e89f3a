// Numerical faults under every policy: the step that goes non-finite raises
// the same loom::Error as on one device (the same step, and the same input,
// layer and element named: the replica or stage that saw it first
// contributes them), every rank keeps the weights of the step before, and
// NonFinite::skip trains on as if the bad batch had not been there.
#include <algorithm>
#include <cmath>
#include <limits>
#include <loom/loom.hpp>
#include <string>
#include <utility>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "nonfinite_test.hpp"

using namespace loom;
using loom::test::error_of;
using loom::test::fashion;
using loom::test::head;
using loom::test::set_tensor;
using loom::test::without;

namespace {

using SmallCnn = Sequential<Input<1, 28, 28>, Conv2d<4, 5>, ReLU, MaxPool2d<2>, Flatten,
                            Linear<32>, ReLU, Linear<10>>;
using test::OverflowingNet;

const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};

// The weights now (a pipeline's stages gathered).
template <class Net, class Policy>
std::vector<float> weights_of(Trainer<Net, Policy>& trainer) {
  const std::span<const float> p = trainer.model().parameters();
  return {p.begin(), p.end()};
}

// edit(weights) through model(): every replica or stage takes the change
// at the next fit. Returns the weights edited.
template <class Net, class Policy, class Edit>
std::vector<float> edit_weights(Trainer<Net, Policy>& trainer, Edit&& edit) {
  edit(trainer.model().parameters());
  const auto p = std::as_const(trainer).model().parameters();
  return {p.begin(), p.end()};
}

// The four faults, each under `Policy` (on `devices`) and on one device:
// the same error, and the weights the same rules give.
template <class CnnPolicy, class OverflowingNetPolicy>
void require_faults_like_one_device(std::size_t devices, test::Tolerance tolerance) {
  const auto clean = head(fashion().train, 256);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .shuffle = false};
  const auto cnn = [&] { return Trainer<SmallCnn, CnnPolicy>(devices::cpu(devices), sgd); };
  const auto single = [&] { return Trainer<SmallCnn>(devices::cpu(1), sgd); };

  SECTION("a NaN pixel in another replica's or micro-batch's share") {
    auto bad = clean;
    bad.images[(64 + 37) * 784 + 100] = std::numeric_limits<float>::quiet_NaN();
    auto policy = cnn();
    auto one = single();
    const auto error = error_of(policy, bad, fit);
    REQUIRE_THAT(error, Catch::Contains("the training loss became nan at epoch 1, step 2: the "
                                        "input batch holds nan (sample 37, element 100 of 784); "
                                        "the weights are kept from the step before"));
    REQUIRE(error == error_of(one, bad, fit));
    test::require_close(weights_of(policy), weights_of(one), tolerance, "weights of step 1");
    // Skipped: the same weights as this policy trained without the batch, bit for bit.
    auto skipping = cnn();
    auto skip = fit;
    skip.on_nonfinite = NonFinite::skip;
    skipping.fit(bad, skip);
    REQUIRE(skipping.nonfinite_steps() == 1);
    auto reference = cnn();
    reference.fit(without(clean, 64, 64), fit);
    test::require_equal(weights_of(skipping), weights_of(reference), "weights");
  }
  SECTION("a layer's output overflows") {
    auto policy = cnn();
    auto one = single();
    const auto edit = [](std::span<float> p) { set_tensor<SmallCnn>(p, "5.linear.weight", 1e37f); };
    const auto before = edit_weights(policy, edit);
    edit_weights(one, edit);
    const auto error = error_of(policy, clean, fit);
    REQUIRE_THAT(error, Catch::Contains("the training loss became nan at epoch 1, step 1: layer 5 "
                                        "(linear) output became inf (sample 0 of the batch, "
                                        "element 0 of 32)"));
    REQUIRE(error == error_of(one, clean, fit));
    test::require_equal(weights_of(policy), before, "weights");
  }
  SECTION("the first layer's weights are not finite") {
    auto policy = cnn();
    auto one = single();
    const auto edit = [](std::span<float> p) {
      set_tensor<SmallCnn>(p, "1.conv.bias", std::numeric_limits<float>::infinity());
    };
    edit_weights(policy, edit);
    edit_weights(one, edit);
    const auto error = error_of(policy, clean, fit);
    REQUIRE_THAT(error, Catch::Contains("at epoch 1, step 1: layer 1 (conv) holds a weight that "
                                        "is inf (its bias, element 0 of 4)"));
    REQUIRE(error == error_of(one, clean, fit));
  }
  SECTION("a gradient overflows under a finite loss") {
    Trainer<OverflowingNet, OverflowingNetPolicy> policy(devices::cpu(devices), sgd);
    Trainer<OverflowingNet> one(devices::cpu(1), sgd);
    const auto before = edit_weights(policy, test::overflowing_gradient);
    edit_weights(one, test::overflowing_gradient);
    const auto error = error_of(policy, test::ones(64), fit);
    REQUIRE_THAT(error, Catch::Contains("the gradients became non-finite at epoch 1, step 1 "
                                        "under a finite loss: the gradient of layer 2 (linear) "
                                        "became inf (its weight, element 0 of 6272)"));
    REQUIRE(error == error_of(one, test::ones(64), fit));
    test::require_equal(weights_of(policy), before, "weights");
  }
}

}  // namespace

TEST_CASE("nonfinite under DataParallel: the replica that saw it names it") {
  require_faults_like_one_device<DataParallel<>, DataParallel<>>(2, {1e-7, 1e-5});
}

TEST_CASE("nonfinite under ModelSplit (GPipe): the stage that saw it names it") {
  require_faults_like_one_device<ModelSplit<At<4>, GPipe<4>>, ModelSplit<At<3>, GPipe<4>>>(
      2, {1e-6, 1e-4});
}

TEST_CASE("nonfinite under ModelSplit (1F1B): a micro-batch's outputs are looked at before its slot is reused") {
  require_faults_like_one_device<ModelSplit<At<4>, OneFOneB<4>>, ModelSplit<At<3>, OneFOneB<4>>>(
      2, {1e-6, 1e-4});
}

TEST_CASE("nonfinite under Hybrid: replicas and stages agree on the first") {
  require_faults_like_one_device<Hybrid<2, ModelSplit<At<4>, OneFOneB<2>>>,
                                 Hybrid<2, ModelSplit<At<3>, OneFOneB<2>>>>(4, {1e-6, 1e-4});
}

namespace {

// fp16 whose gradients overflow from a scale of about 2^17, bounded below
// by 2^28: steps 1 and 2 overflow and back off, step 3 overflows at the
// bound, which raises naming the first non-finite gradient, as one device does.
template <class Policy>
std::string overflow_at_min_scale(std::size_t devices) {
  using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;
  const TrainerOptions fp16{
      .seed = 1,
      .precision = Precision::fp16,
      .loss_scaling = {.initial_scale = 0x1p30f, .min_scale = 0x1p28f, .max_scale = 0x1p30f}};
  Trainer<Mlp, Policy> trainer(devices::cpu(devices), {.lr = 0.05f, .momentum = 0.9f}, fp16);
  const auto before = weights_of(trainer);
  const auto error = error_of(trainer, head(fashion().train, 1200), {.epochs = 1, .batch_size = 50});
  REQUIRE(trainer.skipped_steps() == 2);
  test::require_equal(weights_of(trainer), before, "weights");
  return error;
}

}  // namespace

TEST_CASE("nonfinite: an fp16 overflow at the minimum loss scale names its gradient under every policy") {
  const std::string named = "the gradients became non-finite at epoch 1, step 3 under a finite "
                            "loss, even at fp16's minimum loss scale 268435456 "
                            "(LossScaling::min_scale): the gradient of layer ";
  const auto one = overflow_at_min_scale<SingleDevice>(1);
  REQUIRE_THAT(one, Catch::Contains(named));
  for (const auto& [what, error] :
       {std::pair{"DataParallel", overflow_at_min_scale<DataParallel<>>(2)},
        std::pair{"ModelSplit", overflow_at_min_scale<ModelSplit<Balanced<2>, OneFOneB<2>>>(2)},
        std::pair{"Hybrid", overflow_at_min_scale<Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<2>>>>(4)}}) {
    INFO(what);
    REQUIRE_THAT(error, Catch::Contains(named) &&
                            Catch::Contains("; the weights are kept from the step before"));
  }
}
