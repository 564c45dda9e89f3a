// MixedComm over MPI, run by CTest under `mpiexec -np 2`: 2 processes x 2
// threads = 4 ranks, the threads of a process calling MPI at once (pairs'
// send/recv, the leaders' collectives). Every process runs every test case
// in the same order (they are collective); CTest's timeout turns a hang into
// a failure.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <loom/comm/mixed_comm.hpp>
#include <loom/loom.hpp>
#include <string>
#include <thread>
#include <vector>

#include "loom_test.hpp"
#include "mpi_test.hpp"

using namespace loom;
namespace test = loom::test;
using comm::MixedComm;
using comm::ReduceOp;
using test::environment;

namespace {

constexpr int threads = 2;
constexpr int ranks = 4;

// This process's 2 ranks over the MPI world, body(rank) run on a thread
// each; the ranks' error texts ("" when body returned).
std::vector<std::string> on_threads(const std::function<void(MixedComm&)>& body) {
  auto mine = MixedComm::create(comm::Comm(environment->world()), threads);
  std::vector<std::string> errors(threads);
  std::vector<std::thread> workers;
  for (std::size_t t = 0; t < mine.size(); ++t)
    workers.emplace_back([&, t] {
      try {
        body(mine[t]);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  for (auto& w : workers) w.join();
  return errors;
}

void require_no_errors(const std::vector<std::string>& errors) {
  for (const auto& e : errors) REQUIRE(e.empty());
}

}  // namespace

TEST_CASE("mixed: MPI runs with MPI_THREAD_MULTIPLE, which MixedComm's threads need") {
  REQUIRE(environment->size() == 2);
  int provided = MPI_THREAD_SINGLE;
  REQUIRE(MPI_Query_thread(&provided) == MPI_SUCCESS);
  REQUIRE(provided == MPI_THREAD_MULTIPLE);
}

TEST_CASE("mixed: 2 processes x 2 threads reduce, broadcast, exchange and wait as one grid") {
  const int process = environment->rank();
  std::vector<std::vector<float>> data(ranks);
  for (std::size_t r = 0; r < ranks; ++r) data[r] = test::random_vector<float>(513, 20 + r, -1e3, 1e3);
  // Each process sums its threads in order, then MPI sums the two parts.
  std::vector<float> expected(513);
  for (std::size_t j = 0; j < expected.size(); ++j)
    expected[j] = (data[0][j] + data[1][j]) + (data[2][j] + data[3][j]);
  std::vector<std::vector<float>> sums(threads), roots(threads), gathered(threads),
      scattered(threads, std::vector<float>(2));
  std::vector<std::vector<double>> mean(threads, std::vector<double>(3));
  std::vector<std::vector<std::uint64_t>> counts(threads), words(threads);
  std::vector<std::string> described(threads);
  // received[t][from]: the message {from, to} rank from sent thread t's rank.
  std::vector<std::vector<std::vector<float>>> received(
      threads, std::vector<std::vector<float>>(ranks, std::vector<float>(2)));
  require_no_errors(on_threads([&](MixedComm& c) {
    const int r = c.rank();
    const auto t = static_cast<std::size_t>(r % threads);
    described[t] = c.describe();
    sums[t] = data[static_cast<std::size_t>(r)];
    c.all_reduce(std::span<float>(sums[t]), ReduceOp::sum);
    mean[t] = {double(r), 1.0, -2.0 * r};
    c.all_reduce(std::span<double>(mean[t]), ReduceOp::average);
    counts[t] = {std::uint64_t(r + 1) << 40};
    c.all_reduce(std::span<std::uint64_t>(counts[t]), ReduceOp::sum);
    for (int root = 0; root < ranks; ++root) {
      std::vector<float> f(3, 0.0f);
      std::vector<std::uint64_t> u(1, 0);
      if (r == root) {
        f = test::random_vector<float>(3, 60 + std::uint64_t(root));
        u = {std::uint64_t(root) * 1000 + 7};
      }
      c.broadcast(std::span<float>(f), root);
      c.broadcast(std::span<std::uint64_t>(u), root);
      roots[t].insert(roots[t].end(), f.begin(), f.end());
      words[t].push_back(u[0]);
    }
    // Every rank sends to every rank, then takes the messages in reverse.
    for (int k = 0; k < ranks; ++k) {
      const std::vector<float> message{float(r), float((r + k) % ranks)};
      c.send(std::span<const float>(message), (r + k) % ranks);
    }
    for (int k = ranks - 1; k >= 0; --k) {
      const int from = (r + k) % ranks;
      c.recv(std::span<float>(received[t][static_cast<std::size_t>(from)]), from);
    }
    c.barrier();
    const std::vector<float> mine{float(r) * 2, -0.0f};
    gathered[t].assign(2 * ranks, 1.0f);
    c.all_gather(std::span<const float>(mine), std::span<float>(gathered[t]));
    c.reduce_scatter(std::span<const float>(data[static_cast<std::size_t>(r)].data(), 2 * ranks),
                     std::span<float>(scattered[t]), ReduceOp::sum);
  }));
  for (int t = 0; t < threads; ++t) {
    const int r = process * threads + t;
    INFO("rank " << r);
    const auto i = static_cast<std::size_t>(t);
    REQUIRE(described[i] == "MixedComm rank " + std::to_string(r) + " of 4 (process " +
                                std::to_string(process) + " thread " + std::to_string(t) +
                                " of a 2 x 2 grid)");
    REQUIRE(std::memcmp(sums[i].data(), expected.data(), expected.size() * sizeof(float)) == 0);
    REQUIRE(mean[i] == std::vector<double>{1.5, 1.0, -3.0});
    REQUIRE(counts[i] == std::vector<std::uint64_t>{std::uint64_t(10) << 40});
    for (std::size_t root = 0; root < ranks; ++root) {
      const auto sent = test::random_vector<float>(3, 60 + root);
      REQUIRE(std::vector<float>(roots[i].begin() + 3 * static_cast<std::ptrdiff_t>(root),
                                 roots[i].begin() + 3 * static_cast<std::ptrdiff_t>(root) + 3) == sent);
      REQUIRE(words[i][root] == root * 1000 + 7);
    }
    for (int from = 0; from < ranks; ++from)
      REQUIRE(received[i][static_cast<std::size_t>(from)] == std::vector<float>{float(from), float(r)});
    for (std::size_t q = 0; q < ranks; ++q) {
      REQUIRE(gathered[i][2 * q] == float(q) * 2);
      REQUIRE(std::signbit(gathered[i][2 * q + 1]));
    }
    for (std::size_t j = 0; j < 2; ++j)
      REQUIRE(scattered[i][j] == expected[2 * static_cast<std::size_t>(r) + j]);
  }
}

TEST_CASE("mixed: the stage groups lie in one process, the replica groups span both") {
  const int process = environment->rank();
  std::vector<std::string> pipelines(threads), replicas(threads);
  std::vector<std::vector<float>> stage_sum(threads, {0.0f}), replica_sum(threads, {0.0f});
  std::vector<std::vector<float>> from_stage(threads, {0.0f}), from_replica(threads, {0.0f});
  std::vector<std::vector<float>> from_grid(threads, {0.0f});
  std::vector<std::vector<std::uint64_t>> replica_root(threads, {0});
  require_no_errors(on_threads([&](MixedComm& c) {
    const int r = c.rank();
    const auto t = static_cast<std::size_t>(r % threads);
    auto pipeline = c.split(r / 2, r);
    auto replica = c.split(r % 2, r);
    pipelines[t] = pipeline.describe();
    replicas[t] = replica.describe();
    stage_sum[t] = {float(r + 1)};
    pipeline.all_reduce(std::span<float>(stage_sum[t]), ReduceOp::sum);
    replica_sum[t] = {float(r + 1)};
    replica.all_reduce(std::span<float>(replica_sum[t]), ReduceOp::sum);
    if (replica.rank() == 0) replica_root[t] = {std::uint64_t(r) + 40};
    replica.broadcast(std::span<std::uint64_t>(replica_root[t]), 0);
    // The same thread pair between the processes in the grid and in a
    // replica group: sent grid first, received replica first.
    const std::vector<float> grid_message{100.0f + float(r)}, message{float(r)};
    c.send(std::span<const float>(grid_message), (r + 2) % ranks);
    replica.send(std::span<const float>(message), 1 - replica.rank());
    pipeline.send(std::span<const float>(message), 1 - pipeline.rank());
    replica.recv(std::span<float>(from_replica[t]), 1 - replica.rank());
    pipeline.recv(std::span<float>(from_stage[t]), 1 - pipeline.rank());
    c.recv(std::span<float>(from_grid[t]), (r + 2) % ranks);
    replica.barrier();
    pipeline.barrier();
  }));
  for (int t = 0; t < threads; ++t) {
    const int r = process * threads + t;
    INFO("rank " << r);
    const auto i = static_cast<std::size_t>(t);
    const std::string where = " (process " + std::to_string(process) + " thread " +
                              std::to_string(t) + " of a 2 x 2 grid)";
    REQUIRE(pipelines[i] == "MixedComm rank " + std::to_string(t) + " of 2" + where);
    REQUIRE(replicas[i] == "MixedComm rank " + std::to_string(process) + " of 2" + where);
    REQUIRE(stage_sum[i][0] == (process == 0 ? 3.0f : 7.0f));
    REQUIRE(replica_sum[i][0] == (t == 0 ? 4.0f : 6.0f));
    REQUIRE(replica_root[i][0] == std::uint64_t(t) + 40);
    REQUIRE(from_replica[i][0] == float((r + 2) % ranks));
    REQUIRE(from_stage[i][0] == float(process * 2 + 1 - t));
    REQUIRE(from_grid[i][0] == 100.0f + float((r + 2) % ranks));
  }
}

TEST_CASE("mixed: processes that give different thread counts both raise, naming both") {
  const int process = environment->rank();
  const int given = process == 0 ? 2 : 3;
  REQUIRE_THROWS_WITH(MixedComm::create(comm::Comm(environment->world()), given),
                      Catch::Contains("MixedComm::create on process " + std::to_string(process) +
                                      " of 2: this process gives " + std::to_string(given) +
                                      " thread(s) but process " + std::to_string(1 - process) +
                                      " gives " + std::to_string(5 - given)));
}
