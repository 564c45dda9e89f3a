// CUDA ops against the CPU backend on the same inputs. Compiled in every CI
// run; where no GPU (or no driver) is present every test exits with 77, which
// CTest reports as skipped (SKIP_RETURN_CODE), never as passed.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <cstring>
#include <loom/backend/cpu/cpu.hpp>
#include <loom/backend/cuda/memory.hpp>
#include <loom/backend/cuda/sgd.cuh>
#include <loom/backend/cuda/softmax_xent.cuh>
#include <vector>

#include "loom_test.hpp"

// Not `using namespace loom`: the CUDA headers define a ::cuda namespace of
// their own, so an unqualified cuda:: would be ambiguous.
namespace test = loom::test;
namespace cpu = loom::cpu;

namespace {

template <class T>
loom::cuda::DeviceBuffer<T> to_device(const std::vector<T>& host) {
  loom::cuda::DeviceBuffer<T> buffer(host.size(), "test input");
  LOOM_CUDA_CHECK(
      cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return buffer;
}

template <class T>
std::vector<T> to_host(const loom::cuda::DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  LOOM_CUDA_CHECK(
      cudaMemcpy(host.data(), buffer.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace

TEST_CASE("cuda: SGD update with momentum, weight decay and Nesterov equals the CPU backend") {
  constexpr std::size_t n = 100003;  // not a multiple of the block size
  for (const bool nesterov : {false, true}) {
    auto w = test::random_vector<float>(n, 1);
    const auto g = test::random_vector<float>(n, 2);
    auto v = test::random_vector<float>(n, 3);
    auto dw = to_device(w);
    auto dg = to_device(g);
    auto dv = to_device(v);
    for (int step = 0; step < 3; ++step) {
      cpu::sgd_update(w.data(), g.data(), v.data(), n, 0.1f, 0.9f, 0.01f, nesterov);
      loom::cuda::sgd_update(dw.data(), dg.data(), dv.data(), n, 0.1f, 0.9f, 0.01f, nesterov,
                             nullptr);
    }
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    // The GPU contracts multiply-adds into FMAs: a few ulps apart.
    test::require_close(to_host(dw), w, {1e-6, 1e-5}, "weights");
    test::require_close(to_host(dv), v, {1e-6, 1e-5}, "velocity");
  }
}

TEST_CASE("cuda: softmax cross-entropy equals the CPU backend") {
  constexpr std::size_t batch = 1000, classes = 10;
  const auto logits = test::random_vector<float>(batch * classes, 4, -8.0, 8.0);
  std::vector<std::int32_t> labels(batch);
  for (std::size_t i = 0; i < batch; ++i) labels[i] = static_cast<std::int32_t>(i * 7 % classes);
  std::vector<float> grad(batch * classes);
  const auto expected =
      cpu::softmax_xent(logits.data(), labels.data(), batch, classes, 1.0f / 2000.0f, grad.data());

  auto d_logits = to_device(logits);
  auto d_labels = to_device(labels);
  loom::cuda::DeviceBuffer<float> d_grad(batch * classes, "test gradient");
  loom::cuda::SoftmaxXentWorkspace workspace(batch);
  const auto sums = loom::cuda::softmax_xent(d_logits.data(), d_labels.data(), batch, classes, 2000,
                                             d_grad.data(), workspace, nullptr);
  REQUIRE(sums.correct == expected.correct);
  REQUIRE(sums.loss == Approx(expected.loss).epsilon(1e-5));
  test::require_close(to_host(d_grad), grad, {1e-8, 1e-4}, "dlogits");
}

TEST_CASE("cuda: a label outside the classes and an impossible allocation are loom::Errors") {
  const std::vector<float> logits(20);
  const std::vector<std::int32_t> labels{1, 12};
  auto d_logits = to_device(logits);
  auto d_labels = to_device(labels);
  loom::cuda::SoftmaxXentWorkspace workspace(2);
  REQUIRE_THROWS_WITH(loom::cuda::softmax_xent(d_logits.data(), d_labels.data(), 2, 10, 2,
                                               static_cast<float*>(nullptr), workspace, nullptr),
                      Catch::Contains("label 12 of sample 1 is outside the network's 10 classes"));
  REQUIRE_THROWS_WITH(loom::cuda::DeviceBuffer<float>(std::size_t{1} << 50, "a test's huge buffer"),
                      Catch::Contains("out of GPU memory on cuda:0: a test's huge buffer needs") &&
                          Catch::Contains("bytes are free"));
}

int main(int argc, char** argv) {
  // Listing (catch_discover_tests, at build time) needs no GPU.
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::strncmp(argv[i], "--list", 6) == 0;
  int devices = 0;
  const cudaError_t status = listing ? cudaSuccess : cudaGetDeviceCount(&devices);
  if (!listing && (status != cudaSuccess || devices == 0)) {
    std::printf("skipped: no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "none found");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
