// The CUDA layer runners of gpu/layers.cuh against the CPU layers
// on the same seeded inputs: Tanh, Sigmoid, GELU, GlobalAvgPool, Dropout
// (masks equal to the bit, also when replayed from a CUDA graph with a new
// step) and (Sync)BatchNorm 2d/1d with and without the fused ReLU, in
// training and evaluation. Where no GPU is present every test reports
// skipped (77).
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/backend/cuda/graph.hpp>
#include <loom/gpu/layers.cuh>
#include <loom/layers/layers.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

// Not `using namespace loom`: the CUDA headers define a ::cuda namespace of
// their own.
namespace test = loom::test;
namespace gpu = loom::gpu;
using loom::Bind;
using loom::Shape;

namespace {

// Equal values, or NaN on both sides (the GPU's NaN payload may differ).
void require_same(const std::vector<float>& got, const std::vector<float>& ref,
                  const std::string& what) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (!(got[i] == ref[i] || (std::isnan(got[i]) && std::isnan(ref[i])))) {
      std::ostringstream msg;
      msg << what << " differs at index " << i << ": got " << got[i] << ", expected " << ref[i];
      FAIL(msg.str());
    }
  SUCCEED();
}

// Device buffers and the LayerCall of one layer's forward and backward.
struct Call {
  gpu::DeviceBuffer<float> x, y, dy, dx;
  gpu::detail::LayerCall call;

  Call(const std::vector<float>& x_host, std::size_t y_size, const std::vector<float>& dy_host,
       cudaStream_t stream)
      : x(test::to_device(x_host)),
        y(y_size, "test output"),
        dy(test::to_device(dy_host)),
        dx(x_host.size(), "test input gradient") {
    call.x = x.data();
    call.y = y.data();
    call.dy = dy.data();
    call.dx = dx.data();
    call.stream = stream;
  }
};

template <class L, class Fn>
void check_pointwise(std::size_t n, std::uint64_t seed) {
  constexpr std::size_t size = L::input_shape::size;
  // Up to |x| = 12: Sigmoid's and Tanh's saturated tails, GELU's zero one.
  const auto x = test::random_vector<float>(n * size, seed, -12.0, 12.0);
  const auto dy = test::random_vector<float>(n * size, seed + 1);
  std::vector<float> y(n * size), dx(n * size);
  loom::detail::run_forward<L, float>(nullptr, x.data(), y.data(), nullptr, n, {});
  loom::detail::run_backward<L, float>(nullptr, x.data(), y.data(), dy.data(), dx.data(), nullptr,
                                       nullptr, n, false, {});

  gpu::DeviceContext context;
  gpu::PointwiseRunner<L, Fn> runner(context, n, 0, false);
  REQUIRE(runner.scratch_bytes() == 0);
  Call c(x, n * size, dy, context.stream.get());
  runner.forward(c.call);
  // Backward from the CPU's y, so that its error is the derivative's alone.
  auto y_cpu = test::to_device(y);
  c.call.y = y_cpu.data();
  runner.backward(c.call);
  context.stream.synchronize();
  // CUDA's tanhf, expf and erff are within 2 ulp, glibc's erf too, and the
  // CPU's float tanh and sigmoid (backend/cpu/transcendental.hpp) within 2.4.
  test::require_close(test::to_host(c.y), y, {1e-6, 1e-5}, std::string(L::kind) + " y");
  test::require_close(test::to_host(c.dx), dx, {1e-6, 1e-5}, std::string(L::kind) + " dx");
}

}  // namespace

TEST_CASE("cuda layers: Tanh, Sigmoid and GELU equal the CPU layers") {
  for (const std::size_t n : {1u, 3u, 64u}) {
    check_pointwise<Bind<loom::Tanh, Shape<1000>, 2>, loom::detail::TanhFn>(n, 10);
    check_pointwise<Bind<loom::Sigmoid, Shape<5, 7, 9>, 2>, loom::detail::SigmoidFn>(n, 11);
    check_pointwise<Bind<loom::GELU, Shape<3000>, 2>, loom::detail::GeluFn>(n, 12);
  }
}

namespace {

template <class L>
void check_global_avg_pool(std::size_t n, std::uint64_t seed) {
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  const auto x = test::random_vector<float>(n * in, seed);
  const auto dy = test::random_vector<float>(n * out, seed + 1);
  std::vector<float> y(n * out), dx(n * in);
  loom::detail::run_forward<L, float>(nullptr, x.data(), y.data(), nullptr, n, {});
  loom::detail::run_backward<L, float>(nullptr, x.data(), y.data(), dy.data(), dx.data(), nullptr,
                                       nullptr, n, false, {});

  gpu::DeviceContext context;
  gpu::GlobalAvgPoolRunner<L> runner(context, n, 0, false);
  Call c(x, n * out, dy, context.stream.get());
  runner.forward(c.call);
  runner.backward(c.call);
  context.stream.synchronize();
  // The same float additions in the same order and the same division.
  test::require_equal(test::to_host(c.y), y, "GlobalAvgPool y");
  test::require_equal(test::to_host(c.dx), dx, "GlobalAvgPool dx");
}

}  // namespace

TEST_CASE("cuda layers: GlobalAvgPool equals the CPU layer to the bit") {
  for (const std::size_t n : {1u, 5u, 256u}) {
    check_global_avg_pool<Bind<loom::GlobalAvgPool, Shape<16, 7, 7>, 9>>(n, 20);
    check_global_avg_pool<Bind<loom::GlobalAvgPool, Shape<512, 1, 1>, 9>>(n, 21);
    check_global_avg_pool<Bind<loom::GlobalAvgPool, Shape<3, 28, 28>, 9>>(n, 22);
  }
}

namespace {

constexpr std::uint64_t dropout_seed = 1234;

// Inputs with a NaN every 97 elements: a dropped NaN stays NaN.
std::vector<float> with_nans(std::size_t count, std::uint64_t seed) {
  auto v = test::random_vector<float>(count, seed);
  for (std::size_t i = 5; i < count; i += 97) v[i] = std::numeric_limits<float>::quiet_NaN();
  return v;
}

template <class L>
void check_dropout(std::size_t n, std::uint64_t step, std::uint64_t first_sample, bool training) {
  constexpr std::size_t size = L::input_shape::size;
  const auto x = with_nans(n * size, 30 + step);
  const auto dy = with_nans(n * size, 31 + step);
  const loom::Pass pass{
      .training = training, .seed = dropout_seed, .step = step, .first_sample = first_sample};
  const loom::LayerContext<float> context{.pass = pass};
  std::vector<float> y(n * size), dx(n * size);
  loom::detail::run_forward<L, float>(nullptr, x.data(), y.data(), nullptr, n, context);
  loom::detail::run_backward<L, float>(nullptr, x.data(), y.data(), dy.data(), dx.data(), nullptr,
                                       nullptr, n, false, context);

  gpu::DeviceContext device;
  gpu::DropoutRunner<L> runner(device, n, 0, false);
  auto device_pass = test::to_device(std::vector<gpu::DevicePass>{
      {.seed = dropout_seed, .step = step, .first_sample = first_sample}});
  Call c(x, n * size, dy, device.stream.get());
  c.call.training = training;
  c.call.pass = device_pass.data();
  runner.forward(c.call);
  runner.backward(c.call);
  device.stream.synchronize();
  require_same(test::to_host(c.y), y, "Dropout y");
  require_same(test::to_host(c.dx), dx, "Dropout dx");
}

}  // namespace

TEST_CASE("cuda layers: Dropout draws exactly the CPU layer's mask") {
  using Flat = Bind<loom::Dropout<0.25>, Shape<1000>, 4>;
  using Image = Bind<loom::Dropout<0.5>, Shape<3, 7, 9>, 7>;
  for (const bool training : {true, false})
    for (const std::size_t n : {1u, 8u, 33u}) {
      check_dropout<Flat>(n, 0, 0, training);
      check_dropout<Flat>(n, 17, 40, training);
      check_dropout<Image>(n, 3, 1000003, training);
    }
}

TEST_CASE(
    "cuda layers: a captured Dropout step replayed with a new DevicePass draws the new "
    "step's mask") {
  using L = Bind<loom::Dropout<0.3>, Shape<257>, 2>;
  constexpr std::size_t n = 16, size = L::input_shape::size;
  const auto x = test::random_vector<float>(n * size, 40);
  const auto cpu_y = [&](std::uint64_t step, std::uint64_t first_sample) {
    std::vector<float> y(n * size);
    const loom::LayerContext<float> context{
        .pass = {
            .training = true, .seed = dropout_seed, .step = step, .first_sample = first_sample}};
    loom::detail::run_forward<L, float>(nullptr, x.data(), y.data(), nullptr, n, context);
    return y;
  };

  gpu::DeviceContext device;
  const cudaStream_t stream = device.stream.get();
  gpu::DropoutRunner<L> runner(device, n, 0, false);
  gpu::DeviceBuffer<gpu::DevicePass> device_pass(1, "test pass");
  Call c(x, n * size, x, stream);
  c.call.training = true;
  c.call.pass = device_pass.data();
  gpu::StepGraphs<> graphs;
  const auto run_step = [&](std::uint64_t step, std::uint64_t first_sample) {
    const gpu::DevicePass pass{.seed = dropout_seed, .step = step, .first_sample = first_sample};
    // Enqueued before the replay, as the owner writes the pass of each step.
    LOOM_CUDA_CHECK(
        cudaMemcpyAsync(device_pass.data(), &pass, sizeof(pass), cudaMemcpyHostToDevice, stream));
    graphs.run(n, stream, [&](cudaStream_t s) {
      c.call.stream = s;
      runner.forward(c.call);
    });
    device.stream.synchronize();
    return test::to_host(c.y);
  };
  const auto first = run_step(1, 0);
  require_same(first, cpu_y(1, 0), "captured step 1");
  const auto second = run_step(2, 0);
  REQUIRE(graphs.graphs() == 1);
  require_same(second, cpu_y(2, 0), "replayed step 2");
  REQUIRE(second != first);
  require_same(run_step(2, 64), cpu_y(2, 64), "replayed step 2 at global sample 64");
}

namespace {

struct BatchNormResult {
  std::vector<float> y, state, dx, dparams;
};

// The CPU layer: forward (updating `state` in training), then backward.
template <class L>
BatchNormResult cpu_batch_norm(const std::vector<float>& params, std::vector<float> state,
                               const std::vector<float>& x, const std::vector<float>& dy,
                               std::size_t n, bool training) {
  BatchNormResult r{std::vector<float>(x.size()),
                    {},
                    std::vector<float>(x.size()),
                    std::vector<float>(params.size(), -99.0f)};
  const loom::LayerContext<float> context{.pass = {.training = training}, .state = state.data()};
  loom::detail::run_forward<L, float>(params.data(), x.data(), r.y.data(), nullptr, n, context);
  loom::detail::run_backward<L, float>(params.data(), x.data(), r.y.data(), dy.data(), r.dx.data(),
                                       r.dparams.data(), nullptr, n, false, context);
  r.state = std::move(state);
  return r;
}

template <class L>
BatchNormResult gpu_batch_norm(const std::vector<float>& params, const std::vector<float>& state,
                               const std::vector<float>& x, const std::vector<float>& dy,
                               std::size_t n, bool training, loom::comm::NcclComm* replicas) {
  constexpr std::size_t channels = L::channels;
  gpu::DeviceContext context;
  gpu::BatchNormRunner<L> runner(context, n, 0, false);
  Call c(x, x.size(), dy, context.stream.get());
  auto d_params = test::to_device(params);
  auto d_state = test::to_device(state);
  // Poisoned, so that backward must overwrite the parameter gradients.
  auto d_dparams = test::to_device(std::vector<float>(params.size(), -99.0f));
  // One spare byte: a runner must not ask for less than it uses.
  gpu::DeviceBuffer<unsigned char> scratch(runner.scratch_bytes() + 1, "test scratch");
  c.call.weights = d_params.data();
  c.call.bias = d_params.data() + channels;
  c.call.dweights = d_dparams.data();
  c.call.dbias = d_dparams.data() + channels;
  c.call.state = d_state.data();
  c.call.scratch = scratch.data();
  c.call.scratch_bytes = scratch.size();
  c.call.training = training;
  c.call.replicas = replicas;
  runner.forward(c.call);
  runner.backward(c.call);
  context.stream.synchronize();
  return {test::to_host(c.y), test::to_host(d_state), test::to_host(c.dx),
          test::to_host(d_dparams)};
}

template <class L>
void check_batch_norm(std::size_t n, std::uint64_t seed, bool synced = false) {
  constexpr std::size_t channels = L::channels;
  auto params = test::random_vector<float>(2 * channels, seed, 0.5, 1.5);  // gamma
  const auto beta = test::random_vector<float>(channels, seed + 1, -0.5, 0.5);
  std::copy(beta.begin(), beta.end(), params.begin() + channels);
  auto state = test::random_vector<float>(2 * channels, seed + 2, -0.2, 0.2);  // running mean
  const auto running_var = test::random_vector<float>(channels, seed + 3, 0.5, 1.5);
  std::copy(running_var.begin(), running_var.end(), state.begin() + channels);
  // Off-centre inputs: a mean of ~1 against a spread of ~2.
  const auto x = test::random_vector<float>(n * L::input_shape::size, seed + 4, -1.0, 3.0);
  const auto dy = test::random_vector<float>(x.size(), seed + 5);

  std::vector<loom::comm::NcclComm> ranks;
  if (synced) ranks = loom::comm::NcclComm::create_local({0});
  for (const bool training : {true, false}) {
    INFO("batch " << n << (training ? ", training" : ", evaluation")
                  << (synced ? ", all-reduced over one rank" : ""));
    const auto ref = cpu_batch_norm<L>(params, state, x, dy, n, training);
    const auto got =
        gpu_batch_norm<L>(params, state, x, dy, n, training, synced ? &ranks[0] : nullptr);
    if (training) {
      // The moments' double sums add in another order: at most an ulp of
      // float apart after rounding (1e-5 relative leaves 100x room).
      test::require_close(got.y, ref.y, {1e-6, 1e-5}, "BatchNorm y");
      test::require_close(got.state, ref.state, {1e-9, 1e-6}, "running statistics");
      test::require_close(got.dx, ref.dx, {1e-6, 1e-5}, "BatchNorm dx");
    } else {
      // The running statistics and the same float rounding: equal to the bit.
      test::require_equal(got.y, ref.y, "BatchNorm y");
      test::require_equal(got.state, ref.state, "running statistics");
      test::require_equal(got.dx, ref.dx, "BatchNorm dx");
    }
    test::require_close(got.dparams, ref.dparams, {1e-6, 1e-5}, "BatchNorm dgamma, dbeta");
  }
}

}  // namespace

TEST_CASE(
    "cuda layers: BatchNorm2d and BatchNorm1d, with and without ReLU, equal the CPU "
    "layers") {
  // C = 16 at n * plane up to 256 * 784 (49 chunks per channel), C = 512 at
  // plane 1, and sizes that fill no chunk or block evenly.
  for (const std::size_t n : {1u, 7u, 64u, 256u}) {
    check_batch_norm<Bind<loom::BatchNorm2d, Shape<16, 28, 28>, 3>>(n, 50);
    check_batch_norm<Bind<loom::Fused<loom::BatchNorm2d, loom::ReLU>, Shape<16, 28, 28>, 3>>(n, 51);
  }
  for (const std::size_t n : {2u, 5u, 64u, 300u}) {
    check_batch_norm<Bind<loom::BatchNorm1d, Shape<512>, 2>>(n, 52);
    check_batch_norm<Bind<loom::Fused<loom::BatchNorm1d, loom::ReLU>, Shape<512>, 2>>(n, 53);
    check_batch_norm<Bind<loom::BatchNorm2d, Shape<3, 5, 7>, 6>>(n, 54);
  }
}

TEST_CASE("cuda layers: SyncBatchNorm all-reduced over one rank equals BatchNorm") {
  // The CPU reference runs without replicas: the unsynchronised two-pass
  // moments, against the GPU's sums of x and x^2 all-reduced through NCCL.
  for (const std::size_t n : {1u, 64u}) {
    check_batch_norm<Bind<loom::SyncBatchNorm2d, Shape<16, 28, 28>, 3>>(n, 60, true);
    check_batch_norm<Bind<loom::Fused<loom::SyncBatchNorm2d, loom::ReLU>, Shape<16, 28, 28>, 3>>(
        n, 61, true);
    check_batch_norm<Bind<loom::SyncBatchNorm1d, Shape<512>, 2>>(n + 1, 62, true);
  }
  // Without replicas a SyncBatchNorm is a BatchNorm.
  check_batch_norm<Bind<loom::SyncBatchNorm2d, Shape<16, 28, 28>, 3>>(8, 63);
}
