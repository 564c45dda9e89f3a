// MixedComm: ranks that are threads of several processes. Here the
// processes are threads too: a LocalComm of P ranks stands in for the
// processes' communicator, and each "process" thread creates its T ranks on
// threads of its own, so the whole grid runs in one process (and under
// ThreadSanitizer). tests/dist/test_mpi_mixed.cpp runs it over MPI.
#include <loom/comm/mixed_comm.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
namespace test = loom::test;
using comm::MixedComm;
using comm::ReduceOp;

namespace {

// A rank's body: its communicator, and where create() put it.
using Body = std::function<void(MixedComm&, int process, int thread)>;

struct GridRun {
  std::vector<std::string> create_errors;  // by process ("" when create returned)
  std::vector<std::string> errors;         // by rank ("" when the body returned)
};

// Runs body on a grid of threads[p] ranks in each process p: one thread per
// process makes its MixedComm ranks over a LocalComm standing in for the
// processes, and runs each on a thread of its own.
GridRun run_grid(const std::vector<int>& threads, const Body& body,
                 comm::Timeout timeout = comm::collective_timeout(),
                 comm::Timeout report_after = comm::collective_report_after()) {
  const auto processes = threads.size();
  auto process_comms = comm::LocalComm::create(static_cast<int>(processes), timeout, report_after);
  const auto most = static_cast<std::size_t>(*std::max_element(threads.begin(), threads.end()));
  GridRun run{std::vector<std::string>(processes), std::vector<std::string>(processes * most)};
  std::vector<std::thread> process_threads;
  for (std::size_t p = 0; p < processes; ++p)
    process_threads.emplace_back([&, p] {
      std::vector<MixedComm> ranks;
      try {
        ranks = MixedComm::create(comm::Comm(process_comms[p]), threads[p], timeout, report_after);
      } catch (const std::exception& e) {
        run.create_errors[p] = e.what();
        return;
      }
      std::vector<std::thread> workers;
      for (std::size_t t = 0; t < ranks.size(); ++t)
        workers.emplace_back([&, t] {
          try {
            body(ranks[t], static_cast<int>(p), static_cast<int>(t));
          } catch (const std::exception& e) {
            run.errors[p * most + t] = e.what();
          }
        });
      for (auto& w : workers) w.join();
    });
  for (auto& t : process_threads) t.join();
  return run;
}

// P processes x T threads, every body returning normally.
void on_grid(int processes, int threads, const Body& body) {
  const auto run = run_grid(std::vector<int>(static_cast<std::size_t>(processes), threads), body);
  for (std::size_t p = 0; p < run.create_errors.size(); ++p) {
    INFO("process " << p);
    REQUIRE(run.create_errors[p].empty());
  }
  for (std::size_t r = 0; r < run.errors.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(run.errors[r].empty());
  }
}

const std::vector<std::pair<int, int>> grids{{2, 2}, {3, 2}, {1, 3}, {2, 1}};

// The sum of rank r's data[r] as MixedComm makes it: within each process in
// thread order, then the processes' sums in process order.
template <class T>
std::vector<T> grid_sum(const std::vector<std::vector<T>>& data, int processes, int threads) {
  std::vector<T> total(data[0].size());
  for (std::size_t j = 0; j < total.size(); ++j)
    for (int p = 0; p < processes; ++p) {
      T part = data[static_cast<std::size_t>(p * threads)][j];
      for (int t = 1; t < threads; ++t) part += data[static_cast<std::size_t>(p * threads + t)][j];
      total[j] = p == 0 ? part : total[j] + part;
    }
  return total;
}

// Each rank's `length` random floats in [-1e3, 1e3), seeded by seed + rank.
std::vector<std::vector<float>> rank_data(std::size_t ranks, std::size_t length, std::uint64_t seed) {
  std::vector<std::vector<float>> data(ranks);
  for (std::size_t r = 0; r < ranks; ++r)
    data[r] = test::random_vector<float>(length, seed + r, -1e3, 1e3);
  return data;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE("MixedComm: rank = process x threads + thread, size and describe") {
  for (const auto& [processes, threads] : grids) {
    const int n = processes * threads;
    std::vector<int> ranks(static_cast<std::size_t>(n), -1), sizes(ranks);
    std::vector<std::string> described(static_cast<std::size_t>(n));
    on_grid(processes, threads, [&](MixedComm& c, int p, int t) {
      const auto i = static_cast<std::size_t>(p * threads + t);
      ranks[i] = c.rank();
      sizes[i] = c.size();
      described[i] = c.describe();
    });
    for (int p = 0; p < processes; ++p)
      for (int t = 0; t < threads; ++t) {
        const int r = p * threads + t;
        const auto i = static_cast<std::size_t>(r);
        REQUIRE(ranks[i] == r);
        REQUIRE(sizes[i] == n);
        REQUIRE(described[i] == "MixedComm rank " + std::to_string(r) + " of " + std::to_string(n) +
                                    " (process " + std::to_string(p) + " thread " +
                                    std::to_string(t) + " of a " + std::to_string(processes) +
                                    " x " + std::to_string(threads) + " grid)");
      }
  }
}

TEST_CASE("MixedComm: all_reduce sums within each process, then across: the same bits on every rank") {
  for (const auto& [processes, threads] : grids) {
    INFO(processes << " x " << threads);
    const int n = processes * threads;
    const auto ranks = static_cast<std::size_t>(n);
    const auto data = rank_data(ranks, 1001, 10);
    const auto expected = grid_sum(data, processes, threads);
    if (processes > 1 && threads > 1) {
      // The order shows: summing the ranks in one row gives other bits.
      REQUIRE_FALSE(same_bits(expected, grid_sum(data, 1, n)));
    }
    std::vector<std::vector<double>> mean(ranks, std::vector<double>(5));
    std::vector<std::vector<std::uint64_t>> counts(ranks), average_counts(ranks);
    auto sums = data;
    on_grid(processes, threads, [&](MixedComm& c, int, int) {
      const auto r = static_cast<std::size_t>(c.rank());
      c.all_reduce(std::span<float>(sums[r]), ReduceOp::sum);
      for (std::size_t j = 0; j < 5; ++j) mean[r][j] = static_cast<double>(r * 10 + j);
      c.all_reduce(std::span<double>(mean[r]), ReduceOp::average);
      counts[r] = {r + 1, (r + 1) << 40};
      c.all_reduce(std::span<std::uint64_t>(counts[r]), ReduceOp::sum);
      average_counts[r] = {ranks * (r + 1)};
      c.all_reduce(std::span<std::uint64_t>(average_counts[r]), ReduceOp::average);
    });
    const std::uint64_t triangle = ranks * (ranks + 1) / 2;
    for (std::size_t r = 0; r < ranks; ++r) {
      INFO("rank " << r);
      REQUIRE(same_bits(sums[r], expected));
      for (std::size_t j = 0; j < 5; ++j)
        REQUIRE(mean[r][j] == 10.0 * (static_cast<double>(ranks) - 1) / 2 + static_cast<double>(j));
      REQUIRE(counts[r] == std::vector<std::uint64_t>{triangle, triangle << 40});
      REQUIRE(average_counts[r] == std::vector<std::uint64_t>{triangle});
    }
  }
}

TEST_CASE("MixedComm: broadcast from every root, float and uint64") {
  for (const auto& [processes, threads] : grids) {
    INFO(processes << " x " << threads);
    const auto ranks = static_cast<std::size_t>(processes * threads);
    std::vector<std::vector<std::vector<float>>> floats(ranks);
    std::vector<std::vector<std::vector<std::uint64_t>>> words(ranks);
    on_grid(processes, threads, [&](MixedComm& c, int, int) {
      const auto r = static_cast<std::size_t>(c.rank());
      for (std::size_t root = 0; root < ranks; ++root) {
        std::vector<float> f(5, 0.0f);
        std::vector<std::uint64_t> u(2, 0);
        if (root == r) {
          f = test::random_vector<float>(5, 100 + root);
          u = {root * 7 + 1, std::uint64_t{root} << 33};
        }
        c.broadcast(std::span<float>(f), static_cast<int>(root));
        c.broadcast(std::span<std::uint64_t>(u), static_cast<int>(root));
        floats[r].push_back(f);
        words[r].push_back(u);
      }
    });
    for (std::size_t r = 0; r < ranks; ++r)
      for (std::size_t root = 0; root < ranks; ++root) {
        INFO("rank " << r << ", root " << root);
        REQUIRE(floats[r][root] == test::random_vector<float>(5, 100 + root));
        REQUIRE(words[r][root] == std::vector<std::uint64_t>{root * 7 + 1, std::uint64_t{root} << 33});
      }
  }
}

TEST_CASE("MixedComm: send/recv between every pair, each thread pair's messages apart") {
  for (const auto& [processes, threads] : grids) {
    INFO(processes << " x " << threads);
    const int n = processes * threads;
    const auto ranks = static_cast<std::size_t>(n);
    // got[to][from][round]: the message {from, to, round}.
    std::vector<std::vector<std::vector<std::vector<float>>>> got(
        ranks, std::vector<std::vector<std::vector<float>>>(
                   ranks, std::vector<std::vector<float>>(2, std::vector<float>(3, -1.0f))));
    on_grid(processes, threads, [&](MixedComm& c, int, int) {
      const int r = c.rank();
      // Two rounds to every rank (itself too), then received from the
      // senders in the reverse order: a message waits while another thread
      // pair's, between the same processes, is taken first.
      for (int round = 0; round < 2; ++round)
        for (int k = 0; k < n; ++k) {
          const std::vector<float> message{float(r), float((r + k) % n), float(round)};
          c.send(std::span<const float>(message), (r + k) % n);
        }
      for (int k = n - 1; k >= 0; --k)
        for (int round = 0; round < 2; ++round) {
          const int from = (r + k) % n;
          c.recv(std::span<float>(got[static_cast<std::size_t>(r)][static_cast<std::size_t>(from)]
                                     [static_cast<std::size_t>(round)]),
                 from);
        }
    });
    for (int to = 0; to < n; ++to)
      for (int from = 0; from < n; ++from)
        for (int round = 0; round < 2; ++round) {
          INFO("from " << from << " to " << to << ", round " << round);
          REQUIRE(got[static_cast<std::size_t>(to)][static_cast<std::size_t>(from)]
                     [static_cast<std::size_t>(round)] ==
                  std::vector<float>{float(from), float(to), float(round)});
        }
  }
}

TEST_CASE("MixedComm: barrier lets no rank through before all have come") {
  for (const auto& [processes, threads] : grids) {
    INFO(processes << " x " << threads);
    const auto ranks = static_cast<std::size_t>(processes * threads);
    std::atomic<int> first{0}, second{0};
    std::vector<int> seen_first(ranks), seen_second(ranks);
    on_grid(processes, threads, [&](MixedComm& c, int, int) {
      const auto r = static_cast<std::size_t>(c.rank());
      // The last rank comes late: the others must wait for it.
      if (r + 1 == ranks) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      first += 1;
      c.barrier();
      seen_first[r] = first.load();
      second += 1;
      c.barrier();
      seen_second[r] = second.load();
    });
    for (std::size_t r = 0; r < ranks; ++r) {
      REQUIRE(seen_first[r] == static_cast<int>(ranks));
      REQUIRE(seen_second[r] == static_cast<int>(ranks));
    }
  }
}

TEST_CASE("MixedComm: reduce_scatter gives rank r all_reduce's slice r, all_gather every slice") {
  for (const auto& [processes, threads] : grids) {
    INFO(processes << " x " << threads);
    const int n = processes * threads;
    const auto ranks = static_cast<std::size_t>(n);
    constexpr std::size_t slice = 3;
    const auto data = rank_data(ranks, slice * ranks, 40);
    const auto total = grid_sum(data, processes, threads);
    std::vector<std::vector<float>> scattered(ranks, std::vector<float>(slice)), averaged(scattered);
    std::vector<std::vector<float>> gathered(ranks, std::vector<float>(slice * ranks));
    on_grid(processes, threads, [&](MixedComm& c, int, int) {
      const auto r = static_cast<std::size_t>(c.rank());
      c.reduce_scatter(std::span<const float>(data[r]), std::span<float>(scattered[r]),
                       ReduceOp::sum);
      c.reduce_scatter(std::span<const float>(data[r]), std::span<float>(averaged[r]),
                       ReduceOp::average);
      const std::vector<float> mine{float(r) + 0.5f, -0.0f, -float(r)};
      c.all_gather(std::span<const float>(mine), std::span<float>(gathered[r]));
    });
    for (std::size_t r = 0; r < ranks; ++r) {
      INFO("rank " << r);
      const std::vector<float> own(total.begin() + static_cast<std::ptrdiff_t>(r * slice),
                                   total.begin() + static_cast<std::ptrdiff_t>((r + 1) * slice));
      REQUIRE(same_bits(scattered[r], own));
      for (std::size_t j = 0; j < slice; ++j) REQUIRE(averaged[r][j] == own[j] / float(n));
      for (std::size_t q = 0; q < ranks; ++q) {
        REQUIRE(gathered[r][q * slice] == float(q) + 0.5f);
        REQUIRE(std::signbit(gathered[r][q * slice + 1]));  // -0.0 stays -0.0
        REQUIRE(gathered[r][q * slice + 2] == -float(q));
      }
    }
  }
  const auto run = run_grid({2, 2}, [](MixedComm& c, int, int) {
    std::vector<float> data(13), out(3);
    c.reduce_scatter(std::span<const float>(data), std::span<float>(out), ReduceOp::sum);
  });
  for (int r = 0; r < 4; ++r)
    REQUIRE_THAT(run.errors[static_cast<std::size_t>(r)],
                 Catch::Contains("MixedComm rank " + std::to_string(r) + " of 4") &&
                     Catch::Contains("reduce_scatter: loom: the buffer of all slices needs size() "
                                     "x the slice's elements (4 x 3 = 12) but has 13"));
}

TEST_CASE("MixedComm: a 2 x 2 grid splits into stage groups (one process) and replica groups "
          "(one thread in each)") {
  // 2 replicas x 2 stages, rank = replica * 2 + stage: a replica's stages
  // are the threads of one process, a stage's replicas one thread of each.
  struct Seen {
    std::string pipeline, replicas, reversed;
    std::vector<float> pipeline_sum = {0.0f}, replica_sum = {0.0f}, reversed_sum = {0.0f};
    std::vector<float> pipeline_root = std::vector<float>(2, 0.0f);
    std::vector<std::uint64_t> replica_root = {0};
    std::vector<float> from_stage = std::vector<float>(2, 0.0f);
    std::vector<float> from_replica = std::vector<float>(2, 0.0f);
    std::vector<float> from_root = std::vector<float>(1, 0.0f);
  };
  std::vector<Seen> seen(4);
  on_grid(2, 2, [&](MixedComm& c, int, int) {
    const int r = c.rank();
    Seen& mine = seen[static_cast<std::size_t>(r)];
    auto pipeline = c.split(r / 2, r);
    auto replicas = c.split(r % 2, r);
    mine.pipeline = pipeline.describe();
    mine.replicas = replicas.describe();
    // Collectives on both groups, interleaved.
    mine.pipeline_sum[0] = float(r + 1);
    pipeline.all_reduce(std::span<float>(mine.pipeline_sum), ReduceOp::sum);
    mine.replica_sum[0] = float(r + 1);
    replicas.all_reduce(std::span<float>(mine.replica_sum), ReduceOp::sum);
    if (pipeline.rank() == 1) mine.pipeline_root = {float(r), 0.25f};
    pipeline.broadcast(std::span<float>(mine.pipeline_root), 1);
    if (replicas.rank() == 1) mine.replica_root = {std::uint64_t(r) << 35};
    replicas.broadcast(std::span<std::uint64_t>(mine.replica_root), 1);
    // Both directions within each group. Ranks 0 and 2 (threads 0 of the
    // two processes) also talk in the whole grid: sent there first but
    // received second, each group's message must stay apart.
    if (r % 2 == 0) {
      const std::vector<float> first{float(r) + 100.0f};
      c.send(std::span<const float>(first), 2 - r);
    }
    const std::vector<float> message{float(r), 1.5f};
    pipeline.send(std::span<const float>(message), 1 - pipeline.rank());
    replicas.send(std::span<const float>(message), 1 - replicas.rank());
    replicas.recv(std::span<float>(mine.from_replica), 1 - replicas.rank());
    pipeline.recv(std::span<float>(mine.from_stage), 1 - pipeline.rank());
    if (r % 2 == 0) c.recv(std::span<float>(mine.from_root), 2 - r);
    pipeline.barrier();
    replicas.barrier();
    // Keys reverse a replica group: its rank 0 becomes 1.
    auto reversed = replicas.split(0, -r);
    mine.reversed = reversed.describe();
    mine.reversed_sum[0] = float(reversed.rank() * 10 + r);
    reversed.all_reduce(std::span<float>(mine.reversed_sum), ReduceOp::sum);
  });
  const auto describe = [](int r, int of, int p, int t) {
    return "MixedComm rank " + std::to_string(r) + " of " + std::to_string(of) + " (process " +
           std::to_string(p) + " thread " + std::to_string(t) + " of a 2 x 2 grid)";
  };
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const Seen& s = seen[static_cast<std::size_t>(r)];
    const int p = r / 2, t = r % 2;
    REQUIRE(s.pipeline == describe(t, 2, p, t));
    REQUIRE(s.replicas == describe(p, 2, p, t));
    REQUIRE(s.reversed == describe(1 - p, 2, p, t));
    REQUIRE(s.pipeline_sum[0] == (p == 0 ? 3.0f : 7.0f));
    REQUIRE(s.replica_sum[0] == (t == 0 ? 4.0f : 6.0f));
    REQUIRE(s.pipeline_root == std::vector<float>{float(p * 2 + 1), 0.25f});
    REQUIRE(s.replica_root == std::vector<std::uint64_t>{std::uint64_t(2 + t) << 35});
    REQUIRE(s.from_stage == std::vector<float>{float(p * 2 + 1 - t), 1.5f});
    REQUIRE(s.from_replica == std::vector<float>{float((1 - p) * 2 + t), 1.5f});
    if (t == 0) REQUIRE(s.from_root[0] == float(2 - r) + 100.0f);
    // Replica group {t, 2 + t} reversed: rank 2 + t is 0, rank t is 1.
    REQUIRE(s.reversed_sum[0] == float(10 + 2 * t + 2));
  }
}

TEST_CASE("MixedComm: a group over processes unevenly reduces within each process first") {
  // 3 x 2, ranks {0, 1, 2}: two threads of process 0 and one of process 1;
  // {3, 4, 5}: one of process 1 and two of process 2.
  constexpr std::size_t length = 257;
  const auto data = rank_data(6, length, 70);
  std::vector<std::vector<float>> from(6, std::vector<float>(3, 0.0f));
  std::vector<int> sizes(6);
  auto sums = data;
  on_grid(3, 2, [&](MixedComm& c, int, int) {
    const int r = c.rank();
    auto half = c.split(r / 3, r);
    sizes[static_cast<std::size_t>(r)] = half.size();
    half.all_reduce(std::span<float>(sums[static_cast<std::size_t>(r)]), ReduceOp::sum);
    // A ring in each group, through one process and across two.
    const std::vector<float> message{float(r), float(half.rank()), 2.5f};
    half.send(std::span<const float>(message), (half.rank() + 1) % 3);
    half.recv(std::span<float>(from[static_cast<std::size_t>(r)]), (half.rank() + 2) % 3);
  });
  std::vector<float> low(length), high(length);
  for (std::size_t j = 0; j < length; ++j) {
    low[j] = (data[0][j] + data[1][j]) + data[2][j];
    high[j] = data[3][j] + (data[4][j] + data[5][j]);
  }
  REQUIRE_FALSE(same_bits(high, grid_sum(std::vector<std::vector<float>>(data.begin() + 3, data.end()), 1, 3)));
  for (int r = 0; r < 6; ++r) {
    INFO("rank " << r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE(sizes[i] == 3);
    REQUIRE(same_bits(sums[i], r < 3 ? low : high));
    const int group_rank = r % 3, previous = (group_rank + 2) % 3;
    REQUIRE(from[i] == std::vector<float>{float(r - group_rank + previous), float(previous), 2.5f});
  }
}

TEST_CASE("MixedComm: a cancel wakes every waiting rank, in every process, with its reason") {
  using clock = std::chrono::steady_clock;
  const comm::Timeout timeout(60.0);
  const std::vector<std::pair<const char*, Body>> waits{
      {"all_reduce",
       [](MixedComm& c, int, int) {
         std::vector<float> data(4, 1.0f);
         c.all_reduce(std::span<float>(data), ReduceOp::sum);
       }},
      {"recv", [](MixedComm& c, int, int) {
         // Rank 0 waits for the other process, 1 for its own, 2 for rank 3.
         std::vector<float> data(2);
         c.recv(std::span<float>(data), c.rank() == 1 ? 0 : 3);
       }}};
  for (const auto& [what, wait] : waits) {
    INFO(what);
    const auto begun = clock::now();
    const auto run = run_grid(
        {2, 2},
        [&](MixedComm& c, int p, int t) {
          if (c.rank() == 3) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            c.cancel("the data file is corrupt");
            return;
          }
          wait(c, p, t);
        },
        timeout);
    REQUIRE(clock::now() - begun < timeout / 2);
    REQUIRE(run.errors[3].empty());
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r);
      REQUIRE_THAT(run.errors[static_cast<std::size_t>(r)],
                   Catch::Contains("aborted the group: ") &&
                       Catch::Contains("the data file is corrupt"));
    }
  }
}

TEST_CASE("MixedComm: a rank that never comes times every other rank out, none hangs") {
  using clock = std::chrono::steady_clock;
  const comm::Timeout timeout(0.5);
  const auto begun = clock::now();
  // The report time at the timeout: no line on std::cerr.
  const auto run = run_grid(
      {2, 2},
      [](MixedComm& c, int, int) {
        if (c.rank() != 3) c.barrier();
      },
      timeout, timeout);
  REQUIRE(clock::now() - begun < std::chrono::seconds(10));
  REQUIRE(run.errors[3].empty());
  REQUIRE_THAT(run.errors[2], Catch::Contains("MixedComm rank 2 of 4") &&
                                  Catch::Contains("LocalComm barrier on rank 0 of 2 timed out"));
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    REQUIRE_THAT(run.errors[static_cast<std::size_t>(r)], Catch::Contains("timed out"));
  }
}

TEST_CASE("MixedComm: processes that give different thread counts all raise, naming both") {
  const auto run = run_grid({2, 3}, [](MixedComm&, int, int) {});
  REQUIRE_THAT(run.create_errors[0],
               Catch::Contains("MixedComm::create on process 0 of 2: this process gives 2 "
                               "thread(s) but process 1 gives 3; every process must give the "
                               "same count"));
  REQUIRE_THAT(run.create_errors[1],
               Catch::Contains("MixedComm::create on process 1 of 2: this process gives 3 "
                               "thread(s) but process 0 gives 2"));
}
