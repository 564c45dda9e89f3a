// The ResNet and sequence layers under every policy, on CPU worker devices
// and real data. Dropout draws its masks from the global sample index, so a
// GRU with dropout trains to the single-device weights under DataParallel,
// ModelSplit and Hybrid. BatchNorm normalises each replica's share and each
// micro-batch on its own (as PyTorch's DDP and GPipe do), so those policies
// reproduce one device that accumulates the same pieces' gradients.
#include <cmath>
#include <limits>
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "policy_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::fashion;
using test::head;
using test::sgd;
using test::trained;

namespace {

using RowGru = Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<12>, Dropout<0.25>, Linear<16>,
                          Tanh, Linear<10>>;
using SmallResNet =
    Sequential<Input<1, 28, 28>, Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU,
               Residual<Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<4, 3, 1, 1>, BatchNorm2d>,
               ReLU, MaxPool2d<2>, Residual<Conv2d<8, 3, 2, 1>, BatchNorm2d, ReLU>, ReLU,
               GlobalAvgPool, Linear<10>>;

template <class Net, class Policy>
Trainer<Net, Policy> make(std::size_t devices) {
  auto workers = devices::cpu(devices);
  for (auto& d : workers) d.threads = 1;
  return Trainer<Net, Policy>(workers, sgd, {.seed = 7});
}

template <class Net, class Policy>
std::vector<float> weights(std::size_t devices, const data::Dataset& data, FitOptions fit) {
  auto trainer = make<Net, Policy>(devices);
  return trained(trainer, data, fit);
}

// One device (one BLAS thread, as the workers) with `accumulation` pieces per step.
template <class Net>
Trainer<Net> one_device(const data::Dataset& data, FitOptions fit) {
  auto device = devices::cpu(1);
  device.front().threads = 1;
  Trainer<Net> trainer(device, sgd, {.seed = 7});
  trainer.fit(data, fit);
  return trainer;
}

template <class Net>
std::vector<float> parameters_of(const Trainer<Net>& trainer) {
  const auto p = trainer.model().parameters();
  return {p.begin(), p.end()};
}

const test::Tolerance tolerance{1e-6, 1e-4};

}  // namespace

TEST_CASE("deep nets: a GRU with dropout trains to the single-device weights under every policy") {
  const auto part = head(fashion().train, 300);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  const auto one = one_device<RowGru>(part, fit);
  const auto reference = parameters_of(one);
  test::require_close(weights<RowGru, DataParallel<>>(3, part, fit), reference, tolerance,
                      "DataParallel over 3");
  test::require_close(weights<RowGru, ModelSplit<At<3>, OneFOneB<4>>>(2, part, fit), reference,
                      tolerance, "ModelSplit<At<3>>, 1F1B<4>");
  test::require_close(weights<RowGru, ModelSplit<At<2, 4>, GPipe<3>>>(3, part, fit), reference,
                      tolerance, "ModelSplit<At<2, 4>>, GPipe<3>");
  test::require_close(weights<RowGru, Hybrid<2, ModelSplit<At<3>, OneFOneB<2>>>>(4, part, fit),
                      reference, tolerance, "Hybrid 2 x At<3>");
  // Dropout changed the training: without it the weights differ.
  using NoDropout =
      Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<12>, Linear<16>, Tanh, Linear<10>>;
  const auto plain = parameters_of(one_device<NoDropout>(part, fit));
  REQUIRE(plain.size() == reference.size());
  REQUIRE(plain != reference);
}

TEST_CASE("deep nets: BatchNorm under DataParallel normalises each replica's share") {
  const auto part = head(fashion().train, 256);
  // Two replicas of 32 each = one device accumulating two batches of 32.
  const auto one = one_device<SmallResNet>(
      part, {.epochs = 1, .batch_size = 32, .seed = 3, .accumulation_steps = 2});
  auto data_parallel = make<SmallResNet, DataParallel<>>(2);
  data_parallel.fit(part, {.epochs = 1, .batch_size = 64, .seed = 3});
  test::require_close(data_parallel.model().parameters(), parameters_of(one), tolerance,
                      "DataParallel over 2, batch 64");
  // Replica 0's running statistics, which every replica evaluates with: one
  // device with the same weights and statistics evaluates the same.
  const auto state = data_parallel.model().state();
  REQUIRE(state.size() == SmallResNet::state_count);
  REQUIRE(state[0] != 0.0f);
  const auto test_part = head(fashion().test, 300);
  Trainer<SmallResNet> copy(devices::cpu(1), sgd, {.seed = 1});
  std::ranges::copy(data_parallel.model().parameters(), copy.model().parameters().begin());
  std::ranges::copy(state, copy.model().state().begin());
  const auto a = data_parallel.evaluate(test_part);
  const auto b = copy.evaluate(test_part);
  REQUIRE(a.accuracy == Approx(b.accuracy).margin(1e-9));
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
}

TEST_CASE("deep nets: BatchNorm under ModelSplit and Hybrid normalises each micro-batch") {
  const auto part = head(fashion().train, 256);
  // 4 micro-batches of 16 = one device accumulating 4 batches of 16, in the
  // same order: the running statistics match too.
  const auto one = one_device<SmallResNet>(
      part, {.epochs = 1, .batch_size = 16, .seed = 3, .accumulation_steps = 4});
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  auto gpipe = make<SmallResNet, ModelSplit<At<4>, GPipe<4>>>(2);
  gpipe.fit(part, fit);
  test::require_close(gpipe.model().parameters(), parameters_of(one), tolerance,
                      "ModelSplit<At<4>>, GPipe<4>");
  test::require_close(gpipe.model().state(), one.model().state(), tolerance,
                      "running statistics, GPipe");
  auto onefoneb = make<SmallResNet, ModelSplit<Balanced<3>, OneFOneB<4>>>(3);
  onefoneb.fit(part, fit);
  test::require_close(onefoneb.model().parameters(), parameters_of(one), tolerance,
                      "ModelSplit<Balanced<3>>, 1F1B<4>");
  test::require_close(onefoneb.model().state(), one.model().state(), tolerance,
                      "running statistics, 1F1B");
  // Two pipelines of two micro-batches: the same four pieces of 16.
  auto hybrid = make<SmallResNet, Hybrid<2, ModelSplit<At<4>, GPipe<2>>>>(4);
  hybrid.fit(part, fit);
  test::require_close(hybrid.model().parameters(), parameters_of(one), tolerance,
                      "Hybrid 2 x At<4>, 2 micro-batches");
}

TEST_CASE("deep nets: SyncBatchNorm under DataParallel trains as one device on the whole batch") {
  using SyncResNet = Sequential<
      Input<1, 28, 28>, Conv2d<4, 3, 1, 1>, SyncBatchNorm2d, ReLU,
      Residual<Conv2d<4, 3, 1, 1>, SyncBatchNorm2d, ReLU, Conv2d<4, 3, 1, 1>, SyncBatchNorm2d>,
      ReLU, MaxPool2d<2>, GlobalAvgPool, Linear<10>>;
  const auto part = head(fashion().train, 250);
  const FitOptions fit{.epochs = 1, .batch_size = 50, .seed = 3};
  const auto one = one_device<SyncResNet>(part, fit);
  for (std::size_t replicas : {2u, 3u}) {
    auto data_parallel = make<SyncResNet, DataParallel<>>(replicas);
    data_parallel.fit(part, fit);
    test::require_close(data_parallel.model().parameters(), parameters_of(one), tolerance,
                        "SyncBatchNorm weights");
    test::require_close(data_parallel.model().state(), one.model().state(), tolerance,
                        "SyncBatchNorm running statistics");
  }
  // An epoch whose last batch would leave a replica without samples is
  // refused before training, not left to hang; drop_last trains.
  auto data_parallel = make<SyncResNet, DataParallel<>>(2);
  REQUIRE_THROWS_WITH(
      data_parallel.fit(head(fashion().train, 5), {.epochs = 1, .batch_size = 2}),
      Catch::Contains("fit: the last batch of an epoch of 'fashion-mnist-train (first 5)' has 1 "
                      "sample(s) for 2 replicas, and SyncBatchNorm needs a sample on each; set "
                      "FitOptions::drop_last"));
  data_parallel.fit(head(fashion().train, 5), {.epochs = 1, .batch_size = 2, .drop_last = true});
}

TEST_CASE("deep nets: a skipped non-finite step keeps the running statistics of the step before") {
  // A NaN pixel in step 4 of 40-sample batches, unshuffled.
  auto part = head(fashion().train, 200);
  part.images[3 * 40 * 784 + 17] = std::numeric_limits<float>::quiet_NaN();
  const FitOptions fit{.epochs = 1, .batch_size = 40, .shuffle = false};
  // What three good steps leave.
  const auto three = one_device<SmallResNet>(head(fashion().train, 120), fit);
  const auto check = [&](auto& trainer, const char* what) {
    REQUIRE_THROWS_WITH(trainer.fit(part, fit), Catch::Contains("at epoch 1, step 4"));
    test::require_close(trainer.model().state(), three.model().state(), tolerance, what);
    for (float v : trainer.model().state()) REQUIRE(std::isfinite(v));
  };
  auto one = make<SmallResNet, SingleDevice>(1);
  check(one, "one device");
  auto data_parallel = make<SmallResNet, DataParallel<>>(2);
  data_parallel.fit(head(fashion().train, 120), {.epochs = 1, .batch_size = 40, .shuffle = false});
  // Replica 0's statistics after three steps of its halves differ from one
  // device's; what matters is that the fourth step leaves them as they were.
  std::vector<float> before(data_parallel.model().state().begin(),
                            data_parallel.model().state().end());
  auto poisoned = head(fashion().train, 40);
  poisoned.images[17] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(data_parallel.fit(poisoned, {.epochs = 1, .batch_size = 40}),
                      Catch::Contains("at epoch 1, step 1"));
  test::require_equal(data_parallel.model().state(), before, "DataParallel");
  auto split = make<SmallResNet, ModelSplit<At<4>, GPipe<2>>>(2);
  split.fit(head(fashion().train, 120), {.epochs = 1, .batch_size = 40, .shuffle = false});
  before.assign(split.model().state().begin(), split.model().state().end());
  REQUIRE_THROWS_WITH(split.fit(poisoned, {.epochs = 1, .batch_size = 40}),
                      Catch::Contains("at epoch 1, step 1"));
  test::require_equal(split.model().state(), before, "ModelSplit");
}
