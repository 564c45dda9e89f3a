// Sequences of skewed lengths across processes, run by CTest under
// `mpiexec -np 3`: DataParallel with CTCLoss and batches bucketed by length
// (FitOptions::bucket) over 3 processes takes the same steps on every rank
// and reaches one device's weights; a rank with another bucket is refused.
// Every rank runs every test case in the same order (they are collective).
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "garment_sequences.hpp"
#include "loom_test.hpp"
#include "mpi_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::environment;

namespace {

using Reader = Sequential<Input<56, 28>, Linear<32>, ReLU, Linear<24>, ReLU, Linear<11>>;
const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};

// 200 garment pairs whose frames follow a long tail: 4 / u^(2/3) for u
// uniform in (0, 1], at most 56 (most under 10, one in twenty over 30).
const data::Dataset& skewed() {
  static const data::Dataset set = [] {
    data::Dataset s = test::garment_sequences(test::fashion().train, 200);
    for (std::size_t i = 0; i < s.count; ++i)
      s.frames[i] = static_cast<std::int32_t>(
          std::clamp(4.0 * std::pow(1.0 - uniform01(21, 0, i), -2.0 / 3.0), 4.0, 56.0));
    return s;
  }();
  return set;
}

// Batches of 40 (14, 13 and 13 a rank) from buckets of 2: 5 steps an epoch.
const FitOptions bucketed{.epochs = 2, .batch_size = 40, .seed = 6, .bucket = 2};

std::vector<Device> one_thread(std::vector<Device> devices) {
  for (Device& d : devices) d.threads = 1;
  return devices;
}

}  // namespace

TEST_CASE("mpi sequences: three ranks") { REQUIRE(environment->size() == 3); }

TEST_CASE("mpi sequences: bucketed CTC batches over 3 processes take the same steps and weights") {
  struct Steps {
    void on_step(const StepInfo&) { *count += 1; }
    std::size_t* count;
  };
  std::size_t steps = 0;
  Trainer<Reader, DataParallel<>, SGD, CTCLoss> distributed(
      one_thread(environment->devices()), sgd, {.seed = 11}, comm::Comm(environment->world()));
  distributed.fit(skewed(), bucketed, Steps{&steps});
  REQUIRE(steps == 10);
  REQUIRE(distributed.steps() == 10);
  // Every rank took as many: the counts' sum and sum of squares over the
  // 3 ranks are those of three 10s only when each is 10.
  auto world = environment->world();
  const auto n = static_cast<double>(steps);
  std::vector<double> sums{n, n * n};
  world.all_reduce(std::span<double>(sums), comm::ReduceOp::sum);
  REQUIRE(sums[0] == 30.0);
  REQUIRE(sums[1] == 300.0);

  Trainer<Reader, SingleDevice, SGD, CTCLoss> single(devices::cpu(1), sgd, {.seed = 11});
  single.fit(skewed(), bucketed);
  test::require_close(distributed.model().parameters(), single.model().parameters(), {1e-6, 1e-4},
                      "weights after two bucketed epochs");
  // The replicas are the same bits on every rank.
  std::vector<float> from_rank_0(distributed.model().parameters().begin(),
                                 distributed.model().parameters().end());
  world.broadcast(std::span<float>(from_rank_0), 0);
  test::require_equal(distributed.model().parameters(), from_rank_0, "rank 0's replica");
}

TEST_CASE("mpi sequences: a rank with another bucket is refused on every rank, naming fit.bucket") {
  FitOptions mine = bucketed;
  if (environment->rank() == 2) mine.bucket = 3;
  Trainer<Reader, DataParallel<>, SGD, CTCLoss> trainer(
      one_thread(environment->devices()), sgd, {.seed = 11}, comm::Comm(environment->world()));
  REQUIRE_THROWS_WITH(trainer.fit(skewed(), mine),
                      Catch::Contains("the processes disagree on fit.bucket: ranks 0 1 has 2, "
                                      "rank 2 has 3"));
  REQUIRE(trainer.steps() == 0);
}
