// The multi-process path, run by CTest under `mpiexec -np 2`: MpiComm's
// collectives and the line a late call prints, DataParallel and ModelSplit
// across processes against single-device training, and ranks that disagree on the network or count. Every rank runs every test case in
// the same order (they are collective); CTest's timeout turns a hang into a
// failure.
#define CATCH_CONFIG_RUNNER
#include <unistd.h>

#include <array>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <iostream>
#include <loom/loom.hpp>
#include <sstream>
#include <string>
#include <thread>
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

TEST_CASE("mpi: reduce_scatter and all_gather between processes, directly and through Comm") {
  auto world = environment->world();
  const int r = world.rank();
  const auto i = static_cast<std::size_t>(r);
  // n = 2: rank 0 gets the sums of elements 0 and 1, rank 1 of elements 2 and 3.
  const std::vector<float> f{1.0f + r, 2.0f + r, 10.0f * (r + 1), 0.5f};
  std::vector<float> out(2);
  world.reduce_scatter(std::span<const float>(f), std::span<float>(out), comm::ReduceOp::sum);
  REQUIRE(out == (r == 0 ? std::vector<float>{3.0f, 5.0f} : std::vector<float>{30.0f, 1.0f}));
  const std::vector<double> d{2.0 * r, 1.0, -4.0 * r, 3.0 + r};
  std::vector<double> mean(2);
  world.reduce_scatter(std::span<const double>(d), std::span<double>(mean),
                       comm::ReduceOp::average);
  REQUIRE(mean == (r == 0 ? std::vector<double>{1.0, 1.0} : std::vector<double>{-2.0, 3.5}));
  const std::vector<float> mine{0.25f + r, -1.0f * r, 7.0f};
  std::vector<float> all(6);
  world.all_gather(std::span<const float>(mine), std::span<float>(all));
  REQUIRE(all == std::vector<float>{0.25f, 0.0f, 7.0f, 1.25f, -1.0f, 7.0f});

  comm::Comm held(environment->world());
  std::vector<double> gathered(2);
  const std::vector<double> one{1.5 * (r + 1)};
  held.all_gather(std::span<const double>(one), std::span<double>(gathered));
  REQUIRE(gathered == std::vector<double>{1.5, 3.0});
  const std::vector<std::uint64_t> counts{std::uint64_t(r) << 40, 1, 2, 3 + i};
  std::vector<std::uint64_t> summed(2);
  held.reduce_scatter(std::span<const std::uint64_t>(counts), std::span<std::uint64_t>(summed),
                      comm::ReduceOp::sum);
  REQUIRE(summed == (r == 0 ? std::vector<std::uint64_t>{std::uint64_t{1} << 40, 2}
                            : std::vector<std::uint64_t>{4, 7}));
  std::vector<float> mean_f(1);
  held.reduce_scatter(std::span<const float>(f.data(), 2), std::span<float>(mean_f),
                      comm::ReduceOp::average);
  REQUIRE(mean_f[0] == (r == 0 ? 1.5f : 2.5f));
}

TEST_CASE("mpi: reduce_scatter and all_gather sizes that do not fit or differ are errors on both "
          "ranks, not a hang") {
  auto world = environment->world();
  const int r = world.rank();
  const std::string where = " on rank " + std::to_string(r) + " of 2: ";
  {  // rank 1's data is not size() * out.size()
    const std::vector<float> data(r == 1 ? 3 : 4, 1.0f);
    std::vector<float> out(2);
    REQUIRE_THROWS_WITH(
        world.reduce_scatter(std::span<const float>(data), std::span<float>(out),
                             comm::ReduceOp::sum),
        Catch::Contains("MPI_Reduce_scatter_block" + where +
                        (r == 1 ? "data has 3 float and out 2; data must hold size() * "
                                  "out.size() = 4 elements"
                                : "another rank passed buffers whose sizes do not fit (its "
                                  "error says which)")));
  }
  {  // each rank's sizes fit, but their n differ
    const std::size_t n = r == 0 ? 1 : 2;
    const std::vector<double> mine(n, 1.0);
    std::vector<double> all(2 * n);
    REQUIRE_THROWS_WITH(
        world.all_gather(std::span<const double>(mine), std::span<double>(all)),
        Catch::Contains("MPI_Allgather" + where + "the ranks pass mine of 1 to 2 double, this rank " +
                        std::to_string(n) + "; every rank must pass the same n (mine.size())"));
  }
  // Both ranks are still in step and MPI usable.
  std::vector<float> all(2);
  const std::vector<float> mine{float(r)};
  world.all_gather(std::span<const float>(mine), std::span<float>(all));
  REQUIRE(all == std::vector<float>{0.0f, 1.0f});
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

TEST_CASE("mpi: a call past the report time names the late rank once, then completes") {
  // A world of its own (made by both ranks), reporting after 0.3 s: a late
  // rank's partner asks at 0.3 s, gets no answer from it and prints at 1.3 s;
  // the late rank comes at 2 s and the call completes.
  auto world = comm::MpiComm::world(comm::Timeout(60.0), comm::Timeout(0.3));
  REQUIRE(world.report_after() == comm::Timeout(0.3));
  const int r = world.rank();
  const auto late_if = [](bool late) {
    if (late) std::this_thread::sleep_for(std::chrono::seconds(2));
  };
  std::ostringstream captured;
  struct Restore {
    std::streambuf* was;
    ~Restore() { std::cerr.rdbuf(was); }
  } restore{std::cerr.rdbuf(captured.rdbuf())};
  late_if(r == 1);
  world.barrier();  // #1: rank 0's question waits unanswered at rank 1
  late_if(r == 0);
  std::vector<float> x{1.0f + r};
  world.all_reduce(std::span<float>(x), comm::ReduceOp::sum);  // #2: rank 1 asks
  late_if(r == 1);
  world.barrier();  // #3: an answer to #1's or #2's question is not one to #3's
  std::vector<float> got(1);
  if (r == 0) {
    world.recv(std::span<float>(got), 1);
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    world.send(std::span<const float>(x), 0);
  }
  REQUIRE(x[0] == 3.0f);
  const std::string tail = "; the timeout is 60 s (LOOM_COLLECTIVE_TIMEOUT)";
  const std::vector<std::string> expected =
      r == 0 ? std::vector<std::string>{" s in MPI_Barrier (collective #1) for rank(s) 1, which "
                                        "have not arrived" + tail,
                                        " s in MPI_Barrier (collective #3) for rank(s) 1, which "
                                        "have not arrived" + tail,
                                        " s in MPI_Recv for rank 1" + tail}
             : std::vector<std::string>{" s in MPI_Allreduce (collective #2) for rank(s) 0, "
                                        "which have not arrived" + tail};
  const std::string start = "loom: rank " + std::to_string(r) + " of 2 has waited ";
  std::istringstream lines(captured.str());
  std::size_t seen = 0;
  for (std::string line; std::getline(lines, line); ++seen) {
    INFO(line);
    REQUIRE(seen < expected.size());
    REQUIRE(line.rfind(start, 0) == 0);
    std::size_t used = 0;
    const double waited = std::stod(line.substr(start.size()), &used);
    REQUIRE(line.substr(start.size() + used) == expected[seen]);
    // A send/recv names its peer at once; a collective after the answers' second.
    const bool recv = seen == 2;
    REQUIRE(waited >= (recv ? 0.3 : 1.3));
    REQUIRE(waited < (recv ? 1.0 : 2.0));
  }
  REQUIRE(seen == expected.size());
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
  // The types by name, as a reader writes them, not the compiler's
  // __PRETTY_FUNCTION__ text.
  REQUIRE_THROWS_WITH(make(), Catch::Contains("trains a different network, policy or optimizer "
                                              "than rank " +
                                              std::to_string(environment->rank())) &&
                                  Catch::Contains("Start every rank from the same program") &&
                                  Catch::Contains("runs network loom::Sequential<loom::Input<1, "
                                                  "28, 28>, ") &&
                                  Catch::Contains(", policy loom::DataParallel<") &&
                                  Catch::Contains(", optimizer loom::SGD") &&
                                  !Catch::Contains("type_name") && !Catch::Contains("[with T"));
}

namespace {

// What a case changes: the optimizer's, the trainer's and the fit's
// options, the training data and the callbacks.
struct Settings {
  SGD::Options sgd = test::sgd;
  TrainerOptions trainer{.seed = 3};
  FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 1};
  const data::Dataset* train = nullptr;
  int callbacks = 0;  // which set of callbacks (run_fit)
};

const data::Dataset& agreement_train() {
  static const auto train = test::head(test::fashion().train, 240);
  return train;
}

template <class T>
void run_fit(T& trainer, const Settings& s) {
  static const auto test_set = test::head(test::fashion().test, 100);
  static const auto fewer = test::head(test::fashion().test, 50);
  const auto& data = *s.train;
  switch (s.callbacks) {
    case 0:
      return trainer.fit(data, s.fit);
    case 1:
      return trainer.fit(data, s.fit, callbacks::Evaluate(test_set, nullptr));
    case 2:
      return trainer.fit(data, s.fit, callbacks::Evaluate(fewer, nullptr));
    case 3:
      return trainer.fit(data, s.fit, callbacks::MultiStepLR{.milestones = {2}, .out = nullptr});
    case 4:
      return trainer.fit(data, s.fit, callbacks::MultiStepLR{.milestones = {3}, .out = nullptr});
    case 5:
      return trainer.fit(data, s.fit, callbacks::LrSchedule<schedules::Cosine>{});
    case 6:
      return trainer.fit(data, s.fit,
                         callbacks::LrSchedule<schedules::Cosine>{.schedule = {.min_factor = 0.1}});
    default:
      FAIL("no such set of callbacks");
  }
}

// Trains `Net` under `Policy` over the two processes, every rank with
// `both`'s settings and rank 1 also with `change`'s: both ranks must raise
// as fit begins, naming `field` and each rank's value (`values`), and stay
// in step for the next case.
template <class Net, class Policy>
void require_refused(const std::string& field, const std::string& values,
                     const std::function<void(Settings&)>& change,
                     const std::function<void(Settings&)>& both = {}) {
  Settings settings;
  settings.train = &agreement_train();
  if (both) both(settings);
  if (environment->rank() == 1) change(settings);
  Trainer<Net, Policy> trainer(environment->devices(), settings.sgd, settings.trainer,
                               comm::Comm(environment->world()));
  INFO("field " << field);
  REQUIRE_THROWS_WITH(run_fit(trainer, settings),
                      Catch::Contains("loom: Trainer::fit: the processes disagree on " + field +
                                      ": " + values) &&
                          Catch::Contains("; start every process with the same options"));
  REQUIRE(trainer.steps() == 0);
}

}  // namespace

TEST_CASE("mpi: processes whose fit settings differ all raise at once, naming the field") {
  using Data = DataParallel<>;
  using Split = ModelSplit<Balanced<2>>;
  static const auto half = test::head(test::fashion().train, 120);
  static const auto edited = [] {
    auto set = test::head(test::fashion().train, 240);
    set.images[100] += 0.5f;
    return set;
  }();
  // One field at a time on rank 1, through the optimizer's options, the
  // trainer's, the fit's, the data or a callback.
  require_refused<Logistic, Data>("optimizer.lr", "rank 0 has 0.01, rank 1 has 0.02",
                                  [](Settings& s) { s.sgd.lr = 0.02f; });
  require_refused<Logistic, Data>("optimizer.momentum", "rank 0 has 0.9, rank 1 has 0.8",
                                  [](Settings& s) { s.sgd.momentum = 0.8f; });
  require_refused<Logistic, Data>("optimizer.weight_decay", "rank 0 has 0, rank 1 has 0.001",
                                  [](Settings& s) { s.sgd.weight_decay = 1e-3f; });
  require_refused<Logistic, Data>("trainer.seed", "rank 0 has 3, rank 1 has 5",
                                  [](Settings& s) { s.trainer.seed = 5; });
  require_refused<Logistic, Data>("trainer.precision", "rank 0 has fp32, rank 1 has bf16",
                                  [](Settings& s) { s.trainer.precision = Precision::bf16; });
  require_refused<Logistic, Data>(
      "loss_scaling.initial_scale", "rank 0 has 65536, rank 1 has 1024",
      [](Settings& s) { s.trainer.loss_scaling.initial_scale = 1024.0f; },
      [](Settings& s) { s.trainer.precision = Precision::fp16; });
  require_refused<Logistic, Data>("fit.epochs", "rank 0 has 1, rank 1 has 2",
                                  [](Settings& s) { s.fit.epochs = 2; });
  require_refused<Logistic, Data>("fit.batch_size", "rank 0 has 60, rank 1 has 32",
                                  [](Settings& s) { s.fit.batch_size = 32; });
  require_refused<Logistic, Data>("fit.accumulation_steps", "rank 0 has 1, rank 1 has 2",
                                  [](Settings& s) { s.fit.accumulation_steps = 2; });
  require_refused<Logistic, Data>("fit.shuffle", "rank 0 has true, rank 1 has false",
                                  [](Settings& s) { s.fit.shuffle = false; });
  require_refused<Logistic, Data>("fit.seed", "rank 0 has 1, rank 1 has 9",
                                  [](Settings& s) { s.fit.seed = 9; });
  require_refused<Logistic, Data>("fit.drop_last", "rank 0 has false, rank 1 has true",
                                  [](Settings& s) { s.fit.drop_last = true; });
  require_refused<Logistic, Data>("fit.augment.crop_padding", "rank 0 has 0, rank 1 has 2",
                                  [](Settings& s) { s.fit.augment.crop_padding = 2; });
  require_refused<Logistic, Data>("fit.augment.horizontal_flip",
                                  "rank 0 has false, rank 1 has true",
                                  [](Settings& s) { s.fit.augment.horizontal_flip = true; });
  require_refused<Logistic, Data>("fit.max_grad_norm", "rank 0 has 0, rank 1 has 5",
                                  [](Settings& s) { s.fit.max_grad_norm = 5.0f; });
  require_refused<Logistic, Data>("fit.on_nonfinite", "rank 0 has raise, rank 1 has skip",
                                  [](Settings& s) { s.fit.on_nonfinite = NonFinite::skip; });
  require_refused<Logistic, Data>("data.samples", "rank 0 has 240, rank 1 has 120",
                                  [](Settings& s) { s.train = &half; });
  // As many samples, one pixel apart: another data set.
  require_refused<Logistic, Data>("data.first_samples_digest", "rank 0 has ",
                                  [](Settings& s) { s.train = &edited; });
  require_refused<Logistic, Data>(
      "evaluate.samples", "rank 0 has 100, rank 1 has 50", [](Settings& s) { s.callbacks = 2; },
      [](Settings& s) { s.callbacks = 1; });
  require_refused<Logistic, Data>(
      "lr.milestones", "rank 0 has [2], rank 1 has [3]", [](Settings& s) { s.callbacks = 4; },
      [](Settings& s) { s.callbacks = 3; });
  require_refused<Logistic, Data>(
      "lr.schedule_factors", "rank 0 has [1, ", [](Settings& s) { s.callbacks = 6; },
      [](Settings& s) { s.callbacks = 5; });
  // A pipeline's schedule and micro-batches are run-time options.
  require_refused<LeNet, Split>("micro_batches", "rank 0 has 4, rank 1 has 8",
                                [](Settings& s) { s.trainer.schedule.micro_batches = 8; },
                                [](Settings& s) { s.trainer.schedule.micro_batches = 4; });
  // (A kind with micro_batches 0 would be ignored: the policy's schedule runs.)
  require_refused<LeNet, Split>("schedule", "rank 0 has 1F1B, rank 1 has GPipe", [](Settings& s) {
    s.trainer.schedule = {PipelineKind::gpipe, 4};
  });
  require_refused<LeNet, Split>("fit.batch_size", "rank 0 has 60, rank 1 has 30",
                                [](Settings& s) { s.fit.batch_size = 30; });

  // After all that the ranks are still in step: the same settings train.
  Settings same;
  same.train = &agreement_train();
  Trainer<Logistic, Data> trainer(environment->devices(), same.sgd, same.trainer,
                                  comm::Comm(environment->world()));
  run_fit(trainer, same);
  REQUIRE(trainer.steps() == 4);
}

TEST_CASE("mpi: a process whose fit fails its checks stops every process, with its reason") {
  const bool one = environment->rank() == 1;
  Trainer<Logistic, DataParallel<>> trainer(environment->devices(), test::sgd, {},
                                            comm::Comm(environment->world()));
  const auto& train = agreement_train();
  REQUIRE_THROWS_WITH(trainer.fit(train, {.epochs = one ? 0 : 1, .batch_size = 60}),
                      one ? Catch::Contains("fit: epochs must be >= 1, got 0")
                          : Catch::Contains("loom: Trainer::fit: process 1 could not start (this "
                                            "is process 0): loom: fit: epochs must be >= 1"));
  REQUIRE(trainer.steps() == 0);
}

TEST_CASE("mpi: a process whose fingerprint outgrows the agreement's row still joins it") {
  // Callbacks of rank 1 add 120 fields, more than the 96 a row carries.
  struct ManyFields {
    int count = 0;
    void on_fit_prepare(const FitInfo&, Fingerprint& fingerprint) const {
      for (int f = 0; f < count; ++f) fingerprint.add("extra." + std::to_string(f), f);
    }
  };
  const bool one = environment->rank() == 1;
  Trainer<Logistic, DataParallel<>> trainer(environment->devices(), test::sgd, {},
                                            comm::Comm(environment->world()));
  REQUIRE_THROWS_WITH(
      trainer.fit(agreement_train(), {.epochs = 1, .batch_size = 60}, ManyFields{one ? 120 : 0}),
      Catch::Contains("process 1 could not start (this is process " +
                      std::to_string(environment->rank()) + "): its fingerprint has ") &&
          Catch::Contains("fields, more than the 96 the agreement carries"));
  REQUIRE(trainer.steps() == 0);
}

TEST_CASE("mpi: a process that loads a checkpoint while another fits: both raise, none hangs") {
  auto world = environment->world();
  std::array<double, 1> id{static_cast<double>(::getpid())};
  world.broadcast(std::span<double>(id), 0);
  const auto path = std::filesystem::temp_directory_path() /
                    ("loom-mpi-phase-" + std::to_string(static_cast<long>(id[0])) +
                     ".safetensors");
  Trainer<Logistic, DataParallel<>> trainer(environment->devices(), test::sgd, {},
                                            comm::Comm(environment->world()));
  trainer.fit(agreement_train(), {.epochs = 1, .batch_size = 60});
  trainer.save(path);
  const auto expected =
      Catch::Contains("the processes are in different calls: process 0 is in Trainer::fit, "
                      "process 1 in Trainer::load");
  if (environment->rank() == 1)
    REQUIRE_THROWS_WITH(trainer.load(path), expected);
  else
    REQUIRE_THROWS_WITH(trainer.fit(agreement_train(), {.epochs = 1, .batch_size = 60}), expected);
  world.barrier();
  if (environment->rank() == 0) std::filesystem::remove(path);
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
