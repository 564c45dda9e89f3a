// The GRU and LSTM runners against the CPU layer on the same seeded weights
// and inputs: outputs, input gradient and every parameter gradient, and for
// loom's own runner (gpu/recurrent.cuh) the saved gate values too.
// cuDNN's (gpu/cudnn_rnn.cuh) keeps its own. Hidden sizes that are
// not multiples of 4 leave loom's per-step GEMMs' pointers 4- or 8-byte
// aligned only, and cuDNN's matrices oddly sized.
#include <cstdint>
#include <loom/gpu/cudnn_rnn.cuh>
#include <loom/gpu/recurrent.cuh>
#include <loom/layers/recurrent.hpp>
#include <string>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

namespace test = loom::test;

using test::to_device;
using test::to_host;

namespace {

// FP32 on both sides, no TF32: the GEMMs sum in different orders and the GPU
// fuses multiply-adds, a few ulps per step that back-propagation through
// time carries along.
constexpr test::Tolerance tolerance{1e-5, 1e-4};

template <class T>
std::vector<T> slice(const std::vector<T>& v, std::size_t begin, std::size_t end) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                        v.begin() + static_cast<std::ptrdiff_t>(end));
}

// A device buffer of `count` floats holding NaN everywhere: anything the
// runner should write but does not, or reads before writing, shows up.
loom::gpu::DeviceBuffer<float> poisoned(std::size_t count, const std::string& owner) {
  loom::gpu::DeviceBuffer<float> buffer(count, owner);
  LOOM_CUDA_CHECK(cudaMemset(buffer.data(), 0xFF, count * sizeof(float)));
  // The runner's stream is non-blocking: not ordered after this memset.
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  return buffer;
}

template <class L>
using LoomRunner = loom::gpu::RecurrentRunner<L>;
template <class L>
using CudnnRunner = loom::gpu::CudnnRecurrentRunner<L>;

template <class Spec, std::size_t Steps, std::size_t Features,
          template <class> class Runner = LoomRunner>
void check_against_cpu(std::size_t n, std::uint64_t seed) {
  using L = loom::Bind<Spec, loom::Shape<Steps, Features>, 1>;
  constexpr bool cudnn = std::is_same_v<Runner<L>, CudnnRunner<L>>;
  const std::string name = std::string(cudnn ? "cuDNN " : "loom ") + std::string(L::kind) +
                           "<" + std::to_string(L::H) +
                           (Spec::sequence ? ", sequence" : "") + "> over " +
                           std::to_string(Steps) + " x " + std::to_string(Features) + ", n " +
                           std::to_string(n) + ": ";
  INFO(name);
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;

  std::vector<float> params(L::param_count);
  L::init(params.data(), seed, false);
  const auto x = test::random_vector<float>(n * in, seed + 1);
  const auto dy = test::random_vector<float>(n * out, seed + 2);
  std::vector<float> y(n * out), dx(n * in), dparams(L::param_count), saved(n * L::saved),
      work(n * L::workspace);
  loom::LayerContext<float> context;
  context.saved = saved.data();
  loom::detail::run_forward<L, float>(params.data(), x.data(), y.data(), work.data(), n, context);
  loom::detail::run_backward<L, float>(params.data(), x.data(), y.data(), dy.data(), dx.data(),
                                       dparams.data(), work.data(), n, false, context);

  loom::gpu::DeviceContext device;
  Runner<L> runner(device, n, std::size_t{32} << 20, false);
  auto d_weights = to_device(slice(params, 0, L::weight_count));
  auto d_bias = to_device(slice(params, L::weight_count, L::param_count));
  auto d_x = to_device(x);
  auto d_dy = to_device(dy);
  auto d_y = poisoned(n * out, "test y");
  auto d_dx = poisoned(n * in, "test dx");
  auto d_dweights = poisoned(L::weight_count, "test dweights");
  auto d_dbias = poisoned(L::bias_count, "test dbias");
  std::size_t saved_floats = n * L::saved;
  if constexpr (cudnn) saved_floats = runner.saved_floats();
  auto d_saved = poisoned(saved_floats, "test saved");
  const std::size_t scratch_floats = (runner.scratch_bytes() + sizeof(float) - 1) / sizeof(float);
  auto d_scratch = poisoned(scratch_floats, "test scratch");

  loom::gpu::detail::LayerCall c;
  c.weights = d_weights.data();
  c.bias = d_bias.data();
  c.x = d_x.data();
  c.y = d_y.data();
  c.dy = d_dy.data();
  c.dx = d_dx.data();
  c.dweights = d_dweights.data();
  c.dbias = d_dbias.data();
  c.scratch = reinterpret_cast<unsigned char*>(d_scratch.data());
  c.scratch_bytes = runner.scratch_bytes();
  c.stream = device.stream.get();
  c.training = true;
  c.saved = d_saved.data();
  runner.forward(c);
  runner.backward(c);
  device.stream.synchronize();

  test::require_close(to_host(d_y), y, tolerance, name + "y");
  if constexpr (!cudnn)
    test::require_close(to_host(d_saved), saved, tolerance, name + "saved gates and states");
  const auto gpu_dx = to_host(d_dx);
  test::require_close(gpu_dx, dx, tolerance, name + "dx");
  const auto dweights = to_host(d_dweights);
  const auto dbias = to_host(d_dbias);
  test::require_close(slice(dweights, L::w_ih, L::w_hh), slice(dparams, L::w_ih, L::w_hh),
                      tolerance, name + "dW_ih");
  test::require_close(slice(dweights, L::w_hh, L::weight_count),
                      slice(dparams, L::w_hh, L::weight_count), tolerance, name + "dW_hh");
  test::require_close(slice(dbias, 0, L::GH), slice(dparams, L::b_ih, L::b_hh), tolerance,
                      name + "db_ih");
  test::require_close(slice(dbias, L::GH, 2 * L::GH), slice(dparams, L::b_hh, L::param_count),
                      tolerance, name + "db_hh");

  // Again without an input gradient, over the first gradients: they are
  // overwritten (an added second copy would double them), and dx is left
  // alone. (A fresh forward first: cuDNN's backward may write its reserve.)
  c.dx = nullptr;
  runner.forward(c);
  runner.backward(c);
  device.stream.synchronize();
  test::require_close(to_host(d_dweights), slice(dparams, 0, L::weight_count), tolerance,
                      name + "dweights of a second backward");
  test::require_close(to_host(d_dbias), slice(dparams, L::weight_count, L::param_count), tolerance,
                      name + "dbias of a second backward");
  test::require_equal(to_host(d_dx), gpu_dx, name + "dx untouched without c.dx");
}

}  // namespace

TEST_CASE("cuda: GRU runner equals the CPU layer (outputs, saved gates, every gradient)") {
  check_against_cpu<loom::GRU<5>, 6, 3>(1, 11);
  check_against_cpu<loom::GRU<5>, 6, 3>(7, 12);
  check_against_cpu<loom::GRU<5, true>, 6, 3>(4, 13);
  check_against_cpu<loom::GRU<6, true>, 5, 4>(3, 14);
  check_against_cpu<loom::GRU<5>, 1, 3>(5, 15);  // one step: no recurrent GEMM
  check_against_cpu<loom::GRU<33, true>, 12, 20>(16, 16);
}

TEST_CASE("cuda: LSTM runner equals the CPU layer (outputs, saved gates, every gradient)") {
  check_against_cpu<loom::LSTM<3>, 4, 7>(1, 21);
  check_against_cpu<loom::LSTM<3>, 4, 7>(9, 22);
  check_against_cpu<loom::LSTM<5, true>, 6, 3>(4, 23);
  check_against_cpu<loom::LSTM<6, true>, 5, 4>(3, 24);
  check_against_cpu<loom::LSTM<5>, 1, 3>(5, 25);
  check_against_cpu<loom::LSTM<33>, 12, 20>(16, 26);
}

TEST_CASE("cuda: GRU on cuDNN equals the CPU layer (outputs, every gradient)") {
  check_against_cpu<loom::GRU<5>, 6, 3, CudnnRunner>(1, 31);
  check_against_cpu<loom::GRU<5>, 6, 3, CudnnRunner>(7, 32);
  check_against_cpu<loom::GRU<5, true>, 6, 3, CudnnRunner>(4, 33);
  check_against_cpu<loom::GRU<6, true>, 5, 4, CudnnRunner>(3, 34);
  check_against_cpu<loom::GRU<5>, 1, 3, CudnnRunner>(5, 35);
  check_against_cpu<loom::GRU<33, true>, 12, 20, CudnnRunner>(16, 36);
}

TEST_CASE("cuda: LSTM on cuDNN equals the CPU layer (outputs, every gradient)") {
  check_against_cpu<loom::LSTM<3>, 4, 7, CudnnRunner>(1, 41);
  check_against_cpu<loom::LSTM<3>, 4, 7, CudnnRunner>(9, 42);
  check_against_cpu<loom::LSTM<5, true>, 6, 3, CudnnRunner>(4, 43);
  check_against_cpu<loom::LSTM<6, true>, 5, 4, CudnnRunner>(3, 44);
  check_against_cpu<loom::LSTM<5>, 1, 3, CudnnRunner>(5, 45);
  check_against_cpu<loom::LSTM<33>, 12, 20, CudnnRunner>(16, 46);
}

TEST_CASE("cuda: the cuDNN recurrent runner refuses a scratch smaller than its workspace") {
  using L = loom::Bind<loom::LSTM<33>, loom::Shape<12, 20>, 1>;
  loom::gpu::DeviceContext device;
  loom::gpu::CudnnRecurrentRunner<L> runner(device, 16, std::size_t{32} << 20, false);
  REQUIRE(runner.scratch_bytes() > 0);  // cuDNN's training workspace
  loom::gpu::detail::LayerCall c;
  c.scratch_bytes = runner.scratch_bytes() - 1;
  REQUIRE_THROWS_WITH(
      runner.forward(c),
      Catch::Contains("lstm<33> on cuDNN (layer 1, batch 16 x 12 steps x 20 features)") &&
          Catch::Contains(std::to_string(runner.scratch_bytes()) + " needed"));
}

TEST_CASE("cuda: the recurrent runner refuses a scratch smaller than it asked for") {
  using L = loom::Bind<loom::GRU<5>, loom::Shape<4, 3>, 1>;
  loom::gpu::DeviceContext device;
  loom::gpu::RecurrentRunner<L> runner(device, 2, std::size_t{32} << 20, false);
  loom::gpu::detail::LayerCall c;
  c.scratch_bytes = runner.scratch_bytes() - 1;
  REQUIRE_THROWS_WITH(
      runner.forward(c),
      Catch::Contains("bytes of scratch given") &&
          Catch::Contains(std::to_string(runner.scratch_bytes()) + " needed for a batch of 2"));
}
