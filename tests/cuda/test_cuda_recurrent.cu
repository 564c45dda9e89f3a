// The GRU and LSTM runners against the CPU layer on the same seeded weights
// and inputs: outputs, input gradient and every parameter gradient, and for
// loom's own runner (gpu/recurrent.cuh) the saved gate values too.
// cuDNN's (gpu/cudnn_rnn.cuh) keeps its own; it also runs both directions
// (BiGRU, BiLSTM) and per-sample lengths, here over padded batches whose
// padding holds NaN. Hidden sizes that are not multiples of 4 leave loom's
// per-step GEMMs' pointers 4- or 8-byte aligned only, and cuDNN's matrices
// oddly sized.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
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
// time carries along. The reverse direction and shorter samples run the
// same arithmetic over at most as many steps, so the same bound holds.
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

// Sample s's steps at or past frames[s] of an n x Steps x width tensor set to NaN.
void poison_padding(std::vector<float>& v, const std::vector<std::int32_t>& frames,
                    std::size_t steps, std::size_t width) {
  for (std::size_t s = 0; s < frames.size(); ++s)
    std::fill(v.begin() + static_cast<std::ptrdiff_t>(
                              (s * steps + static_cast<std::size_t>(frames[s])) * width),
              v.begin() + static_cast<std::ptrdiff_t>((s + 1) * steps * width),
              std::numeric_limits<float>::quiet_NaN());
}

// frames: each sample's valid frames (n of them), or empty for all; the
// padding of x, and of dy for a sequence output, holds NaN, which must
// reach nothing.
template <class Spec, std::size_t Steps, std::size_t Features,
          template <class> class Runner = LoomRunner>
void check_against_cpu(std::size_t n, std::uint64_t seed,
                       const std::vector<std::int32_t>& frames = {}) {
  using L = loom::Bind<Spec, loom::Shape<Steps, Features>, 1>;
  constexpr bool cudnn = std::is_same_v<Runner<L>, CudnnRunner<L>>;
  std::string lengths;
  for (const std::int32_t f : frames) lengths += " " + std::to_string(f);
  const std::string name =
      std::string(cudnn ? "cuDNN " : "loom ") + std::string(L::kind) + "<" +
      std::to_string(L::H) + (Spec::sequence ? ", sequence" : "") +
      (Spec::bidirectional ? ", bidirectional" : "") + "> over " + std::to_string(Steps) + " x " +
      std::to_string(Features) + ", n " + std::to_string(n) +
      (frames.empty() ? std::string() : ", frames" + lengths) + ": ";
  INFO(name);
  REQUIRE((frames.empty() || frames.size() == n));
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;

  std::vector<float> params(L::param_count);
  L::init(params.data(), seed, false);
  auto x = test::random_vector<float>(n * in, seed + 1);
  auto dy = test::random_vector<float>(n * out, seed + 2);
  if (!frames.empty()) {
    poison_padding(x, frames, Steps, Features);
    if constexpr (Spec::sequence) poison_padding(dy, frames, Steps, L::width);
  }
  std::vector<float> y(n * out), dx(n * in), dparams(L::param_count), saved(n * L::saved),
      work(n * L::workspace);
  loom::LayerContext<float> context;
  context.saved = saved.data();
  context.frames = frames.empty() ? nullptr : frames.data();
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
  auto d_frames =
      frames.empty() ? loom::gpu::DeviceBuffer<std::int32_t>() : to_device(frames);
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
  if (!frames.empty()) {
    c.frames = d_frames.data();
    c.host_frames = frames.data();
  }
  if constexpr (cudnn) REQUIRE(CudnnRunner<L>::capturable(c) == frames.empty());
  runner.forward(c);
  runner.backward(c);
  device.stream.synchronize();

  test::require_close(to_host(d_y), y, tolerance, name + "y");
  if constexpr (!cudnn)
    test::require_close(to_host(d_saved), saved, tolerance, name + "saved gates and states");
  const auto gpu_dx = to_host(d_dx);
  test::require_close(gpu_dx, dx, tolerance, name + "dx");
  // The gradients in the layer's parameter order: the weight block, then
  // the bias block (which holds a reverse direction's four tensors).
  auto gpu_dparams = to_host(d_dweights);
  const auto dbias = to_host(d_dbias);
  gpu_dparams.insert(gpu_dparams.end(), dbias.begin(), dbias.end());
  struct Tensor {
    std::size_t begin, end;
    const char* what;
  };
  for (std::size_t d = 0; d < L::directions; ++d) {
    const std::size_t first = d * L::direction_params;
    for (const Tensor& t : {Tensor{L::w_ih, L::w_hh, "dW_ih"}, Tensor{L::w_hh, L::b_ih, "dW_hh"},
                            Tensor{L::b_ih, L::b_hh, "db_ih"},
                            Tensor{L::b_hh, L::direction_params, "db_hh"}})
      test::require_close(slice(gpu_dparams, first + t.begin, first + t.end),
                          slice(dparams, first + t.begin, first + t.end), tolerance,
                          name + t.what + (d == 1 ? " (reverse direction)" : ""));
  }

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

TEST_CASE("cuda: BiGRU and BiLSTM on cuDNN equal the CPU layer (outputs, every gradient)") {
  check_against_cpu<loom::BiGRU<5>, 6, 3, CudnnRunner>(1, 51);
  check_against_cpu<loom::BiGRU<5>, 6, 3, CudnnRunner>(7, 52);
  check_against_cpu<loom::GRU<6, false, true>, 5, 4, CudnnRunner>(3, 53);  // last states
  check_against_cpu<loom::BiGRU<33>, 12, 20, CudnnRunner>(16, 54);
  check_against_cpu<loom::BiLSTM<3>, 4, 7, CudnnRunner>(9, 55);
  check_against_cpu<loom::LSTM<5, false, true>, 6, 3, CudnnRunner>(4, 56);
  check_against_cpu<loom::BiLSTM<5>, 1, 3, CudnnRunner>(5, 57);  // one step
  check_against_cpu<loom::BiLSTM<33>, 12, 20, CudnnRunner>(16, 58);
}

// Lengths in no order (cuDNN's unpacked layout needs none), the longest
// below Steps in some batches, one sample of one frame.
TEST_CASE("cuda: GRU and LSTM on cuDNN honour per-sample lengths, NaN in the padding") {
  const std::vector<std::int32_t> mixed{6, 2, 5, 1}, short_only{3, 1, 2, 3};
  check_against_cpu<loom::GRU<5, true>, 6, 3, CudnnRunner>(4, 61, mixed);
  check_against_cpu<loom::GRU<5>, 6, 3, CudnnRunner>(4, 62, mixed);
  check_against_cpu<loom::GRU<5, true>, 6, 3, CudnnRunner>(4, 63, short_only);
  check_against_cpu<loom::LSTM<5, true>, 6, 3, CudnnRunner>(4, 64, mixed);
  check_against_cpu<loom::LSTM<5>, 6, 3, CudnnRunner>(4, 65, short_only);
  std::vector<std::int32_t> many(16);
  for (std::size_t s = 0; s < many.size(); ++s)
    many[s] = static_cast<std::int32_t>(1 + (s * 7) % 12);
  check_against_cpu<loom::GRU<33, true>, 12, 20, CudnnRunner>(16, 66, many);
  check_against_cpu<loom::LSTM<33>, 12, 20, CudnnRunner>(16, 67, many);
}

TEST_CASE("cuda: BiGRU and BiLSTM on cuDNN honour per-sample lengths, NaN in the padding") {
  const std::vector<std::int32_t> mixed{6, 2, 5, 1}, short_only{3, 1, 2, 3};
  check_against_cpu<loom::BiGRU<5>, 6, 3, CudnnRunner>(4, 71, mixed);
  check_against_cpu<loom::GRU<5, false, true>, 6, 3, CudnnRunner>(4, 72, mixed);
  check_against_cpu<loom::BiGRU<6>, 6, 4, CudnnRunner>(4, 73, short_only);
  check_against_cpu<loom::BiLSTM<5>, 6, 3, CudnnRunner>(4, 74, mixed);
  check_against_cpu<loom::LSTM<5, false, true>, 6, 3, CudnnRunner>(4, 75, short_only);
  std::vector<std::int32_t> many(16);
  for (std::size_t s = 0; s < many.size(); ++s)
    many[s] = static_cast<std::int32_t>(12 - (s * 5) % 12);
  check_against_cpu<loom::BiGRU<33>, 12, 20, CudnnRunner>(16, 76, many);
  check_against_cpu<loom::BiLSTM<33>, 12, 20, CudnnRunner>(16, 77, many);
}

// Apart from the others: cuDNN's documents do not say that a length of 0 is
// accepted, and a refusal here should not hide the results above. The CPU
// gives such a sample zero outputs and zero input gradients.
TEST_CASE("cuda: a sample with no frames on cuDNN gives the CPU's zeros") {
  const std::vector<std::int32_t> frames{3, 0, 6};
  check_against_cpu<loom::GRU<5, true>, 6, 3, CudnnRunner>(3, 81, frames);
  check_against_cpu<loom::LSTM<5>, 6, 3, CudnnRunner>(3, 82, frames);
  check_against_cpu<loom::BiGRU<5>, 6, 3, CudnnRunner>(3, 83, frames);
  check_against_cpu<loom::LSTM<5, false, true>, 6, 3, CudnnRunner>(3, 84, frames);
}

TEST_CASE("cuda: the cuDNN recurrent runner refuses bad lengths and lengths under capture") {
  using L = loom::Bind<loom::BiGRU<5>, loom::Shape<6, 3>, 1>;
  loom::gpu::DeviceContext device;
  CudnnRunner<L> runner(device, 2, std::size_t{32} << 20, false);
  auto d_scratch = poisoned((runner.scratch_bytes() + sizeof(float) - 1) / sizeof(float),
                            "test scratch");
  std::vector<std::int32_t> frames{6, 7};
  auto d_frames = to_device(frames);
  loom::gpu::detail::LayerCall c;
  c.scratch = reinterpret_cast<unsigned char*>(d_scratch.data());
  c.scratch_bytes = runner.scratch_bytes();
  c.stream = device.stream.get();
  const std::string where =
      "gru<5, bidirectional> on cuDNN (layer 1, batch 2 x 6 steps x 3 features)";
  REQUIRE(CudnnRunner<L>::capturable(c));
  c.frames = d_frames.data();
  REQUIRE_THROWS_WITH(runner.forward(c), Catch::Contains(where) &&
                                             Catch::Contains("host_frames null"));
  c.host_frames = frames.data();
  REQUIRE_FALSE(CudnnRunner<L>::capturable(c));
  REQUIRE_THROWS_WITH(runner.forward(c),
                      Catch::Contains(where) &&
                          Catch::Contains("sample 1 has 7 frames, outside 0..6"));
  frames[1] = 4;
  // Under capture the call stops before it enqueues anything.
  LOOM_CUDA_CHECK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal));
  REQUIRE_THROWS_WITH(runner.forward(c), Catch::Contains(where) &&
                                             Catch::Contains("being captured into a CUDA graph"));
  cudaGraph_t graph = nullptr;
  LOOM_CUDA_CHECK(cudaStreamEndCapture(c.stream, &graph));
  if (graph != nullptr) LOOM_CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST_CASE("cuda: the loom recurrent runner refuses per-sample lengths") {
  using L = loom::Bind<loom::GRU<5>, loom::Shape<4, 3>, 1>;
  loom::gpu::DeviceContext device;
  loom::gpu::RecurrentRunner<L> runner(device, 2, std::size_t{32} << 20, false);
  const std::vector<std::int32_t> frames{4, 2};
  auto d_frames = to_device(frames);
  loom::gpu::detail::LayerCall c;
  c.scratch_bytes = runner.scratch_bytes();
  c.frames = d_frames.data();
  c.host_frames = frames.data();
  for (const bool backward : {false, true})
    REQUIRE_THROWS_WITH(backward ? runner.backward(c) : runner.forward(c),
                        Catch::Contains("RecurrentRunner<gru> (layer 1): per-sample lengths") &&
                            Catch::Contains("inside a block (Residual, Series, ...)"));
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
