// DataParallel on CPU worker devices against single-device training on the
// same global batches: the bucket plan, the batch split, equal weights after
// several steps (bit for bit with one worker and run to run), uneven and
// tiny batches, gradient accumulation, the overlap of all-reduce with
// backward, and failures.
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "policy_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::fashion;
using test::head;
using test::LeNet;
using test::Logistic;
using test::sgd;
using test::single_device;
using test::trained;

namespace {

template <class Net>
std::vector<float> data_parallel(int workers, const data::Dataset& data, FitOptions fit) {
  Trainer<Net, DataParallel<>> trainer(devices::cpu(workers), sgd, {.seed = 7});
  return trained(trainer, data, fit);
}

// Three clipped steps of 60 samples under DataParallel over 3 workers,
// straight on its engine over `Stages`, driven through SplitEngine (as the
// trainer drives every policy's engine on GPUs); the weights, and the
// evaluation's sums over 200 test images.
template <class Stages>
std::pair<std::vector<float>, cpu::LossSums> data_parallel_engine(const data::Dataset& train,
                                                                  const data::Dataset& test) {
  const Model<LeNet, float> initial(7);
  detail::DataParallelEngine<LeNet, DataParallel<>, SGD, SoftmaxCrossEntropy, Stages> made(
      devices::cpu(3), {}, initial, sgd, Stages{});
  detail::SplitEngine<LeNet>& engine = made;
  const Targets targets = data::targets_of(train);
  for (std::size_t step = 0; step < 3; ++step) {
    const std::size_t first = step * 60;
    engine.micro_step(train.images.data() + first * train.sample_size(), targets.from(first), 60,
                      60, false, true, {.lr = sgd.lr, .max_grad_norm = 0.5f},
                      {.training = true});
  }
  Model<LeNet, float> whole(0);
  engine.gather(whole);
  return {{whole.parameters().begin(), whole.parameters().end()},
          engine.evaluate(test, 64, Precision::fp32)};
}

}  // namespace

TEST_CASE("DataParallel over links split per direction (a GPU stage's), through SplitEngine, "
          "equals the mesh groups' bit for bit") {
  const auto train = head(fashion().train, 180);
  const auto test = head(fashion().test, 200);
  const auto [mesh_weights, mesh_sums] = data_parallel_engine<detail::HostStages>(train, test);
  const auto [own_weights, own_sums] = data_parallel_engine<test::OwnLinkStages>(train, test);
  test::require_equal(own_weights, mesh_weights, "weights after 3 clipped steps");
  REQUIRE(own_sums.loss == mesh_sums.loss);
  REQUIRE(own_sums.correct == mesh_sums.correct);
  // And the trainer's DataParallel, on its own engine, took the same steps.
  Trainer<LeNet, DataParallel<>> trainer(devices::cpu(3), sgd, {.seed = 7});
  trainer.fit(train, {.epochs = 1, .batch_size = 60, .shuffle = false, .max_grad_norm = 0.5f});
  test::require_equal(trainer.model().parameters(), mesh_weights, "the trainer's weights");
}

TEST_CASE("bucket plan: slices of the gradient buffer in reverse layer order, at compile time") {
  // LeNet's executed layers: conv1+relu (520), pool, conv2+relu (25050), pool,
  // flatten, fc1+relu (400500), fc2 (5010).
  using Mib = BucketPlan<LeNet, std::size_t{1} << 20>;
  STATIC_REQUIRE(Mib::count == 2);
  STATIC_REQUIRE(Mib::buckets[0].begin == 25570);  // fc1 and fc2: 405510 floats >= 1 MiB
  STATIC_REQUIRE(Mib::buckets[0].end == 431080);
  STATIC_REQUIRE(Mib::buckets[0].ready_after == 5);  // after fc1's backward
  STATIC_REQUIRE(Mib::buckets[1].begin == 0);
  STATIC_REQUIRE(Mib::buckets[1].end == 25570);
  STATIC_REQUIRE(Mib::buckets[1].ready_after == 0);

  using PerLayer = BucketPlan<LeNet, 1>;  // every layer with parameters alone
  STATIC_REQUIRE(PerLayer::count == 4);
  STATIC_REQUIRE(PerLayer::buckets[0].begin == 426070);
  STATIC_REQUIRE(PerLayer::buckets[0].ready_after == 6);
  STATIC_REQUIRE(PerLayer::buckets[3].size() == 520);

  using Whole = BucketPlan<LeNet, std::size_t{1} << 30>;
  STATIC_REQUIRE(Whole::count == 1);
  STATIC_REQUIRE(Whole::buckets[0].size() == LeNet::parameter_count);
  STATIC_REQUIRE(Whole::buckets[0].ready_after == 0);
}

TEST_CASE("batch split: contiguous shares, the first n % ranks ranks take one more") {
  STATIC_REQUIRE(batch_share(10, 4, 0).first == 0);
  STATIC_REQUIRE(batch_share(10, 4, 0).count == 3);
  STATIC_REQUIRE(batch_share(10, 4, 1).first == 3);
  STATIC_REQUIRE(batch_share(10, 4, 1).count == 3);
  STATIC_REQUIRE(batch_share(10, 4, 2).first == 6);
  STATIC_REQUIRE(batch_share(10, 4, 2).count == 2);
  STATIC_REQUIRE(batch_share(10, 4, 3).first == 8);
  STATIC_REQUIRE(batch_share(10, 4, 3).count == 2);
  STATIC_REQUIRE(batch_share(2, 4, 2).count == 0);
  STATIC_REQUIRE(batch_share(2, 4, 1).first == 1);
}

TEST_CASE("DataParallel on 1-4 CPU workers reaches the single-device weights") {
  // 490 samples in batches of 60: 8 full steps, then 10 (3/3/2/2 on 4 workers).
  const auto part = head(fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const auto reference = single_device<LeNet>(part, fit);
  // One worker does the same arithmetic as the single device.
  test::require_equal(data_parallel<LeNet>(1, part, fit), reference, "1 worker");
  for (int workers : {2, 3, 4}) {
    INFO(workers << " workers");
    // Gradients summed in another grouping: FP32 rounding over 9 steps.
    test::require_close(data_parallel<LeNet>(workers, part, fit), reference, {1e-6, 1e-4},
                        "weights after one epoch");
  }
}

TEST_CASE("DataParallel is bit-for-bit reproducible (LocalComm's fixed reduction order)") {
  const auto part = head(fashion().train, 300);
  const FitOptions fit{.epochs = 2, .batch_size = 50, .seed = 4};
  test::require_equal(data_parallel<LeNet>(3, part, fit), data_parallel<LeNet>(3, part, fit),
                      "two runs on 3 workers");
}

TEST_CASE("DataParallel: batches smaller than the worker count leave ranks empty, not hung") {
  const auto part = head(fashion().train, 12);
  const FitOptions fit{.epochs = 2, .batch_size = 2, .seed = 5};  // ranks 2 and 3 get nothing
  test::require_close(data_parallel<LeNet>(4, part, fit), single_device<LeNet>(part, fit),
                      {1e-6, 1e-4}, "weights after 12 steps of 2 samples");
}

TEST_CASE("gradient accumulation equals one step on the whole accumulated batch") {
  const auto part = head(fashion().train, 300);
  const auto reference = single_device<LeNet>(part, {.epochs = 1, .batch_size = 60, .seed = 6});
  const FitOptions accumulated{.epochs = 1, .batch_size = 20, .seed = 6, .accumulation_steps = 3};
  test::require_close(single_device<LeNet>(part, accumulated), reference, {1e-6, 1e-4},
                      "single device, 3 x 20");
  test::require_close(data_parallel<LeNet>(2, part, accumulated), reference, {1e-6, 1e-4},
                      "2 workers, 3 x 20");
  // 290 samples: the last step takes the 50 left (20 + 20 + 10).
  const auto uneven = head(fashion().train, 290);
  test::require_close(data_parallel<LeNet>(3, uneven, accumulated),
                      single_device<LeNet>(uneven, {.epochs = 1, .batch_size = 60, .seed = 6}),
                      {1e-6, 1e-4}, "3 workers, a short last group");
}

TEST_CASE("DataParallel reports optimizer steps and the global loss to callbacks") {
  const auto part = head(fashion().train, 250);
  std::vector<StepInfo> dp_steps, single_steps;
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  const FitOptions fit{.epochs = 1, .batch_size = 25, .seed = 8, .accumulation_steps = 2};
  Trainer<LeNet, DataParallel<>> dp(devices::cpu(2), sgd, {.seed = 7});
  dp.fit(part, fit, Record{&dp_steps});
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit, Record{&single_steps});
  REQUIRE(dp_steps.size() == 5);
  REQUIRE(single_steps.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    REQUIRE(dp_steps[i].step == i + 1);
    REQUIRE(dp_steps[i].steps == 5);
    REQUIRE(dp_steps[i].samples == 50 * (i + 1));
    REQUIRE(dp_steps[i].loss == Approx(single_steps[i].loss).epsilon(1e-5));
    REQUIRE(dp_steps[i].accuracy == single_steps[i].accuracy);
  }
  const auto a = dp.evaluate(fashion().test);
  const auto b = single.evaluate(fashion().test);
  REQUIRE(a.samples == 10000);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
  REQUIRE(a.accuracy == Approx(b.accuracy).margin(1e-4));
}

TEST_CASE("DataParallel: the first bucket's all-reduce starts before backward ends") {
  const auto part = head(fashion().train, 512);
  Trainer<LeNet, DataParallel<>> trainer(devices::cpu(2), sgd, {.seed = 7});
  trainer.fit(part, {.epochs = 1, .batch_size = 256});
  const auto& t = trainer.data_parallel().last_timeline();
  // The default 64 KiB buckets: (fc1, fc2), conv2, conv1.
  REQUIRE(t.reduce_begin.size() == 3);
  // Bucket 0 is ready after fc1's backward, before both convolutions' (most
  // of backward's work, ~20 ms here) have run.
  CHECK(t.reduce_begin[0] > t.backward_begin);
  CHECK(t.reduce_begin[0] < t.backward_end);
  // The buckets are reduced in order.
  CHECK(t.reduce_begin[1] >= t.reduce_end[0]);
  CHECK(t.reduce_begin[2] >= t.reduce_end[1]);
}

TEST_CASE("DataParallel: a NaN loss stops fit at the same step as one device, weights kept") {
  Trainer<Logistic, DataParallel<>> dp(devices::cpu(3), sgd, {.seed = 2});
  test::require_nan_stops_like_one_device(dp, {1e-7, 1e-5});
}

TEST_CASE("DataParallel: a failure on one rank is that rank's error, the others do not hang") {
  // The loader rejects bad labels before a batch reaches the replicas; the
  // engine is fed directly here so that one rank's loss fails mid-step.
  const auto part = head(fashion().train, 100);
  std::vector<std::int32_t> labels(part.labels);
  labels[77] = 12;  // sample 2 of rank 3's share (75..99)
  Trainer<Logistic, DataParallel<>> trainer(devices::cpu(4), sgd);
  auto& engine = trainer.data_parallel();
  engine.reserve(100);
  REQUIRE_THROWS_WITH(engine.micro_step(part.images.data(), labels.data(), 100, 100, false, true,
                                        {.lr = 0.01f}),
                      Catch::Contains("label 12 of sample 2 is outside the network's 10 classes"));
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 100}),
                      Catch::Contains("an earlier step failed"));
  REQUIRE_THROWS_WITH((Trainer<Logistic, DataParallel<>>({}, sgd)),
                      Catch::Contains("DataParallel needs at least one device"));
}
