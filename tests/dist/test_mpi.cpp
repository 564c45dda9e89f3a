// The multi-process path, run by CTest under `mpiexec -np 2`: MpiComm's
// collectives, DataParallel and ModelSplit across processes against
// single-device training, and ranks that disagree on the network or count. Every rank runs every test case in
// the same order (they are collective); CTest's timeout turns a hang into a
// failure.
#define CATCH_CONFIG_RUNNER
#include <unistd.h>

#include <array>
#include <catch2/catch.hpp>
#include <filesystem>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "mpi_test.hpp"
#include "policy_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::LeNet;
using test::Logistic;
using test::environment;
using test::sgd;

TEST_CASE("mpi: two ranks, one node") {
  REQUIRE(environment->size() == 2);
  REQUIRE(environment->local_size() == 2);
  REQUIRE(environment->local_rank() == environment->rank());
  const auto devices = environment->devices();
  REQUIRE(devices.size() == 1);
  REQUIRE(devices[0].kind == Device::Kind::cpu);
}

TEST_CASE("mpi: all_reduce, broadcast, send/recv and split between processes") {
  auto world = environment->world();
  const int r = world.rank();
  std::vector<float> f{1.0f + r, 10.0f * (r + 1)};
  world.all_reduce(std::span<float>(f), comm::ReduceOp::sum);
  REQUIRE(f == std::vector<float>{3.0f, 30.0f});
  std::vector<double> d{2.0 * r, 1.0};
  world.all_reduce(std::span<double>(d), comm::ReduceOp::average);
  REQUIRE(d == std::vector<double>{1.0, 1.0});
  std::vector<std::uint64_t> u{std::uint64_t(r) << 40, 1};
  world.all_reduce(std::span<std::uint64_t>(u), comm::ReduceOp::sum);
  REQUIRE(u == std::vector<std::uint64_t>{std::uint64_t{1} << 40, 2});

  std::vector<float> shared(5, 0.0f);
  if (r == 1) shared = test::random_vector<float>(5, 3);
  world.broadcast(std::span<float>(shared), 1);
  test::require_equal(shared, test::random_vector<float>(5, 3), "broadcast from rank 1");

  std::vector<float> got(3);
  const std::vector<float> mine{float(r), float(r) + 0.25f, -1.0f};
  if (r == 0) {
    world.send(std::span<const float>(mine), 1);
    world.recv(std::span<float>(got), 1);
  } else {
    world.recv(std::span<float>(got), 0);
    world.send(std::span<const float>(mine), 0);
  }
  const float other = float(1 - r);
  REQUIRE(got == std::vector<float>{other, other + 0.25f, -1.0f});
  world.barrier();

  auto alone = world.split(r, 0);  // one group per rank
  REQUIRE(alone.size() == 1);
  REQUIRE(alone.rank() == 0);
  std::vector<float> x{5.0f};
  alone.all_reduce(std::span<float>(x), comm::ReduceOp::sum);
  REQUIRE(x[0] == 5.0f);
}

TEST_CASE("mpi: a message of the wrong length is a loom::Error naming the call and ranks") {
  auto world = environment->world();
  if (world.rank() == 0) {
    const std::vector<float> four(4, 1.0f);
    world.send(std::span<const float>(four), 1);
  } else {
    std::vector<float> five(5);
    REQUIRE_THROWS_WITH(world.recv(std::span<float>(five), 0),
                        Catch::Contains("MPI_Recv on rank 1 of 2: rank 0 sent 4 values but 5 "
                                        "were expected"));
  }
  world.barrier();  // both ranks go on together
}

TEST_CASE("mpi: DataParallel over 2 processes reaches the single-device weights") {
  const auto part = test::head(test::fashion().train, 490);  // 8 steps of 60, then 10
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  Trainer<LeNet, DataParallel<>> distributed(environment->devices(), sgd, {.seed = 7},
                                             comm::Comm(environment->world()));
  distributed.fit(part, fit);
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit);
  test::require_close(distributed.model().parameters(), single.model().parameters(),
                      {1e-6, 1e-4}, "weights after one epoch");
  // The replicas are the same bits on both ranks.
  std::vector<float> from_rank_0(distributed.model().parameters().begin(),
                                 distributed.model().parameters().end());
  auto world = environment->world();
  world.broadcast(std::span<float>(from_rank_0), 0);
  test::require_equal(distributed.model().parameters(), from_rank_0, "rank 0's replica");
  const auto a = distributed.evaluate(test::fashion().test);
  const auto b = single.evaluate(test::fashion().test);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
  REQUIRE(a.accuracy == Approx(b.accuracy).margin(2e-4));
}

TEST_CASE("mpi: ModelSplit over 2 processes reaches the single-device weights, both schedules") {
  const auto part = test::head(test::fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit);
  for (const auto schedule : {PipelineSchedule{PipelineKind::gpipe, 4},
                              PipelineSchedule{PipelineKind::one_f_one_b, 6}}) {
    INFO(pipeline_kind_name(schedule.kind));
    // Rank 0 runs stage 0 (the convolutions), rank 1 stage 1.
    Trainer<LeNet, ModelSplit<Balanced<2>>> pipeline(
        environment->devices(), sgd, {.seed = 7, .schedule = schedule},
        comm::Comm(environment->world()));
    pipeline.fit(part, fit);
    REQUIRE(pipeline.model_split().local_stages() == 1);
    REQUIRE(pipeline.model_split().report(0).stage == static_cast<std::size_t>(environment->rank()));
    // Gathered at the epoch's end: every rank holds both stages' weights.
    test::require_close(pipeline.model().parameters(), single.model().parameters(), {1e-6, 1e-4},
                        "weights after one epoch");
    const auto a = pipeline.evaluate(test::fashion().test);
    const auto b = single.evaluate(test::fashion().test);
    REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
    REQUIRE(a.accuracy == Approx(b.accuracy).margin(2e-4));
  }
}

TEST_CASE("mpi: ModelSplit with more stages than processes is a clear error on every rank") {
  REQUIRE_THROWS_WITH((Trainer<LeNet, ModelSplit<Balanced<3>>>(environment->devices(), sgd, {},
                                                               comm::Comm(environment->world()))),
                      Catch::Contains("ModelSplit has 3 stages, one per process, but 2 processes "
                                      "were started"));
}

TEST_CASE("mpi: ranks that train different networks stop with a clear error, not a hang") {
  const auto make = [] {
    if (environment->rank() == 0)
      Trainer<LeNet, DataParallel<>> trainer(environment->devices(), sgd, {},
                                             comm::Comm(environment->world()));
    else
      Trainer<Logistic, DataParallel<>> trainer(environment->devices(), sgd, {},
                                                comm::Comm(environment->world()));
  };
  REQUIRE_THROWS_WITH(make(), Catch::Contains("trains a different network, policy or optimizer "
                                              "than rank " +
                                              std::to_string(environment->rank())) &&
                                  Catch::Contains("Start every rank from the same program"));
}

TEST_CASE("mpi: checkpoints across processes: rank 0 writes, every rank loads, a failure stops all") {
  auto world = environment->world();
  // One folder for both processes (one node): named by rank 0's process id.
  std::array<double, 1> id{static_cast<double>(::getpid())};
  world.broadcast(std::span<double>(id), 0);
  const auto folder = std::filesystem::temp_directory_path() /
                      ("loom-mpi-checkpoint-" + std::to_string(static_cast<long>(id[0])));
  if (environment->rank() == 0) std::filesystem::create_directories(folder);
  world.barrier();
  const std::string path = (folder / "split.safetensors").string();

  const auto part = test::head(test::fashion().train, 480);  // 8 steps of 60
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  {
    // ModelSplit over the 2 processes stops after step 5 and saves: the
    // stages' weights and momentum are gathered, rank 0 writes.
    Trainer<LeNet, ModelSplit<Balanced<2>>> first(environment->devices(), sgd, {.seed = 7},
                                                  comm::Comm(environment->world()));
    first.fit(part, fit, callbacks::Checkpoint({.path = path, .every_steps = 5,
                                                .every_epoch = false, .at_end = false}));
    REQUIRE_THROWS_WITH(first.save((folder / "missing" / "x.safetensors").string()),
                        Catch::Contains("x.safetensors"));
  }
  // Every rank reads it: DataParallel over the processes finishes the epoch
  // and reaches what one device reaches uninterrupted.
  Trainer<LeNet, DataParallel<>> second(environment->devices(), sgd, {.seed = 1},
                                        comm::Comm(environment->world()));
  second.load(path);
  REQUIRE(second.steps() == 5);
  second.fit(part, fit);
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit);
  test::require_close(second.model().parameters(), single.model().parameters(), {1e-6, 1e-4},
                      "weights after the resumed epoch");
  // Each rank loads a path of its own, and only rank 0's exists: rank 0
  // must not go on alone.
  const std::string mine = (folder / ("rank-" + std::to_string(environment->rank()))).string();
  if (environment->rank() == 0) std::filesystem::copy_file(path, mine);
  world.barrier();
  REQUIRE_THROWS_WITH(second.load(mine),
                      Catch::Contains(environment->rank() == 0 ? "another process could not read"
                                                                : "rank-1"));
  // Two different checkpoints: refused on both ranks rather than diverging.
  const std::string end = (folder / "end.safetensors").string();
  second.save(end);
  REQUIRE_THROWS_WITH(second.load(environment->rank() == 0 ? path : end),
                      Catch::Contains("is not the same file on every process"));
  world.barrier();
  if (environment->rank() == 0) std::filesystem::remove_all(folder);
}
