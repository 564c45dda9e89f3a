// The CUDA layer runners of gpu/layers.cuh against the CPU layers
// on the same seeded inputs: Tanh, Sigmoid, GELU, GlobalAvgPool, Dropout
// (masks equal to the bit, also when replayed from a CUDA graph with a new
// step) and (Sync)BatchNorm 2d/1d with and without the fused ReLU, in
// training and evaluation; BatchNorm1d over time and Conv1d (gpu/conv1d.cuh)
// on padded batches of sequences with their own lengths and NaN in the
// padding. Where no GPU is present every test reports skipped (77).
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/backend/cuda/graph.hpp>
#include <loom/gpu/conv1d.cuh>
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
  // The first run is uncaptured (StepGraphs warms each key up), the second
  // captured, the third a replay of that capture.
  const auto first = run_step(1, 0);
  REQUIRE(graphs.graphs() == 0);
  require_same(first, cpu_y(1, 0), "uncaptured step 1");
  const auto second = run_step(2, 0);
  REQUIRE(graphs.graphs() == 1);
  require_same(second, cpu_y(2, 0), "captured step 2");
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
                               std::size_t n, bool training,
                               const std::vector<std::int32_t>& lengths) {
  BatchNormResult r{std::vector<float>(x.size()),
                    {},
                    std::vector<float>(x.size()),
                    std::vector<float>(params.size(), -99.0f)};
  const loom::LayerContext<float> context{.pass = {.training = training},
                                          .state = state.data(),
                                          .frames = lengths.empty() ? nullptr : lengths.data()};
  loom::detail::run_forward<L, float>(params.data(), x.data(), r.y.data(), nullptr, n, context);
  loom::detail::run_backward<L, float>(params.data(), x.data(), r.y.data(), dy.data(), r.dx.data(),
                                       r.dparams.data(), nullptr, n, false, context);
  r.state = std::move(state);
  return r;
}

template <class L>
BatchNormResult gpu_batch_norm(const std::vector<float>& params, const std::vector<float>& state,
                               const std::vector<float>& x, const std::vector<float>& dy,
                               std::size_t n, bool training, loom::comm::NcclComm* replicas,
                               const std::vector<std::int32_t>& lengths) {
  constexpr std::size_t channels = L::channels;
  gpu::DeviceContext context;
  gpu::BatchNormRunner<L> runner(context, n, 0, false);
  Call c(x, x.size(), dy, context.stream.get());
  // A one-entry buffer when there are no lengths (a DeviceBuffer of 0 has none).
  auto d_lengths = test::to_device(lengths.empty() ? std::vector<std::int32_t>{0} : lengths);
  if (!lengths.empty()) {
    c.call.frames = d_lengths.data();
    c.call.host_frames = lengths.data();
  }
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

// NaN in every element of a padded frame of a time-major batch (n x
// Frames x C): a layer that reads padding, or lets it reach a sum, fails.
void poison_time_padding(std::vector<float>& v, const std::vector<std::int32_t>& lengths,
                    std::size_t frames, std::size_t width) {
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t t = static_cast<std::size_t>(lengths[s]); t < frames; ++t)
      for (std::size_t c = 0; c < width; ++c)
        v[(s * frames + t) * width + c] = std::numeric_limits<float>::quiet_NaN();
}

// Every element of a padded frame exactly zero, as the CPU layers write it.
void require_zero_time_padding(const std::vector<float>& v, const std::vector<std::int32_t>& lengths,
                          std::size_t frames, std::size_t width, const std::string& what) {
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t t = static_cast<std::size_t>(lengths[s]); t < frames; ++t)
      for (std::size_t c = 0; c < width; ++c) {
        INFO(what << ": sample " << s << ", frame " << t << ", channel " << c);
        REQUIRE(v[(s * frames + t) * width + c] == 0.0f);
      }
}

// lengths (over time only): each sample's valid frames, n of them; the
// padding of x and dy holds NaN.
template <class L>
void check_batch_norm(std::size_t n, std::uint64_t seed, bool synced = false,
                      const std::vector<std::int32_t>& lengths = {}) {
  constexpr std::size_t channels = L::channels;
  auto params = test::random_vector<float>(2 * channels, seed, 0.5, 1.5);  // gamma
  const auto beta = test::random_vector<float>(channels, seed + 1, -0.5, 0.5);
  std::copy(beta.begin(), beta.end(), params.begin() + channels);
  auto state = test::random_vector<float>(2 * channels, seed + 2, -0.2, 0.2);  // running mean
  const auto running_var = test::random_vector<float>(channels, seed + 3, 0.5, 1.5);
  std::copy(running_var.begin(), running_var.end(), state.begin() + channels);
  // Off-centre inputs: a mean of ~1 against a spread of ~2.
  auto x = test::random_vector<float>(n * L::input_shape::size, seed + 4, -1.0, 3.0);
  auto dy = test::random_vector<float>(x.size(), seed + 5);
  if (!lengths.empty()) {
    REQUIRE(lengths.size() == n);
    poison_time_padding(x, lengths, L::input_shape::dims[0], channels);
    poison_time_padding(dy, lengths, L::input_shape::dims[0], channels);
  }

  std::vector<loom::comm::NcclComm> ranks;
  if (synced) ranks = loom::comm::NcclComm::create_local({0});
  for (const bool training : {true, false}) {
    INFO("batch " << n << (training ? ", training" : ", evaluation")
                  << (synced ? ", all-reduced over one rank" : ""));
    const auto ref = cpu_batch_norm<L>(params, state, x, dy, n, training, lengths);
    const auto got = gpu_batch_norm<L>(params, state, x, dy, n, training,
                                       synced ? &ranks[0] : nullptr, lengths);
    if (!lengths.empty()) {
      require_zero_time_padding(got.y, lengths, L::input_shape::dims[0], channels, "BatchNorm y");
      require_zero_time_padding(got.dx, lengths, L::input_shape::dims[0], channels, "BatchNorm dx");
    }
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

TEST_CASE(
    "cuda layers: BatchNorm1d over time, with and without ReLU, takes statistics over the valid "
    "frames as the CPU layer does") {
  // Lengths from 0 to all 20 frames, NaN in the padding; C = 48 with
  // n * Frames = 6 x 20 (one chunk per channel) and C = 5 at 300 x 20 (two).
  const std::vector<std::int32_t> six{20, 13, 0, 1, 7, 20};
  check_batch_norm<Bind<loom::BatchNorm1d, Shape<20, 48>, 2>>(6, 70, false, six);
  check_batch_norm<Bind<loom::Fused<loom::BatchNorm1d, loom::ReLU>, Shape<20, 48>, 2>>(6, 71, false,
                                                                                       six);
  std::vector<std::int32_t> many(300);
  for (std::size_t s = 0; s < many.size(); ++s) many[s] = static_cast<std::int32_t>(s * 7 % 21);
  check_batch_norm<Bind<loom::Fused<loom::BatchNorm1d, loom::ReLU>, Shape<20, 5>, 4>>(300, 72,
                                                                                      false, many);
  // Every frame valid, lengths or not: the layer over time without padding.
  check_batch_norm<Bind<loom::BatchNorm1d, Shape<20, 48>, 2>>(3, 73, false,
                                                               std::vector<std::int32_t>(3, 20));
  check_batch_norm<Bind<loom::BatchNorm1d, Shape<20, 48>, 2>>(3, 74);
}

TEST_CASE("cuda layers: SyncBatchNorm1d over time all-reduced over one rank equals BatchNorm") {
  // The valid-frame count is all-reduced with the sums.
  check_batch_norm<Bind<loom::SyncBatchNorm1d, Shape<20, 48>, 2>>(6, 75, true,
                                                                  {20, 13, 0, 1, 7, 20});
  check_batch_norm<Bind<loom::Fused<loom::SyncBatchNorm1d, loom::ReLU>, Shape<20, 48>, 2>>(
      4, 76, true, {3, 20, 11, 19});
}

namespace {

struct Conv1dResult {
  std::vector<float> y, dx, dparams;
};

// Conv1d layer L on n = lengths.size() samples (lengths empty: all frames
// valid, no lengths given) from seeded weights, a nonzero bias and inputs
// with NaN in the padding: the CPU layer's y, dx and parameter gradients,
// and the runner's.
template <class L>
void check_conv1d(std::size_t n, const std::vector<std::int32_t>& lengths, std::uint64_t seed) {
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  constexpr std::size_t out_frames = L::output_shape::dims[0], out_channels = L::spec::out_channels;
  INFO(loom::detail::type_label<typename L::spec>() << " over " << L::frames << " x "
                                                     << L::channels << ", n " << n
                                                     << (lengths.empty() ? ", no lengths" : ""));
  std::vector<float> params(L::param_count);
  L::init(params.data(), seed, false);
  const auto bias = test::random_vector<float>(out_channels, seed + 1, -0.5, 0.5);
  std::copy(bias.begin(), bias.end(), params.begin() + L::weight_count);
  auto x = test::random_vector<float>(n * in, seed + 2);
  auto dy = test::random_vector<float>(n * out, seed + 3);
  std::vector<std::int32_t> out_lengths;
  for (const auto length : lengths)
    out_lengths.push_back(static_cast<std::int32_t>(L::frames_out(static_cast<std::size_t>(length))));
  if (!lengths.empty()) {
    REQUIRE(lengths.size() == n);
    poison_time_padding(x, lengths, L::frames, L::channels);
    poison_time_padding(dy, out_lengths, out_frames, out_channels);
  }

  Conv1dResult ref{std::vector<float>(n * out), std::vector<float>(n * in),
                   std::vector<float>(L::param_count)};
  std::vector<float> work(L::workspace);
  const loom::LayerContext<float> context{.frames = lengths.empty() ? nullptr : lengths.data()};
  loom::detail::run_forward<L, float>(params.data(), x.data(), ref.y.data(), work.data(), n,
                                      context);
  loom::detail::run_backward<L, float>(params.data(), x.data(), ref.y.data(), dy.data(),
                                       ref.dx.data(), ref.dparams.data(), work.data(), n, false,
                                       context);

  gpu::DeviceContext device;
  gpu::Conv1dRunner<L> runner(device, n, std::size_t{32} << 20, false);
  Call c(x, n * out, dy, device.stream.get());
  auto d_weights = test::to_device(
      std::vector<float>(params.begin(), params.begin() + L::weight_count));
  auto d_bias = test::to_device(std::vector<float>(params.begin() + L::weight_count, params.end()));
  // Poisoned, so that backward must overwrite the parameter gradients.
  auto d_dweights = test::to_device(std::vector<float>(L::weight_count, -99.0f));
  auto d_dbias = test::to_device(std::vector<float>(L::param_count - L::weight_count, -99.0f));
  auto d_lengths = test::to_device(lengths.empty() ? std::vector<std::int32_t>{0} : lengths);
  // One spare byte: a runner must not ask for less than it uses.
  gpu::DeviceBuffer<unsigned char> scratch(runner.scratch_bytes() + 1, "test scratch");
  c.call.weights = d_weights.data();
  c.call.bias = d_bias.data();
  c.call.dweights = d_dweights.data();
  c.call.dbias = d_dbias.data();
  c.call.scratch = scratch.data();
  c.call.scratch_bytes = scratch.size();
  if (!lengths.empty()) {
    c.call.frames = d_lengths.data();
    c.call.host_frames = lengths.data();
  }
  runner.forward(c.call);
  runner.backward(c.call);
  device.stream.synchronize();
  Conv1dResult got{test::to_host(c.y), test::to_host(c.dx), test::to_host(d_dweights)};
  const auto dbias = test::to_host(d_dbias);
  got.dparams.insert(got.dparams.end(), dbias.begin(), dbias.end());

  if (!lengths.empty()) {
    require_zero_time_padding(got.y, out_lengths, out_frames, out_channels, "Conv1d y");
    require_zero_time_padding(got.dx, lengths, L::frames, L::channels, "Conv1d dx");
  }
  // FP32 without TF32 on both sides, the same products summed in another
  // order (cuBLASLt's split of C x K = 15 to 40 terms, the weight GEMM over
  // the whole batch where the CPU adds sample by sample, up to 600 rows, and
  // FMA contraction): a few ulps of the largest terms, which cancellation
  // in mixed-sign sums leaves large against a small result; 1e-5 absolute
  // covers that at |values| of order 1 to 10 and any padding or NaN leak
  // (O(0.1) at least, or NaN) still fails.
  test::require_close(got.y, ref.y, {1e-5, 1e-4}, "Conv1d y");
  test::require_close(got.dx, ref.dx, {1e-5, 1e-4}, "Conv1d dx");
  test::require_close(got.dparams, ref.dparams, {1e-5, 1e-4}, "Conv1d dweight, dbias");
}

}  // namespace

TEST_CASE("cuda layers: Conv1d, with and without ReLU, equals the CPU layer on padded sequences") {
  // Same padding (K 3, P 1): lengths down to one frame and 0 padding rows.
  using Same = Bind<loom::Conv1d<6, 3, 1, 1>, Shape<20, 5>, 2>;
  using SameRelu = Bind<loom::Fused<loom::Conv1d<6, 3, 1, 1>, loom::ReLU>, Shape<20, 5>, 2>;
  // Stride 2, dilation 2, padding 2 (span 9): lengths from 5, the shortest
  // with an output frame; taps that skip frames and windows past both ends.
  using Strided = Bind<loom::Conv1d<7, 5, 2, 2, 2>, Shape<23, 8>, 3>;
  using StridedRelu = Bind<loom::Fused<loom::Conv1d<7, 5, 2, 2, 2>, loom::ReLU>, Shape<23, 8>, 3>;
  const std::vector<std::int32_t> same{20, 13, 1, 7, 20, 2};
  const std::vector<std::int32_t> strided{23, 9, 5, 16, 12, 23, 6};
  check_conv1d<Same>(same.size(), same, 80);
  check_conv1d<SameRelu>(same.size(), same, 81);
  check_conv1d<Strided>(strided.size(), strided, 82);
  check_conv1d<StridedRelu>(strided.size(), strided, 83);
  // No lengths: every frame of every sample.
  check_conv1d<SameRelu>(4, {}, 84);
  check_conv1d<Strided>(3, {}, 85);
  // A larger batch: 100 samples of lengths 5 to 23.
  std::vector<std::int32_t> many(100);
  for (std::size_t s = 0; s < many.size(); ++s) many[s] = static_cast<std::int32_t>(5 + s * 7 % 19);
  check_conv1d<StridedRelu>(many.size(), many, 86);
}
