// Hybrid across processes, run by CTest under `mpiexec -np 4`: a 2 x 2
// grid (two pipelines of two stages, one rank each) against single-device
// training, Hybrid with one stage against DataParallel over the same
// processes, the placement, and a grid that does not match the processes.
// Every rank runs every test case in the same order (they are collective).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "mpi_test.hpp"
#include "policy_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::LeNet;
using test::environment;
using test::sgd;

namespace {

comm::Comm world() { return comm::Comm(environment->world()); }

}  // namespace

TEST_CASE("mpi hybrid: four ranks") { REQUIRE(environment->size() == 4); }

TEST_CASE("mpi hybrid: 2 x 2 over 4 processes reaches the single-device weights, both schedules") {
  const auto part = test::head(test::fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit);
  for (const auto schedule : {PipelineSchedule{PipelineKind::gpipe, 4},
                              PipelineSchedule{PipelineKind::one_f_one_b, 3}}) {
    INFO(pipeline_kind_name(schedule.kind));
    Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>>>> hybrid(
        environment->devices(), sgd, {.seed = 7, .schedule = schedule}, world());
    hybrid.fit(part, fit);
    // Rank w is replica w / 2, stage w % 2.
    const auto w = static_cast<std::size_t>(environment->rank());
    REQUIRE(hybrid.model_split().local_stages() == 1);
    REQUIRE(hybrid.model_split().report(0).replica == w / 2);
    REQUIRE(hybrid.model_split().report(0).stage == w % 2);
    REQUIRE(hybrid.model_split().report(0).reduce_begin.size() >= 1);
    // Gathered at the epoch's end: every rank holds the whole network.
    test::require_close(hybrid.model().parameters(), single.model().parameters(), {1e-6, 1e-4},
                        "weights after one epoch");
    const auto a = hybrid.evaluate(test::fashion().test);
    const auto b = single.evaluate(test::fashion().test);
    REQUIRE(a.samples == 10000);
    REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
    REQUIRE(a.accuracy == Approx(b.accuracy).margin(2e-4));
  }
}

TEST_CASE("mpi hybrid: one stage on each of 4 processes trains as DataParallel") {
  const auto part = test::head(test::fashion().train, 300);
  const FitOptions fit{.epochs = 1, .batch_size = 50, .seed = 4};
  Trainer<LeNet, Hybrid<4, ModelSplit<At<>, GPipe<1>>>> hybrid(environment->devices(), sgd,
                                                                {.seed = 7}, world());
  hybrid.fit(part, fit);
  Trainer<LeNet, DataParallel<>> data_parallel(environment->devices(), sgd, {.seed = 7}, world());
  data_parallel.fit(part, fit);
  // The same sums over the same 4 ranks; MPI may pick its reduction
  // algorithm per communicator, so allow the last bits to differ.
  test::require_close(hybrid.model().parameters(), data_parallel.model().parameters(),
                      {1e-7, 1e-6}, "Hybrid<4, At<>> against DataParallel");
}

TEST_CASE("mpi hybrid: placement names each process's replica and stage") {
  Trainer<LeNet, Hybrid<2, ModelSplit<At<4>>>> hybrid(environment->devices(), sgd, {}, world());
  const auto places = hybrid.placement();
  REQUIRE(places.size() == 4);
  const int me = environment->rank();
  for (std::size_t w = 0; w < 4; ++w) {
    CHECK(places[w].replica == w / 2);
    CHECK(places[w].stage == w % 2);
    CHECK(places[w].first_layer == (w % 2 == 0 ? 1u : 4u));
    if (static_cast<int>(w) == me)
      CHECK(places[w].device == "process " + std::to_string(w) + ": cpu:" + std::to_string(w));
    else
      CHECK(places[w].device == "process " + std::to_string(w));
  }
}

TEST_CASE("mpi hybrid: a grid that does not match the processes is a clear error on every rank") {
  REQUIRE_THROWS_WITH(
      (Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<3>>>>(environment->devices(), sgd, {},
                                                          world())),
      Catch::Contains("Hybrid has 2 replicas x 3 stages = 6 ranks, one per process, but 4 "
                      "processes were started; start 6 (mpirun -np 6)"));
}
