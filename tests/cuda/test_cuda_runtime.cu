// The CUDA runtime pieces a training step stands on: the plan-sized device
// arena, a step's scalars through a ring of pinned slots, step capture as a
// CUDA graph (after one uncaptured run; replay must equal direct execution,
// bit for bit), and NCCL's communicator (one rank here: NCCL refuses two
// ranks on one GPU), and its timeout.
#include <loom/backend/cuda/arena.hpp>
#include <loom/backend/cuda/graph.hpp>
#include <loom/backend/cuda/sgd.cuh>
#include <loom/backend/cuda/staging.hpp>
#include <loom/backend/cuda/stream.hpp>
#include <loom/comm/nccl_comm.hpp>
#include <chrono>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

namespace test = loom::test;

TEST_CASE("cuda runtime: the device arena carves aligned buffers and refuses to exceed its plan") {
  using Arena = loom::gpu::DeviceArena;
  Arena arena(Arena::padded_bytes<float>(1000) + Arena::padded_bytes<int>(3), "test arena");
  float* a = arena.take<float>(1000);
  int* b = arena.take<int>(3);
  REQUIRE(reinterpret_cast<std::uintptr_t>(a) % Arena::alignment == 0);
  REQUIRE(reinterpret_cast<std::uintptr_t>(b) % Arena::alignment == 0);
  REQUIRE(arena.used() == arena.capacity());
  REQUIRE_THROWS_WITH(arena.take<float>(1),
                      Catch::Contains("test arena: device memory plan exceeded"));
}

TEST_CASE("cuda runtime: a step replayed from a CUDA graph equals the step run directly") {
  constexpr std::size_t n = 4099;
  const auto w0 = test::random_vector<float>(n, 30);
  const auto g = test::random_vector<float>(n, 31);
  auto run = [&](bool capture) {
    auto w = test::to_device(w0);
    auto v = test::to_device(std::vector<float>(n, 0.0f));
    auto grads = test::to_device(g);
    loom::gpu::Stream stream;
    loom::gpu::StepGraphs graphs(capture);
    for (int step = 0; step < 4; ++step)
      graphs.run(n, stream.get(), [&](cudaStream_t s) {
        loom::gpu::sgd_update(w.data(), grads.data(), v.data(), n, 0.05f, 0.9f, 0.0f, false, s);
      });
    stream.synchronize();
    REQUIRE(graphs.graphs() == (capture ? 1u : 0u));
    return test::to_host(w);
  };
  test::require_equal(run(true), run(false), "weights after 4 steps");
}

TEST_CASE("cuda nccl: a one-rank NcclComm reduces, broadcasts, splits, a bad peer is an error") {
  auto ranks = loom::comm::NcclComm::create_local({0});
  REQUIRE(ranks.size() == 1);
  auto& comm = ranks[0];
  REQUIRE(comm.rank() == 0);
  REQUIRE(comm.size() == 1);
  const auto host = test::random_vector<float>(1000, 5);
  auto data = test::to_device(host);
  const std::span<float> device(data.data(), data.size());
  comm.all_reduce(device, loom::comm::ReduceOp::sum);
  test::require_equal(test::to_host(data), host, "sum over one rank");
  comm.all_reduce(device, loom::comm::ReduceOp::average);
  test::require_equal(test::to_host(data), host, "average over one rank");
  comm.broadcast(device, 0);
  comm.barrier();
  test::require_equal(test::to_host(data), host, "broadcast from rank 0");
  auto alone = comm.split(0, 0);
  REQUIRE(alone.size() == 1);
  REQUIRE_THROWS_WITH(comm.send(std::span<const float>(data.data(), 4), 1),
                      Catch::Contains("ncclSend on NcclComm rank 0 of 1 on cuda:0: rank 1 does "
                                      "not exist"));
  REQUIRE_THROWS_WITH(loom::comm::NcclComm::create_local({0, 0}),
                      Catch::Contains("ncclCommInitAll over 2 GPU(s) failed"));
}

// Keeps its stream busy for `ns` nanoseconds of the GPU's global timer: work
// that never ends in time, as a collective waiting for a lost rank is.
__global__ void busy_for(unsigned long long ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) return;
    __nanosleep(1000);
  }
}

TEST_CASE("cuda nccl: a wait past the timeout aborts the communicator and raises") {
  auto ranks = loom::comm::NcclComm::create_local({0});
  auto& comm = ranks[0];
  comm.set_timeout(loom::comm::Timeout(0.3));
  busy_for<<<1, 1, 0, comm.stream()>>>(3'000'000'000ull);
  LOOM_CUDA_CHECK(cudaGetLastError());
  loom::gpu::Event done;
  done.record(comm.stream());
  REQUIRE_THROWS_WITH(comm.wait_event(done.get(), "a test's step"),
                      Catch::Contains("a test's step on NcclComm rank 0 of 1 on cuda:0 timed out "
                                      "after") &&
                          Catch::Contains("The communicator was aborted (ncclCommAbort)"));
  auto data = test::to_device(std::vector<float>(4, 1.0f));
  REQUIRE_THROWS_WITH(comm.all_reduce(std::span<float>(data.data(), 4), loom::comm::ReduceOp::sum),
                      Catch::Contains("the communicator was aborted"));
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());  // the busy kernel ends in its own time
}

TEST_CASE("cuda runtime: a key's first step runs uncaptured, its second is captured, later ones replay") {
  loom::gpu::Stream stream;
  loom::gpu::StepGraphs<int> graphs;
  auto w = test::to_device(std::vector<float>(1, 0.0f));
  auto velocity = test::to_device(std::vector<float>(1, 0.0f));
  const auto minus_one = test::to_device(std::vector<float>(1, -1.0f));
  std::vector<cudaStreamCaptureStatus> enqueued;  // the stream's state each time the step enqueued
  const auto run = [&](int key) {
    graphs.run(key, stream.get(), [&](cudaStream_t s) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      LOOM_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
      enqueued.push_back(status);
      // w += 1: counts the runs on the device.
      loom::gpu::sgd_update(w.data(), minus_one.data(), velocity.data(), 1, 1.0f, 0.0f, 0.0f,
                            false, s);
    });
  };
  run(7);
  REQUIRE(graphs.graphs() == 0);
  run(7);
  REQUIRE(graphs.graphs() == 1);
  run(7);
  run(7);
  run(8);  // a new key: uncaptured again
  stream.synchronize();
  REQUIRE(enqueued == std::vector{cudaStreamCaptureStatusNone, cudaStreamCaptureStatusActive,
                                  cudaStreamCaptureStatusNone});
  REQUIRE(graphs.graphs() == 1);
  REQUIRE(test::to_host(w) == std::vector<float>{5.0f});
}

TEST_CASE("cuda runtime: ScalarStager's pinned slots are reused only after their copies ran") {
  loom::gpu::ScalarStager stager(4);
  REQUIRE(stager.slots() == 4);
  loom::gpu::Stream stream;
  constexpr int count = 10;
  loom::gpu::DeviceBuffer<double> values(count, "staged values");
  // The stream is busy for 200 ms: every copy is still queued when the host
  // stages the fifth value, which must wait for the first copy to read its
  // slot rather than overwrite it.
  busy_for<<<1, 1, 0, stream.get()>>>(200'000'000ull);
  LOOM_CUDA_CHECK(cudaGetLastError());
  const auto start = std::chrono::steady_clock::now();
  for (int k = 0; k < count; ++k) stager.copy(values.data() + k, 1.5 * k, stream.get());
  const auto waited = std::chrono::steady_clock::now() - start;
  stream.synchronize();
  std::vector<double> expected;
  for (int k = 0; k < count; ++k) expected.push_back(1.5 * k);
  REQUIRE(test::to_host(values) == expected);
  REQUIRE(waited >= std::chrono::milliseconds(100));

  // A copy inside a capture would read its slot at every replay: refused.
  loom::gpu::Stream captured;
  LOOM_CUDA_CHECK(cudaStreamBeginCapture(captured.get(), cudaStreamCaptureModeThreadLocal));
  CHECK_THROWS_WITH(stager.copy(values.data(), 1.0, captured.get()),
                    Catch::Contains("ScalarStager: a copy of 8 bytes onto a stream being "
                                    "captured into a CUDA graph"));
  cudaGraph_t graph = nullptr;
  LOOM_CUDA_CHECK(cudaStreamEndCapture(captured.get(), &graph));
  LOOM_CUDA_CHECK(cudaGraphDestroy(graph));
}
