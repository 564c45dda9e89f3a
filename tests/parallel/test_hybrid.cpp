// Hybrid<R, ModelSplit<...>> on CPU worker devices against single-device
// training on the same global batches, and against the two policies it
// combines: with one replica it is ModelSplit, with one stage DataParallel,
// bit for bit. Also its placement, uneven and empty shares, accumulation,
// evaluation, the overlap of a stage's reduction with backward, and errors.
#include <loom/loom.hpp>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
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

template <class Net, class Policy>
std::vector<float> grid(const data::Dataset& data, FitOptions fit) {
  Trainer<Net, Policy> trainer(devices::cpu(Policy::devices_needed), sgd, {.seed = 7});
  return trained(trainer, data, fit);
}

}  // namespace

TEST_CASE("Hybrid over links split per direction (as GPU stages make them) equals the mesh groups' bit for bit") {
  // 2 replicas x 3 stages: stage 1 has a pair of each parity (its previous
  // of shift 0, its next of shift 1), and the replicas reduce over the
  // data group split from the world; clipping scales through the stage.
  using Grid = Hybrid<2, ModelSplit<Balanced<3>, OneFOneB<4>>>;
  const auto part = head(fashion().train, 180);
  const auto own = test::engine_steps<Grid, test::OwnLinkStages>(part, devices::cpu(6), {});
  const auto mesh = test::engine_steps<Grid, detail::HostStages>(part, devices::cpu(6), {});
  test::require_equal(own, mesh, "split_links against the mesh groups");
  const Model<LeNet, float> initial(7);
  REQUIRE(own != std::vector<float>(initial.parameters().begin(), initial.parameters().end()));
}

TEST_CASE("Hybrid: the grid's shape at compile time") {
  using H = Hybrid<3, ModelSplit<At<4, 8>, GPipe<2>>>;
  STATIC_REQUIRE(H::replicas == 3);
  STATIC_REQUIRE(H::stages == 3);
  STATIC_REQUIRE(H::devices_needed == 9);
  STATIC_REQUIRE(H::schedule.kind == PipelineKind::gpipe);
  STATIC_REQUIRE(H::schedule.micro_batches == 2);
  STATIC_REQUIRE(is_pipelined<H>);
  STATIC_REQUIRE(is_pipelined<ModelSplit<At<4>>>);
  STATIC_REQUIRE(!is_pipelined<DataParallel<>>);
  STATIC_REQUIRE(Hybrid<2, ModelSplit<At<>>>::stages == 1);
}

TEST_CASE("Mesh: one placement, tensor innermost, data outermost, and its groups") {
  constexpr Mesh mesh{.data = 2, .pipe = 3, .tensor = 2};
  STATIC_REQUIRE(mesh.size() == 12);
  STATIC_REQUIRE(mesh.coordinates(0) == MeshCoordinates{0, 0, 0});
  STATIC_REQUIRE(mesh.coordinates(1) == MeshCoordinates{0, 0, 1});
  STATIC_REQUIRE(mesh.coordinates(2) == MeshCoordinates{0, 1, 0});
  STATIC_REQUIRE(mesh.coordinates(6) == MeshCoordinates{1, 0, 0});
  STATIC_REQUIRE(mesh.coordinates(11) == MeshCoordinates{1, 2, 1});
  for (std::size_t w = 0; w < mesh.size(); ++w) REQUIRE(mesh.rank(mesh.coordinates(w)) == w);
  REQUIRE(mesh.describe() == "data 2 x pipe 3 x tensor 2");
  // Hybrid's grid is the mesh with tensor 1: rank w is replica w / S, stage w % S.
  constexpr Mesh grid{.data = 3, .pipe = 2};
  for (std::size_t w = 0; w < grid.size(); ++w) {
    REQUIRE(grid.coordinates(w).data == w / 2);
    REQUIRE(grid.coordinates(w).pipe == w % 2);
  }

  // Each rank's group along an axis: the ranks that differ from it only
  // there, ranked by their coordinate. On 12 threads, each rank sums
  // (1 << w) over every group; the sum names the group's members.
  const std::size_t ranks = mesh.size();
  auto comms = comm::LocalComm::create(static_cast<int>(ranks));
  std::vector<std::array<std::uint64_t, 3>> sums(ranks);
  std::vector<std::array<int, 3>> group_ranks(ranks), group_sizes(ranks);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < ranks; ++w) threads.emplace_back([&, w] {
    MeshGroups groups = split_mesh(comm::Comm(comms[w]), mesh);
    for (std::size_t a = 0; a < 3; ++a) {
      comm::Comm& group = groups.along(mesh_axes[a]);
      std::array<std::uint64_t, 1> bit{std::uint64_t{1} << w};
      group.all_reduce(std::span<std::uint64_t>(bit), comm::ReduceOp::sum);
      sums[w][a] = bit[0];
      group_ranks[w][a] = group.rank();
      group_sizes[w][a] = group.size();
    }
  });
  for (auto& thread : threads) thread.join();
  for (std::size_t w = 0; w < ranks; ++w) {
    const MeshCoordinates at = mesh.coordinates(w);
    for (std::size_t a = 0; a < 3; ++a) {
      const MeshAxis axis = mesh_axes[a];
      INFO("rank " << w << ", axis " << axis_name(axis));
      std::uint64_t members = 0;
      for (std::size_t v = 0; v < ranks; ++v) {
        const MeshCoordinates other = mesh.coordinates(v);
        bool same = true;
        for (const MeshAxis b : mesh_axes) same = same && (b == axis || other[b] == at[b]);
        if (same) members |= std::uint64_t{1} << v;
      }
      CHECK(sums[w][a] == members);
      CHECK(group_ranks[w][a] == static_cast<int>(at[axis]));
      CHECK(group_sizes[w][a] == static_cast<int>(mesh.extent(axis)));
    }
  }
}

TEST_CASE("Hybrid 2x2 on 4 CPU workers reaches the single-device weights, both schedules") {
  // 490 samples in batches of 60: each replica pipelines 30 (the last step: 5 each).
  const auto part = head(fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const auto reference = single_device<LeNet>(part, fit);
  const test::Tolerance tolerance{1e-6, 1e-4};
  test::require_close(grid<LeNet, Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(part, fit),
                      reference, tolerance, "2 x Balanced<2>, 1F1B<4>");
  test::require_close(grid<LeNet, Hybrid<2, ModelSplit<At<4>, GPipe<3>>>>(part, fit), reference,
                      tolerance, "2 x At<4>, GPipe<3>");
  // Uneven shares: 60 = 20 + 20 + 20, the last step's 10 = 4 + 3 + 3.
  test::require_close(grid<LeNet, Hybrid<3, ModelSplit<At<7>, OneFOneB<2>>>>(part, fit),
                      reference, tolerance, "3 x At<7>, 1F1B<2>");
}

TEST_CASE("Hybrid 2x2 as 2 processes x 2 threads (a LocalComm standing in for MPI) reaches the single-device weights") {
  // Each "process" is a thread holding a Trainer over 2 worker devices and
  // its rank of a 2-rank LocalComm: the mesh's 4 ranks are MixedComm
  // threads, as under mpirun -np 2 with 2 devices each (and so under TSan).
  const auto part = head(fashion().train, 250);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const auto reference = single_device<LeNet>(part, fit);
  auto processes = comm::LocalComm::create(2);
  std::vector<std::vector<float>> weights(2);
  std::vector<std::string> errors(2);
  std::vector<std::vector<Placement>> places(2);
  std::vector<std::thread> threads;
  for (std::size_t p = 0; p < 2; ++p) threads.emplace_back([&, p] {
    try {
      Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<3>>>> trainer(
          {Device{Device::Kind::cpu, 0, 1}, Device{Device::Kind::cpu, 1, 1}}, sgd, {.seed = 7},
          comm::Comm(processes[p]));
      weights[p] = trained(trainer, part, fit);
      places[p] = trainer.placement();
    } catch (const std::exception& error) {
      errors[p] = error.what();
    }
  });
  for (auto& thread : threads) thread.join();
  for (std::size_t p = 0; p < 2; ++p) {
    INFO("process " << p);
    REQUIRE(errors[p].empty());
    test::require_close(weights[p], reference, {1e-6, 1e-4}, "Hybrid over 2 x 2 threads");
    REQUIRE(places[p].size() == 4);
    CHECK(places[p][1].device == (p == 0 ? "process 0 thread 1: cpu:1" : "process 0 thread 1"));
    CHECK(places[p][2].replica == 1);
    CHECK(places[p][2].stage == 0);
  }
}

TEST_CASE("Hybrid<1, Split> is ModelSplit and Hybrid<R, one stage> is DataParallel, bit for bit") {
  const auto part = head(fashion().train, 300);
  const FitOptions fit{.epochs = 2, .batch_size = 50, .seed = 4};
  using Split = ModelSplit<At<4, 7>, OneFOneB<4>>;
  Trainer<LeNet, Split> split(devices::cpu(3), sgd, {.seed = 7});
  test::require_equal(grid<LeNet, Hybrid<1, Split>>(part, fit), trained(split, part, fit),
                      "Hybrid<1, ModelSplit<At<4, 7>>> against ModelSplit");
  // One stage and one micro-batch: each replica runs DataParallel's arithmetic,
  // and the stage's copies sum in the same rank order.
  Trainer<LeNet, DataParallel<>> data_parallel(devices::cpu(2), sgd, {.seed = 7});
  test::require_equal(grid<LeNet, Hybrid<2, ModelSplit<At<>, GPipe<1>>>>(part, fit),
                      trained(data_parallel, part, fit),
                      "Hybrid<2, ModelSplit<At<>>> against DataParallel over 2");
}

// Hybrid<replicas_from_devices, Split> over R x S devices against Hybrid<R, Split>
// (the same engine type: the grid's values must be its) and against one device.
template <std::size_t R, class Split>
void require_same_as_fixed_grid(const data::Dataset& part, const FitOptions& fit,
                                const std::vector<float>& one_device) {
  Trainer<LeNet, Hybrid<replicas_from_devices, Split>> trainer(devices::cpu(R * Split::stages),
                                                               sgd, {.seed = 7});
  REQUIRE(trainer.model_split().replicas() == R);
  // One replica is a ModelSplit, and says so.
  REQUIRE(std::string(trainer.policy_name()) == (R == 1 ? "ModelSplit" : "Hybrid"));
  const auto places = trainer.placement();
  REQUIRE(places.size() == R * Split::stages);
  REQUIRE(places.back().replica == R - 1);
  REQUIRE(places.back().stage == Split::stages - 1);
  const auto weights = trained(trainer, part, fit);
  const std::string what = "replicas_from_devices, " + std::to_string(R) + " replica(s)";
  test::require_equal(weights, grid<LeNet, Hybrid<R, Split>>(part, fit), what + " vs Hybrid<R>");
  test::require_close(weights, one_device, {1e-6, 1e-4}, what + " vs one device");
}

TEST_CASE("Hybrid<replicas_from_devices, Split>: R from the devices, the numbers of Hybrid<R>") {
  using Split = ModelSplit<Balanced<2>, OneFOneB<4>>;
  using Any = Hybrid<replicas_from_devices, Split>;
  STATIC_REQUIRE(Any::replicas == 0);
  STATIC_REQUIRE(Any::devices_needed == 0);
  const auto part = head(fashion().train, 250);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const auto reference = single_device<LeNet>(part, fit);
  require_same_as_fixed_grid<1, Split>(part, fit, reference);
  require_same_as_fixed_grid<2, Split>(part, fit, reference);
  require_same_as_fixed_grid<3, Split>(part, fit, reference);
  REQUIRE_THROWS_WITH((Trainer<LeNet, Any>(devices::cpu(5), sgd)),
                      Catch::Contains("Hybrid<replicas_from_devices, ...> runs pipelines of 2 "
                                      "stages, one device (or process) per stage: give a "
                                      "multiple of 2, not 5"));
  // Every pipelined policy over one cut runs one engine type: the grid,
  // schedule and bucket size are values.
  using Engine = decltype(std::declval<Trainer<LeNet, Any>&>().model_split());
  STATIC_REQUIRE(std::is_same_v<
                 Engine, decltype(std::declval<Trainer<LeNet, ModelSplit<Balanced<2>, GPipe<8>>>&>()
                                      .model_split())>);
  STATIC_REQUIRE(std::is_same_v<
                 Engine, decltype(std::declval<Trainer<LeNet, Hybrid<3, Split, 1024>>&>()
                                      .model_split())>);
}

TEST_CASE("Hybrid: reproducible, a replica without samples adds zeros, accumulation") {
  using H = Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>;
  const auto part = head(fashion().train, 200);
  const FitOptions fit{.epochs = 1, .batch_size = 40, .seed = 5};
  test::require_equal(grid<LeNet, H>(part, fit), grid<LeNet, H>(part, fit), "two runs");
  // Batches of one sample: replica 1 has none in every step.
  const auto tiny = head(fashion().train, 6);
  const FitOptions single_samples{.epochs = 2, .batch_size = 1, .seed = 5};
  test::require_close(grid<LeNet, H>(tiny, single_samples),
                      single_device<LeNet>(tiny, single_samples), {1e-6, 1e-4},
                      "12 steps of one sample");
  const auto more = head(fashion().train, 290);
  const FitOptions accumulated{.epochs = 1, .batch_size = 20, .seed = 6, .accumulation_steps = 3};
  test::require_close(grid<LeNet, H>(more, accumulated),
                      single_device<LeNet>(more, {.epochs = 1, .batch_size = 60, .seed = 6}),
                      {1e-6, 1e-4}, "3 x 20 per step, a short last group");
}

TEST_CASE("Hybrid: callbacks' loss and evaluation match one device") {
  Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>, GPipe<4>>>> hybrid(devices::cpu(4), sgd,
                                                                      {.seed = 7});
  test::require_same_reports(hybrid, head(fashion().train, 290),
                             {.epochs = 1, .batch_size = 50, .seed = 8}, fashion().test, 6);
}

TEST_CASE("Hybrid: placement lists each device's replica, stage and layers") {
  Trainer<LeNet, Hybrid<2, ModelSplit<At<4>>>> trainer(devices::cpu(4), sgd);
  const auto places = trainer.placement();
  REQUIRE(places.size() == 4);
  const std::vector<std::vector<std::size_t>> expected{
      {0, 0, 1, 3}, {0, 1, 4, 10}, {1, 0, 1, 3}, {1, 1, 4, 10}};
  for (std::size_t w = 0; w < 4; ++w) {
    INFO("rank " << w);
    CHECK(places[w].rank == w);
    CHECK(places[w].device == "cpu:" + std::to_string(w));
    CHECK(places[w].replica == expected[w][0]);
    CHECK(places[w].stage == expected[w][1]);
    CHECK(places[w].first_layer == expected[w][2]);
    CHECK(places[w].last_layer == expected[w][3]);
  }
  REQUIRE(describe_placement(places) ==
          "  cpu:0  replica 0  stage 0  layers 1-3\n"
          "  cpu:1  replica 0  stage 1  layers 4-10\n"
          "  cpu:2  replica 1  stage 0  layers 1-3\n"
          "  cpu:3  replica 1  stage 1  layers 4-10\n");
  // Progress prints it when fit begins.
  std::ostringstream out;
  trainer.fit(head(fashion().train, 64), {.epochs = 1, .batch_size = 64},
              callbacks::Progress({.out = &out}));
  REQUIRE_THAT(out.str(), Catch::Contains("placement (Hybrid):\n  cpu:0  replica 0  stage 0"));
  // Other policies: DataParallel's replicas hold every layer.
  Trainer<LeNet, DataParallel<>> data_parallel(devices::cpu(2), sgd);
  REQUIRE(describe_placement(data_parallel.placement()) ==
          "  cpu:0  replica 0  stage 0  layers 1-10\n"
          "  cpu:1  replica 1  stage 0  layers 1-10\n");
}

TEST_CASE("Hybrid: a stage's gradients go to be reduced while backward still runs") {
  const auto part = head(fashion().train, 512);
  // Stage 0: conv1 .. pool2, gradients in two 64 KiB buckets (conv2, conv1);
  // stage 1: the Linears, one bucket.
  Trainer<LeNet, Hybrid<2, ModelSplit<At<7>, GPipe<4>>>> trainer(devices::cpu(4), sgd,
                                                                 {.seed = 7});
  trainer.fit(part, {.epochs = 1, .batch_size = 256});
  const auto first = trainer.model_split().report(0), second = trainer.model_split().report(1);
  REQUIRE(first.stage == 0);
  REQUIRE(second.stage == 1);
  REQUIRE(first.reduce_begin.size() == 2);
  REQUIRE(second.reduce_begin.size() == 1);
  // conv2's bucket goes to the communication thread while conv1 still
  // back-propagates (whether that thread gets a core then is the
  // scheduler's: model_split_bench measures the overlap) ...
  CHECK(first.reduce_posted[0] < first.end);
  CHECK(first.reduce_begin[0] >= first.reduce_posted[0]);
  CHECK(first.reduce_begin[1] >= first.reduce_end[0]);
  // ... and the Linears' before stage 0 has even received its last gradient.
  CHECK(second.reduce_posted[0] < first.end);
  REQUIRE(trainer.model_split().report(2).replica == 1);
  // ModelSplit reduces nothing.
  Trainer<LeNet, ModelSplit<At<7>>> split(devices::cpu(2), sgd);
  split.fit(head(part, 64), {.epochs = 1, .batch_size = 64});
  REQUIRE(split.model_split().report(0).reduce_begin.empty());
}

TEST_CASE("Hybrid: a NaN loss stops fit at the same step as one device, weights kept") {
  Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>> hybrid(devices::cpu(4), sgd,
                                                                         {.seed = 2});
  test::require_nan_stops_like_one_device(hybrid, {1e-6, 1e-4});
}

TEST_CASE("Hybrid: wrong device counts and a failing rank are clear errors, not hangs") {
  REQUIRE_THROWS_WITH((Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>>>>(devices::cpu(3), sgd)),
                      Catch::Contains("Hybrid runs on 4 device(s) (2 replicas x 2 stages) but 3 "
                                      "were given"));
  const auto part = head(fashion().train, 100);
  std::vector<std::int32_t> labels(part.labels);
  labels[80] = 12;  // replica 1's share (50..99), its micro-batch 2 (76..87)
  Trainer<LeNet, Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>> trainer(devices::cpu(4), sgd);
  auto& engine = trainer.model_split();
  REQUIRE_THROWS_WITH(engine.micro_step(part.images.data(), labels.data(), 100, 100, false, true,
                                        {.lr = 0.01f}),
                      Catch::Contains("label 12 of sample 4 is outside the network's 10 classes"));
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 100}),
                      Catch::Contains("an earlier step failed"));
}

TEST_CASE("Balanced<2, 3, 4>: one trainer type, the stage count from the devices, the numbers of Balanced<S>") {
  using Any = Balanced<2, 3, 4>;
  STATIC_REQUIRE(Any::stages == 0);
  STATIC_REQUIRE(ModelSplit<Any>::devices_needed == 0);
  STATIC_REQUIRE(Hybrid<2, ModelSplit<Any>>::devices_needed == 0);
  STATIC_REQUIRE(Balanced<3>::stages == 3);
  STATIC_REQUIRE(Balanced<3>::stage_counts.size() == 1);
  constexpr auto three = partition_bounds<LeNet, Balanced<3>>::bounds;
  REQUIRE(cut_bounds<LeNet, Any>(3) == std::vector<std::size_t>(three.begin(), three.end()));
  REQUIRE(cut_bounds<LeNet, Any>(5).empty());
  REQUIRE(stage_counts_text<Any>() == "2, 3 or 4");
  REQUIRE(stage_counts_text<Balanced<2, 4>>() == "2 or 4");

  const auto part = head(fashion().train, 240);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  for (const std::size_t stages : {2u, 3u, 4u}) {
    Trainer<LeNet, ModelSplit<Any>> trainer(devices::cpu(stages), sgd, {.seed = 7});
    REQUIRE(trainer.placement().size() == stages);
    const auto weights = trained(trainer, part, fit);
    const auto expected = stages == 2   ? grid<LeNet, ModelSplit<Balanced<2>>>(part, fit)
                          : stages == 3 ? grid<LeNet, ModelSplit<Balanced<3>>>(part, fit)
                                        : grid<LeNet, ModelSplit<Balanced<4>>>(part, fit);
    test::require_equal(weights, expected,
                        "Balanced<2, 3, 4> on " + std::to_string(stages) + " devices");
  }

  // Hybrid<replicas_from_devices, ...>: TrainerOptions::replicas lays the
  // devices out, the stages are the rest.
  Trainer<LeNet, Hybrid<replicas_from_devices, ModelSplit<Any>>> hybrid(
      devices::cpu(6), sgd, {.seed = 7, .replicas = 2});
  REQUIRE(std::string(hybrid.policy_name()) == "Hybrid");
  const auto places = hybrid.placement();
  REQUIRE(places.size() == 6);
  REQUIRE(places.back().replica == 1);
  REQUIRE(places.back().stage == 2);
  REQUIRE(places.back().first_layer == three[2] + 1);
  test::require_equal(trained(hybrid, part, fit),
                      grid<LeNet, Hybrid<2, ModelSplit<Balanced<3>>>>(part, fit),
                      "Hybrid of Balanced<2, 3, 4>, 2 replicas on 6 devices");
  // Without a replica count, one pipeline of all the devices.
  Trainer<LeNet, Hybrid<replicas_from_devices, ModelSplit<Any>>> one(devices::cpu(4), sgd);
  REQUIRE(std::string(one.policy_name()) == "ModelSplit");
  REQUIRE(one.placement().back().stage == 3);

  REQUIRE_THROWS_WITH((Trainer<LeNet, ModelSplit<Balanced<2, 4>>>(devices::cpu(3), sgd)),
                      Catch::Contains("ModelSplit runs pipelines of 2 or 4 stages, one device (or "
                                      "process) per stage, 1 pipeline: give that many devices (or "
                                      "processes), not 3"));
  REQUIRE_THROWS_WITH((Trainer<LeNet, Hybrid<replicas_from_devices, ModelSplit<Any>>>(
                          devices::cpu(10), sgd, {.replicas = 2})),
                      Catch::Contains("Hybrid runs pipelines of 2, 3 or 4 stages, one device (or "
                                      "process) per stage, 2 pipelines: give 2 x that many "
                                      "devices (or processes), not 10"));
  REQUIRE_THROWS_WITH(
      (Trainer<LeNet, Hybrid<2, ModelSplit<Any>>>(devices::cpu(6), sgd, {.replicas = 3})),
      Catch::Contains("Hybrid runs 2 replica(s), not the 3 asked for"));
}
