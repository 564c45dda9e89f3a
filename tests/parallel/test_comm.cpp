// LocalComm: the collectives between worker threads of one process, their
// fixed reduction order, and how misuse and a failing rank end as errors.
#include <loom/loom.hpp>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
namespace test = loom::test;

namespace {

// Runs body(comm) on one thread per rank; returns each rank's error text
// ("" when it returned normally).
std::vector<std::string> on_ranks(int n, const std::function<void(comm::LocalComm&)>& body,
                                  comm::Timeout timeout = comm::collective_timeout(),
                                  comm::Timeout report_after = comm::collective_report_after()) {
  auto comms = comm::LocalComm::create(n, timeout, report_after);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(comms[static_cast<std::size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// What is written to std::cerr while it lives.
class CerrCapture {
 public:
  CerrCapture() : saved_(std::cerr.rdbuf(text_.rdbuf())) {}
  CerrCapture(const CerrCapture&) = delete;
  CerrCapture& operator=(const CerrCapture&) = delete;
  ~CerrCapture() { std::cerr.rdbuf(saved_); }
  std::string text() const { return text_.str(); }

 private:
  std::ostringstream text_;
  std::streambuf* saved_;
};

// The lines of `text` that begin with `start`, each without its start.
std::vector<std::string> lines_after(const std::string& text, const std::string& start) {
  std::vector<std::string> found;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(start, 0) == 0) found.push_back(line.substr(start.size()));
  return found;
}

// "0.2 s in ...": the seconds a report line says it waited, and the rest.
std::pair<double, std::string> waited_and_rest(const std::string& line) {
  std::size_t used = 0;
  const double seconds = std::stod(line, &used);
  return {seconds, line.substr(used)};
}

}  // namespace

TEST_CASE("LocalComm: all_reduce sums in rank order, the same bits on every rank") {
  for (int n : {1, 2, 3, 4}) {
    constexpr std::size_t length = 1001;  // not a multiple of the rank count
    std::vector<std::vector<float>> data(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      data[static_cast<std::size_t>(r)] = test::random_vector<float>(length, 10 + r, -1e3, 1e3);
    std::vector<float> expected(length);
    for (std::size_t j = 0; j < length; ++j) {
      float total = data[0][j];
      for (int r = 1; r < n; ++r) total += data[static_cast<std::size_t>(r)][j];
      expected[j] = total;
    }
    auto results = data;
    const auto errors = on_ranks(n, [&](comm::LocalComm& c) {
      c.all_reduce(std::span<float>(results[static_cast<std::size_t>(c.rank())]),
                   comm::ReduceOp::sum);
    });
    for (int r = 0; r < n; ++r) {
      INFO(n << " ranks, rank " << r);
      REQUIRE(errors[static_cast<std::size_t>(r)].empty());
      test::require_equal(results[static_cast<std::size_t>(r)], expected, "reduced");
    }
  }
}

TEST_CASE("LocalComm: average, double and uint64 reductions, broadcast, barrier") {
  std::vector<std::vector<double>> mean(3, std::vector<double>(5));
  std::vector<std::vector<std::uint64_t>> counts(3, std::vector<std::uint64_t>(2));
  std::vector<std::vector<float>> shared(3, std::vector<float>(7, 0.0f));
  std::atomic<int> before_barrier{0};
  std::vector<int> seen_at_barrier(3);
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    for (std::size_t j = 0; j < 5; ++j) mean[r][j] = static_cast<double>(r * 10 + j);
    c.all_reduce(std::span<double>(mean[r]), comm::ReduceOp::average);
    counts[r] = {r + 1, 100 * (r + 1)};
    c.all_reduce(std::span<std::uint64_t>(counts[r]), comm::ReduceOp::sum);
    if (r == 2) shared[r] = test::random_vector<float>(7, 99);
    c.broadcast(std::span<float>(shared[r]), 2);
    before_barrier += 1;
    c.barrier();
    seen_at_barrier[r] = before_barrier.load();
  });
  for (std::size_t r = 0; r < 3; ++r) {
    REQUIRE(errors[r].empty());
    for (std::size_t j = 0; j < 5; ++j) REQUIRE(mean[r][j] == 10.0 + static_cast<double>(j));
    REQUIRE(counts[r] == std::vector<std::uint64_t>{6, 600});
    test::require_equal(shared[r], test::random_vector<float>(7, 99), "broadcast from rank 2");
    REQUIRE(seen_at_barrier[r] == 3);
  }
}

TEST_CASE("LocalComm: send/recv pairs and split into subgroups") {
  std::vector<std::vector<float>> got(4, std::vector<float>(3, 0.0f));
  std::vector<int> sub_rank(4), sub_size(4);
  std::vector<std::vector<float>> sub_sum(4, std::vector<float>(1));
  const auto errors = on_ranks(4, [&](comm::LocalComm& c) {
    const int r = c.rank();
    const std::vector<float> mine{float(r), float(r) + 0.5f, float(r) * 2};
    // A ring: each rank sends to the next and receives from the previous.
    if (r % 2 == 0) {
      c.send(std::span<const float>(mine), (r + 1) % 4);
      c.recv(std::span<float>(got[static_cast<std::size_t>(r)]), (r + 3) % 4);
    } else {
      c.recv(std::span<float>(got[static_cast<std::size_t>(r)]), (r + 3) % 4);
      c.send(std::span<const float>(mine), (r + 1) % 4);
    }
    // Even and odd ranks; keys reverse the order inside each group.
    auto sub = c.split(r % 2, -r);
    sub_rank[static_cast<std::size_t>(r)] = sub.rank();
    sub_size[static_cast<std::size_t>(r)] = sub.size();
    sub_sum[static_cast<std::size_t>(r)][0] = float(r);
    sub.all_reduce(std::span<float>(sub_sum[static_cast<std::size_t>(r)]), comm::ReduceOp::sum);
  });
  for (int r = 0; r < 4; ++r) {
    const auto i = static_cast<std::size_t>(r);
    REQUIRE(errors[i].empty());
    const float from = float((r + 3) % 4);
    REQUIRE(got[i] == std::vector<float>{from, from + 0.5f, from * 2});
    REQUIRE(sub_size[i] == 2);
    REQUIRE(sub_rank[i] == (r < 2 ? 1 : 0));  // key -r: the higher rank comes first
    REQUIRE(sub_sum[i][0] == (r % 2 == 0 ? 2.0f : 4.0f));
  }
}

TEST_CASE("LocalComm: mismatched buffers are an error on every rank, not a hang") {
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    std::vector<float> data(c.rank() == 1 ? 9 : 8, 1.0f);
    c.all_reduce(std::span<float>(data), comm::ReduceOp::sum);
  });
  for (int r = 0; r < 3; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    REQUIRE_THAT(e, Catch::Contains("LocalComm all_reduce on rank " + std::to_string(r) + " of 3"));
    REQUIRE_THAT(e, Catch::Contains(r == 1 ? "rank 0 passed 8 float but this rank 9 float"
                                           : "rank 1 passed 9 float but this rank 8 float"));
    REQUIRE_THAT(e, Catch::Contains("every rank must pass a buffer of the same type and length"));
  }
  const auto sizes = on_ranks(2, [&](comm::LocalComm& c) {
    std::vector<float> data(c.rank() == 0 ? 4 : 5);
    if (c.rank() == 0)
      c.send(std::span<const float>(data), 1);  // buffered: returns at once
    else
      c.recv(std::span<float>(data), 0);
    c.barrier();
  });
  REQUIRE_THAT(sizes[1], Catch::Contains("LocalComm recv on rank 1 of 2") &&
                             Catch::Contains("rank 0 sent 16 bytes to rank 1, which expected 20"));
  // The sender learns of it at its next call.
  REQUIRE_THAT(sizes[0], Catch::Contains("LocalComm barrier on rank 0 of 2 stopped") &&
                             Catch::Contains("rank 0 sent 16 bytes to rank 1, which expected 20"));
}

TEMPLATE_TEST_CASE("LocalComm: reduce_scatter reduces rank r's slice in rank order, all_gather "
                   "gathers every rank's part",
                   "", float, double) {
  using T = TestType;
  for (int n : {1, 3, 4}) {
    constexpr std::size_t part = 251;
    const auto ranks = static_cast<std::size_t>(n);
    std::vector<std::vector<T>> data(ranks);
    for (std::size_t r = 0; r < ranks; ++r)
      data[r] = test::random_vector<T>(ranks * part, 20 + r, -1e3, 1e3);
    for (const auto op : {comm::ReduceOp::sum, comm::ReduceOp::average}) {
      INFO(n << " ranks, " << comm::op_name(op));
      std::vector<std::vector<T>> out(ranks, std::vector<T>(part));
      std::vector<std::vector<T>> all_reduced = data;  // all_reduce's bits, for comparison
      const auto errors = on_ranks(n, [&](comm::LocalComm& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        c.reduce_scatter(std::span<const T>(data[r]), std::span<T>(out[r]), op);
        c.all_reduce(std::span<T>(all_reduced[r]), op);
      });
      REQUIRE(errors == std::vector<std::string>(ranks));
      for (std::size_t r = 0; r < ranks; ++r) {
        INFO("rank " << r);
        std::vector<T> expected(part);
        for (std::size_t j = 0; j < part; ++j) {
          T total = data[0][r * part + j];
          for (std::size_t s = 1; s < ranks; ++s) total += data[s][r * part + j];
          if (op == comm::ReduceOp::average) total /= static_cast<T>(n);
          expected[j] = total;
        }
        test::require_equal(out[r], expected, "reduce_scatter's slice");
        test::require_equal(out[r],
                            std::vector<T>(all_reduced[r].begin() + static_cast<std::ptrdiff_t>(r * part),
                                           all_reduced[r].begin() +
                                               static_cast<std::ptrdiff_t>((r + 1) * part)),
                            "all_reduce's slice");
      }
    }
    std::vector<std::vector<T>> gathered(ranks, std::vector<T>(ranks * part));
    const auto errors = on_ranks(n, [&](comm::LocalComm& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      c.all_gather(std::span<const T>(data[r].data(), part), std::span<T>(gathered[r]));
    });
    REQUIRE(errors == std::vector<std::string>(ranks));
    std::vector<T> expected;
    for (std::size_t r = 0; r < ranks; ++r)
      expected.insert(expected.end(), data[r].begin(),
                      data[r].begin() + static_cast<std::ptrdiff_t>(part));
    for (std::size_t r = 0; r < ranks; ++r) test::require_equal(gathered[r], expected, "gathered");
  }
}

TEST_CASE("LocalComm: reduce_scatter and all_gather of small integers give exact sums and means") {
  // 3 ranks, n = 2: rank r gives 10 r + k at element k of 6.
  std::vector<std::vector<double>> out(3, std::vector<double>(2));
  std::vector<std::vector<float>> mean(3, std::vector<float>(2));
  std::vector<std::vector<float>> all(3, std::vector<float>(6));
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    std::vector<double> data(6);
    for (std::size_t k = 0; k < 6; ++k) data[k] = static_cast<double>(10 * r + k);
    c.reduce_scatter(std::span<const double>(data), std::span<double>(out[r]), comm::ReduceOp::sum);
    const std::vector<float> as_float(data.begin(), data.end());
    c.reduce_scatter(std::span<const float>(as_float), std::span<float>(mean[r]),
                     comm::ReduceOp::average);
    const std::vector<float> mine{float(r), -0.5f * float(r)};
    c.all_gather(std::span<const float>(mine), std::span<float>(all[r]));
  });
  REQUIRE(errors == std::vector<std::string>(3));
  // Slice r holds elements 2r and 2r+1: the sum over ranks is 30 + 3k.
  REQUIRE(out[0] == std::vector<double>{30.0, 33.0});
  REQUIRE(out[1] == std::vector<double>{36.0, 39.0});
  REQUIRE(out[2] == std::vector<double>{42.0, 45.0});
  REQUIRE(mean[0] == std::vector<float>{10.0f, 11.0f});
  REQUIRE(mean[2] == std::vector<float>{14.0f, 15.0f});
  for (const auto& a : all) REQUIRE(a == std::vector<float>{0.0f, -0.0f, 1.0f, -0.5f, 2.0f, -1.0f});
}

TEST_CASE("LocalComm: reduce_scatter and all_gather sizes that do not fit are an error on every rank") {
  // Rank 1's data is not size() * out.size(): every rank refuses, naming it.
  const auto unfit = on_ranks(3, [&](comm::LocalComm& c) {
    const std::vector<float> data(c.rank() == 1 ? 7 : 6, 1.0f);
    std::vector<float> out(2);
    c.reduce_scatter(std::span<const float>(data), std::span<float>(out), comm::ReduceOp::sum);
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    REQUIRE_THAT(unfit[static_cast<std::size_t>(r)],
                 Catch::Contains("LocalComm reduce_scatter on rank " + std::to_string(r) +
                                 " of 3: " + (r == 1 ? "this rank" : "rank 1") +
                                 " passed data of 7 float and out of 2; data must hold size() * "
                                 "out.size() = 6 elements"));
  }
  // Every rank's sizes fit, but rank 2's n is another: the same n or nothing.
  const auto uneven = on_ranks(3, [&](comm::LocalComm& c) {
    const std::size_t n = c.rank() == 2 ? 3 : 2;
    const std::vector<double> data(3 * n, 1.0);
    std::vector<double> out(n);
    c.reduce_scatter(std::span<const double>(data), std::span<double>(out), comm::ReduceOp::sum);
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    REQUIRE_THAT(uneven[static_cast<std::size_t>(r)],
                 Catch::Contains("LocalComm reduce_scatter on rank " + std::to_string(r) + " of 3: " +
                                 (r == 2 ? "rank 0 passed out of 2 double but this rank 3 double"
                                         : "rank 2 passed out of 3 double but this rank 2 double") +
                                 "; every rank must pass the same n (out.size()) and type"));
  }
  // all_gather alike; after a refused call the group goes on in step.
  std::vector<std::vector<float>> after(2, std::vector<float>(2));
  const auto gather = on_ranks(2, [&](comm::LocalComm& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    std::vector<float> all(r == 0 ? 5 : 4);
    const std::vector<float> mine{float(r), 1.0f};
    try {
      c.all_gather(std::span<const float>(mine), std::span<float>(all));
    } catch (const Error& e) {
      c.all_gather(std::span<const float>(mine.data(), 1), std::span<float>(after[r]));
      throw;
    }
  });
  REQUIRE_THAT(gather[0], Catch::Contains("LocalComm all_gather on rank 0 of 2: this rank passed "
                                          "all of 5 float and mine of 2; all must hold size() * "
                                          "mine.size() = 4 elements"));
  REQUIRE_THAT(gather[1], Catch::Contains("LocalComm all_gather on rank 1 of 2: rank 0 passed all "
                                          "of 5 float and mine of 2"));
  for (const auto& a : after) REQUIRE(a == std::vector<float>{0.0f, 1.0f});
  const auto uneven_gather = on_ranks(2, [&](comm::LocalComm& c) {
    const std::size_t n = c.rank() == 0 ? 1 : 2;
    const std::vector<float> mine(n);
    std::vector<float> all(2 * n);
    c.all_gather(std::span<const float>(mine), std::span<float>(all));
  });
  REQUIRE_THAT(uneven_gather[0], Catch::Contains("LocalComm all_gather on rank 0 of 2: rank 1 "
                                                 "passed mine of 2 float but this rank 1 float; "
                                                 "every rank must pass the same n (mine.size()) "
                                                 "and type"));
  REQUIRE_THAT(uneven_gather[1], Catch::Contains("LocalComm all_gather on rank 1 of 2: rank 0 "
                                                 "passed mine of 1 float but this rank 2 float"));
}

TEST_CASE("LocalComm: a rank that fails aborts the group, the others' calls raise its reason") {
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    if (c.rank() == 2) {
      c.cancel("the data file is corrupt");
      throw std::runtime_error("rank 2 failed");
    }
    std::vector<float> data(4, 1.0f);
    c.all_reduce(std::span<float>(data), comm::ReduceOp::sum);
  });
  REQUIRE(errors[2] == "rank 2 failed");
  for (int r : {0, 1})
    REQUIRE_THAT(errors[static_cast<std::size_t>(r)],
                 Catch::Contains("LocalComm all_reduce on rank " + std::to_string(r) +
                                 " of 3 stopped: rank 2 aborted the group: the data file is corrupt"));
}

TEST_CASE("LocalComm: a rank that never comes is given up after the timeout, and named") {
  // Long enough that rank 1 surely reaches the barrier before rank 0 gives
  // up, under sanitizers and a loaded machine too.
  const comm::Timeout timeout(2.0);
  REQUIRE(comm::LocalComm::create(3, timeout)[2].timeout() == timeout);
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    if (c.rank() == 2) return;  // returns without its all_reduce
    std::vector<float> data(4, 1.0f);
    c.all_reduce(std::span<float>(data), comm::ReduceOp::sum);
  }, timeout);
  REQUIRE(errors[2].empty());
  for (int r : {0, 1}) {
    // The first to give up aborts the group; the other times out too or is
    // stopped by it, and both say whom they waited for.
    const auto& e = errors[static_cast<std::size_t>(r)];
    REQUIRE_THAT(e, Catch::Contains("LocalComm all_reduce on rank " + std::to_string(r) + " of 3"));
    REQUIRE_THAT(e, Catch::Contains("timed out") && Catch::Contains("waiting for rank(s) 2"));
  }
  REQUIRE_THAT(errors[0] + errors[1], Catch::Contains("after 2 s waiting for rank(s) 2: that "
                                                      "rank's thread returned, hangs or made "
                                                      "different calls") &&
                                          Catch::Contains("LOOM_COLLECTIVE_TIMEOUT"));

  const auto unsent = on_ranks(2, [&](comm::LocalComm& c) {
    std::vector<float> data(4);
    if (c.rank() == 1) c.recv(std::span<float>(data), 0);  // rank 0 never sends
  }, timeout);
  REQUIRE(unsent[0].empty());
  REQUIRE_THAT(unsent[1], Catch::Contains("LocalComm recv on rank 1 of 2 timed out after 2 s "
                                          "waiting for rank 0's message"));

  SECTION("a subgroup keeps its parent's timeout") {
    const auto split = on_ranks(2, [&](comm::LocalComm& c) {
      const comm::LocalComm mine = c.split(c.rank(), 0);
      if (mine.timeout() != timeout || mine.size() != 1)
        throw std::runtime_error("split made a group of " + std::to_string(mine.size()) +
                                 " with a timeout of " + std::to_string(mine.timeout().count()));
    }, timeout);
    REQUIRE(split == std::vector<std::string>{"", ""});
  }
  REQUIRE_THROWS_WITH(comm::LocalComm::create(2, comm::Timeout(0.0)),
                      Catch::Contains("LocalComm::create: the timeout must be positive, got 0 s"));
}

TEST_CASE("LocalComm: a call past the report time names the ranks missing once, then completes") {
  const comm::Timeout timeout(30.0), report_after(0.2), late(1.0);
  REQUIRE(comm::LocalComm::create(2, timeout, report_after)[1].report_after() == report_after);
  CerrCapture captured;
  std::vector<std::vector<float>> data(3, std::vector<float>(5));
  std::atomic<int> waiting{0};
  const auto begun = std::chrono::steady_clock::now();
  const auto errors = on_ranks(3, [&](comm::LocalComm& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    data[r].assign(5, float(r + 1));
    if (c.rank() == 2) {
      while (waiting.load() < 2) std::this_thread::yield();
      std::this_thread::sleep_for(late);
    } else {
      waiting += 1;
    }
    c.all_reduce(std::span<float>(data[r]), comm::ReduceOp::sum);
  }, timeout, report_after);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begun;
  REQUIRE(errors == std::vector<std::string>{"", "", ""});
  for (const auto& d : data) REQUIRE(d == std::vector<float>(5, 6.0f));
  REQUIRE(took.count() < timeout.count());
  const std::string text = captured.text();
  INFO(text);
  for (int r : {0, 1}) {
    const auto lines = lines_after(text, "loom: rank " + std::to_string(r) + " of 3 has waited ");
    REQUIRE(lines.size() == 1);  // once, though it waited 5 times the report time
    const auto [waited, rest] = waited_and_rest(lines[0]);
    REQUIRE(waited >= report_after.count());
    REQUIRE(waited < late.count());
    REQUIRE(rest == " s in LocalComm all_reduce for rank(s) 2, which have not arrived (rank " +
                        std::to_string(1 - r) +
                        " is waiting too); the timeout is 30 s (LOOM_COLLECTIVE_TIMEOUT)");
  }
  REQUIRE(lines_after(text, "loom: rank 2 of 3").empty());  // it came last: no wait

  {  // a recv names the rank whose message it waits for
    CerrCapture recv_captured;
    std::vector<float> message(3, 0.0f);
    const auto recv_errors = on_ranks(2, [&](comm::LocalComm& c) {
      if (c.rank() == 0) {
        std::this_thread::sleep_for(late);
        c.send(std::span<const float>(std::vector<float>{1.0f, 2.0f, 3.0f}), 1);
      } else {
        c.recv(std::span<float>(message), 0);
      }
    }, timeout, report_after);
    REQUIRE(recv_errors == std::vector<std::string>{"", ""});
    REQUIRE(message == std::vector<float>{1.0f, 2.0f, 3.0f});
    const auto lines = lines_after(recv_captured.text(), "loom: rank 1 of 2 has waited ");
    REQUIRE(lines.size() == 1);
    REQUIRE(waited_and_rest(lines[0]).second ==
            " s in LocalComm recv for rank 0's message; the timeout is 30 s "
            "(LOOM_COLLECTIVE_TIMEOUT)");
  }
  {  // a report time at or above the timeout means never
    CerrCapture silent;
    const auto gave_up = on_ranks(2, [&](comm::LocalComm& c) {
      if (c.rank() == 1) c.barrier();  // rank 0 never comes
    }, comm::Timeout(0.3), comm::Timeout(0.3));
    REQUIRE_THAT(gave_up[1], Catch::Contains("LocalComm barrier on rank 1 of 2 timed out"));
    REQUIRE(silent.text().empty());
  }
}

TEST_CASE("Comm holds any Communicator, ops and ranks pass through") {
  STATIC_REQUIRE(comm::Communicator<comm::LocalComm>);
  auto locals = comm::LocalComm::create(2);
  std::vector<comm::Comm> held{comm::Comm(locals[0]), comm::Comm(locals[1])};
  std::vector<std::vector<float>> data{{1.0f, 2.0f}, {3.0f, 5.0f}};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      held[static_cast<std::size_t>(r)].all_reduce(std::span<float>(data[static_cast<std::size_t>(r)]),
                                                   comm::ReduceOp::average);
    });
  for (auto& t : threads) t.join();
  REQUIRE(data[0] == std::vector<float>{2.0f, 3.5f});
  REQUIRE(data[1] == std::vector<float>{2.0f, 3.5f});
  REQUIRE(held[1].rank() == 1);
  REQUIRE(held[1].describe() == "LocalComm rank 1 of 2");
}

TEST_CASE("Comm forwards reduce_scatter and all_gather of float, double and uint64") {
  std::vector<std::vector<float>> f(2, std::vector<float>(1));
  std::vector<std::vector<double>> d(2, std::vector<double>(4));
  std::vector<std::vector<std::uint64_t>> u(2, std::vector<std::uint64_t>(4));
  const auto errors = on_ranks(2, [&](comm::LocalComm& c) {
    comm::Comm held(c);
    const int r = held.rank();
    const auto i = static_cast<std::size_t>(r);
    const std::vector<float> fs{1.0f + float(r), 4.0f * float(r + 1)};
    held.reduce_scatter(std::span<const float>(fs), std::span<float>(f[i]),
                        comm::ReduceOp::average);
    const std::vector<double> mine{0.5 + r, -1.0 * r};
    held.all_gather(std::span<const double>(mine), std::span<double>(d[i]));
    const std::vector<std::uint64_t> mine_u{std::uint64_t(r) << 40, 7};
    held.all_gather(std::span<const std::uint64_t>(mine_u), std::span<std::uint64_t>(u[i]));
    const std::vector<std::uint64_t> sums = u[i];
    held.reduce_scatter(std::span<const std::uint64_t>(sums),
                        std::span<std::uint64_t>(u[i].data(), 2), comm::ReduceOp::sum);
  });
  REQUIRE(errors == std::vector<std::string>(2));
  REQUIRE(f[0] == std::vector<float>{1.5f});   // (1 + 2) / 2
  REQUIRE(f[1] == std::vector<float>{6.0f});   // (4 + 8) / 2
  for (const auto& all : d) REQUIRE(all == std::vector<double>{0.5, 0.0, 1.5, -1.0});
  // Gathered {0, 7, 2^40, 7} on both; rank r sums slice r of both.
  REQUIRE(u[0] == std::vector<std::uint64_t>{0, 14, std::uint64_t{1} << 40, 7});
  REQUIRE(u[1] == std::vector<std::uint64_t>{std::uint64_t{1} << 41, 14, std::uint64_t{1} << 40, 7});
}

TEST_CASE("comm: LOOM_COLLECTIVE_TIMEOUT and _REPORT set seconds, and a bad value is refused") {
  struct Setting {
    const char* variable;
    comm::Timeout (*read)();
    double fallback;
    const char* default_text;
  };
  for (const Setting& setting :
       {Setting{"LOOM_COLLECTIVE_TIMEOUT", comm::collective_timeout, 600.0, "600"},
        Setting{"LOOM_COLLECTIVE_REPORT", comm::collective_report_after, 30.0, "30"}}) {
    INFO(setting.variable);
    unsetenv(setting.variable);
    REQUIRE(setting.read().count() == setting.fallback);
    setenv(setting.variable, "2.5", 1);
    REQUIRE(setting.read().count() == 2.5);
    for (const char* bad : {"0", "-3", "ten", "5s", "1e9", "1e12"}) {
      setenv(setting.variable, bad, 1);
      REQUIRE_THROWS_WITH(setting.read(),
                          Catch::Contains(std::string(setting.variable) + "='" + bad +
                                          "' is not a number of seconds: give one above 0 and "
                                          "below 1e9 (the default is " + setting.default_text +
                                          ")"));
    }
    unsetenv(setting.variable);
  }
  setenv("LOOM_COLLECTIVE_REPORT", "0.5", 1);
  REQUIRE(comm::LocalComm::create(2)[0].report_after().count() == 0.5);
  unsetenv("LOOM_COLLECTIVE_REPORT");
}
