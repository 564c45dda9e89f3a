// TensorParallel across processes, run by CTest under `mpiexec -np 4`: a
// small GPT split over tensor 4, data 2 x tensor 2 and pipe 2 x tensor 2
// (one rank a process), and data 2 x tensor 4 on 2 worker threads a
// process, trains to one device's weights; its checkpoint is whole. Every rank runs every test case in the same order (they are
// collective).
#define CATCH_CONFIG_RUNNER
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "loom_test.hpp"
#include "mpi_test.hpp"
#include "tiny_gpt.hpp"

using namespace loom;
namespace test = loom::test;
using test::environment;
using test::TinyGpt;

namespace {

comm::Comm world() { return comm::Comm(environment->world()); }

struct Trained {
  std::vector<float> weights;
  double eval_loss = 0.0;
};

// `threads`: ranks on worker threads of each process (1: the process).
template <class Policy>
Trained train(comm::Comm processes = {}, std::size_t threads = 1) {
  auto devices = processes && threads == 1 ? environment->devices() : devices::cpu(threads);
  for (auto& d : devices) d.threads = 1;
  Trainer<TinyGpt, Policy, SGD, PositionCrossEntropy> trainer(devices, test::gpt_sgd, {.seed = 9},
                                                              std::move(processes));
  trainer.fit(test::gpt_text().train, test::gpt_fit);
  const auto w = trainer.model().parameters();
  return {{w.begin(), w.end()}, trainer.evaluate(test::gpt_text().test, 32).loss};
}

const Trained& one_device() {
  static const Trained one = train<SingleDevice>();
  return one;
}

// fp32 rounding over 10 SGD steps, as on worker threads.
void require_like_one_device(const Trained& got, const char* what) {
  INFO(what);
  test::require_close(got.weights, one_device().weights, {1e-6, 1e-4}, what);
  REQUIRE(got.eval_loss == Approx(one_device().eval_loss).epsilon(1e-6));
}

}  // namespace

TEST_CASE("mpi tensor: four ranks") { REQUIRE(environment->size() == 4); }

TEST_CASE("mpi tensor: tensor 4, data 2 x tensor 2 and pipe 2 x tensor 2 reach one device's "
          "weights") {
  require_like_one_device(train<TensorParallel<4>>(world()), "tensor 4");
  require_like_one_device(train<TensorParallel<2, DataParallel<>>>(world()), "data 2 x tensor 2");
  require_like_one_device(train<TensorParallel<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(world()),
                          "pipe 2 x tensor 2");
}

TEST_CASE("mpi tensor: 4 processes x 2 threads as data 2 x tensor 4, each tensor group over two "
          "processes, reach one device's weights") {
  require_like_one_device(train<TensorParallel<4, DataParallel<>>>(world(), 2),
                          "data 2 x tensor 4 on 4 processes x 2 threads");
}

TEST_CASE("mpi tensor: the placement and the checkpoint are the mesh's") {
  using Policy = TensorParallel<2, DataParallel<>>;
  Trainer<TinyGpt, Policy, SGD, PositionCrossEntropy> trainer(environment->devices(),
                                                              test::gpt_sgd, {.seed = 9}, world());
  const auto places = trainer.placement();
  REQUIRE(places.size() == 4);
  for (std::size_t w = 0; w < 4; ++w) {
    CHECK(places[w].replica == w / 2);
    CHECK(places[w].tensor == w % 2);
  }
  trainer.fit(test::gpt_text().train, test::gpt_fit);
  // Rank 0 writes the gathered network; every rank reads it back whole.
  // One name on every rank: mpiexec's process is their parent.
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("loom-mpi-tensor-" + std::to_string(::getppid()) + ".safetensors"))
                               .string();
  trainer.save(path);
  Trainer<TinyGpt, SingleDevice, SGD, PositionCrossEntropy> one(devices::cpu(1), test::gpt_sgd);
  one.load(path);
  test::require_equal(one.model().parameters(), trainer.model().parameters(),
                      "the checkpoint's weights against the gathered ones");
  // Every rank's share made it into the file: one device's weights.
  test::require_close(one.model().parameters(), one_device().weights, {1e-6, 1e-4},
                      "the checkpoint's weights against one device's");
  auto barrier = environment->world();
  barrier.barrier();
  if (environment->rank() == 0) std::remove(path.c_str());
}
