// Ranks that are threads of several processes, run by CTest under
// `mpiexec -np 2`: each process gives the trainer 2 CPU worker devices, so
// the mesh has 4 ranks (process p holds ranks 2p and 2p + 1). DataParallel
// over the 4, Hybrid 2 x 2 (each process one replica's pipeline, the
// gradient buckets reduced across the processes) and ModelSplit over 4
// stages (the pipeline crosses from one process to the other between stages
// 1 and 2) reach the single-device weights; the placement, and a mesh that
// does not match processes x devices. Every rank runs every test case in
// the same order (they are collective). Also the links a GPU stage splits
// per direction from its world (detail::split_links), across processes.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
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
using test::environment;
using test::sgd;

namespace {

comm::Comm world() { return comm::Comm(environment->world()); }

// This process's two worker devices, one core each.
std::vector<Device> two_workers() {
  return {Device{Device::Kind::cpu, 0, 1}, Device{Device::Kind::cpu, 1, 1}};
}

}  // namespace

TEST_CASE("mpi threads: two processes") { REQUIRE(environment->size() == 2); }

TEST_CASE("mpi threads: every policy over 2 processes x 2 threads reaches the single-device weights") {
  const auto part = test::head(test::fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  Trainer<LeNet> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(part, fit);
  const auto b = single.evaluate(test::fashion().test);
  const test::Tolerance tolerance{1e-6, 1e-4};
  const auto p = static_cast<std::size_t>(environment->rank());

  Trainer<LeNet, DataParallel<>> data_parallel(two_workers(), sgd, {.seed = 7}, world());
  data_parallel.fit(part, fit);
  test::require_close(data_parallel.model().parameters(), single.model().parameters(), tolerance,
                      "DataParallel over 4 ranks");

  for (const auto schedule : {PipelineSchedule{PipelineKind::gpipe, 4},
                              PipelineSchedule{PipelineKind::one_f_one_b, 3}}) {
    INFO(pipeline_kind_name(schedule.kind));
    Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>>>> hybrid(
        two_workers(), sgd, {.seed = 7, .schedule = schedule}, world());
    hybrid.fit(part, fit);
    // Process p holds replica p's two stages.
    REQUIRE(hybrid.model_split().local_stages() == 2);
    for (std::size_t i = 0; i < 2; ++i) {
      REQUIRE(hybrid.model_split().report(i).replica == p);
      REQUIRE(hybrid.model_split().report(i).stage == i);
      REQUIRE(hybrid.model_split().report(i).reduce_begin.size() >= 1);
    }
    test::require_close(hybrid.model().parameters(), single.model().parameters(), tolerance,
                        "Hybrid 2 x 2 over 2 processes x 2 threads");
    const auto a = hybrid.evaluate(test::fashion().test);
    REQUIRE(a.samples == 10000);
    REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
    REQUIRE(a.accuracy == Approx(b.accuracy).margin(2e-4));
  }

  Trainer<LeNet, ModelSplit<Balanced<4>, OneFOneB<4>>> split(two_workers(), sgd, {.seed = 7},
                                                             world());
  split.fit(part, fit);
  REQUIRE(split.model_split().report(0).stage == 2 * p);
  REQUIRE(split.model_split().report(1).stage == 2 * p + 1);
  test::require_close(split.model().parameters(), single.model().parameters(), tolerance,
                      "ModelSplit over 4 stages on 2 processes x 2 threads");
}

TEST_CASE("mpi threads: ModelSplit over 4 stages through links split per direction (as GPU stages make them) equals the mesh groups' bit for bit") {
  // The pipe's pairs (1, 2) cross the processes: their communicators are
  // split from the MixedComm world, as a GPU stage splits its NCCL world.
  using Split = ModelSplit<Balanced<4>, OneFOneB<4>>;
  const auto part = test::head(test::fashion().train, 180);
  const auto own = test::engine_steps<Split, test::OwnLinkStages>(part, two_workers(), world());
  const auto mesh = test::engine_steps<Split, detail::HostStages>(part, two_workers(), world());
  test::require_equal(own, mesh, "split_links against the mesh groups over 2 x 2");
}

TEST_CASE("mpi threads: placement names each rank's process and thread") {
  Trainer<LeNet, Hybrid<2, ModelSplit<At<4>>>> hybrid(two_workers(), sgd, {}, world());
  const auto places = hybrid.placement();
  REQUIRE(places.size() == 4);
  const int me = environment->rank();
  for (std::size_t w = 0; w < 4; ++w) {
    INFO("rank " << w);
    CHECK(places[w].replica == w / 2);
    CHECK(places[w].stage == w % 2);
    const std::string where =
        "process " + std::to_string(w / 2) + " thread " + std::to_string(w % 2);
    if (static_cast<int>(w / 2) == me)
      CHECK(places[w].device == where + ": cpu:" + std::to_string(w % 2));
    else
      CHECK(places[w].device == where);
  }
}

TEST_CASE("mpi threads: a mesh that does not match processes x devices is a clear error") {
  REQUIRE_THROWS_WITH(
      (Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<3>>>>(two_workers(), sgd, {}, world())),
      Catch::Contains("Hybrid has 2 replicas x 3 stages = 6 ranks, one per device, but 2 "
                      "processes with 2 devices each make 4; start processes x devices = 6"));
}
