// The transformer's layers on the GPU (gpu/transformer.cuh and the block
// runner) against the CPU layers, on windows of Debian's fortunes text:
// Embedding and PositionEmbedding to the bit (their gradients add in the
// CPU's order), LayerNorm, RMSNorm, TiedLinear, CausalSelfAttention (plain
// and rotary) and a whole TransformerBlock to fp32 rounding; cuBLASLt's
// strided batches against one product per batch; then the small GPT of
// tests/support/tiny_gpt.hpp trained by the Trainer on a GPU, alone and as
// two pipeline stages sharing it, untied and with its head tied to its
// embedding, and split over tensor ranks (TensorParallel), against the
// CPU, and a token id outside the vocabulary refused with the CPU's
// message. Where no GPU is present
// every test reports skipped (77).
#include <loom/gpu/device_layers.cuh>
#include <loom/loom.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"
#include "tiny_gpt.hpp"

// A namespace of its own: other test files have helpers of the same names
// (each file is a unit of its own, but one program).
namespace cuda_transformer_tests {

namespace test = loom::test;
using namespace loom;

namespace {

// One layer's forward and backward: its output, input gradient and
// parameter gradients (the CPU Model's order).
struct Pass1 {
  std::vector<float> y, dx, dparams;
};

template <class L>
Pass1 on_cpu(std::size_t n, const std::vector<float>& params, const std::vector<float>& x,
             const std::vector<float>& dy, Precision precision = Precision::fp32) {
  Pass1 r{std::vector<float>(n * L::output_shape::size), std::vector<float>(x.size()),
          std::vector<float>(L::param_count)};
  std::vector<float> saved(n * L::saved + 1), work(n * L::workspace + 1),
      state(L::state_count + 1);
  const LayerContext<float> context{.pass = {.training = true},
                                            .state = state.data(),
                                            .saved = saved.data(),
                                            .precision = precision};
  ::loom::detail::run_forward<L, float>(params.data(), x.data(), r.y.data(), work.data(), n, context);
  ::loom::detail::run_backward<L, float>(params.data(), x.data(), r.y.data(), dy.data(), r.dx.data(),
                                 r.dparams.data(), work.data(), n, false, context);
  return r;
}

// The same through the layer's CUDA runner (as DeviceLayers runs it: its
// parameters in the device layout, its saved area and scratch sized by it).
template <class L>
Pass1 on_gpu(std::size_t n, std::vector<float> params, const std::vector<float>& x,
             const std::vector<float>& dy, Precision precision = Precision::fp32) {
  const gpu::TensorMath math = gpu::tensor_math(precision, false);
  gpu::DeviceContext context;
  const cudaStream_t stream = context.stream.get();
  gpu::detail::LayerRunner<L> runner(context, n, std::numeric_limits<std::size_t>::max(), math,
                                     gpu::detail::RunnerRole{});
  const std::size_t size = std::max<std::size_t>(1, gpu::detail::device_size<L>());
  gpu::DeviceBuffer<float> weights(size, "test weights"), grads(size, "test gradients");
  LOOM_CUDA_CHECK(cudaMemsetAsync(weights.data(), 0, size * sizeof(float), stream));
  LOOM_CUDA_CHECK(cudaMemsetAsync(grads.data(), 0, size * sizeof(float), stream));
  gpu::detail::copy_layer_parameters<L>(weights.data(), params.data(), 0, 0,
                                        cudaMemcpyHostToDevice, stream);
  auto dx_in = test::to_device(x), dy_in = test::to_device(dy);
  gpu::DeviceBuffer<float> y(n * L::output_shape::size, "test output"),
      dx(x.size(), "test input gradient"),
      saved(std::max<std::size_t>(1, runner.saved_floats()), "test saved"),
      state(L::state_count + 1, "test state");
  gpu::DeviceBuffer<unsigned char> scratch(std::max<std::size_t>(1, runner.scratch_bytes()),
                                           "test scratch");
  gpu::detail::LayerCall c;
  c.weights = weights.data();
  c.bias = weights.data() + gpu::detail::weight_block<L>();
  c.dweights = grads.data();
  c.dbias = grads.data() + gpu::detail::weight_block<L>();
  c.x = dx_in.data();
  c.y = y.data();
  c.dy = dy_in.data();
  c.dx = dx.data();
  c.saved = saved.data();
  c.state = state.data();
  c.scratch = scratch.data();
  c.scratch_bytes = runner.scratch_bytes();
  c.stream = stream;
  c.training = true;
  c.precision = precision;
  runner.forward(c);
  runner.backward(c);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  Pass1 r{test::to_host(y), test::to_host(dx), std::vector<float>(L::param_count)};
  gpu::detail::copy_layer_parameters<L>(grads.data(), r.dparams.data(), 0, 0,
                                        cudaMemcpyDeviceToHost, stream);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

// The fortunes' first bytes as windows of ids.
std::vector<float> text_ids(std::size_t count) {
  const auto& windows = test::gpt_text().train;
  REQUIRE(windows.images.size() >= count);
  return {windows.images.begin(), windows.images.begin() + static_cast<std::ptrdiff_t>(count)};
}

template <class L>
void same_as_cpu(std::size_t n, const std::vector<float>& params, const std::vector<float>& x,
                 test::Tolerance tolerance, const char* what) {
  INFO(what);
  const auto dy = test::random_vector<float>(n * L::output_shape::size, 41);
  const Pass1 cpu = on_cpu<L>(n, params, x, dy);
  const Pass1 gpu = on_gpu<L>(n, params, x, dy);
  test::require_close(gpu.y, cpu.y, tolerance, "output");
  test::require_close(gpu.dx, cpu.dx, tolerance, "input gradient");
  test::require_close(gpu.dparams, cpu.dparams, tolerance, "parameter gradients");
}

template <class L>
std::vector<float> initial(std::uint64_t seed) {
  std::vector<float> params(L::param_count);
  L::init(params.data(), seed, false);
  return params;
}

constexpr std::size_t C = test::gpt_context, W = test::gpt_width;
using Emb = Bind<Embedding<test::gpt_vocab, W>, Shape<C>, 1>;
using Pos = Bind<PositionEmbedding, Shape<C, W>, 2>;
using Norm = Bind<LayerNorm, Shape<C, W>, 3>;
using Rms = Bind<RMSNorm, Shape<C, W>, 3>;
using Attn = Bind<CausalSelfAttention<4>, Shape<C, W>, 4>;
using RotaryAttn = Bind<CausalSelfAttention<4, Rotary<>>, Shape<C, W>, 4>;
// Head widths of 6: the plans fall back to 4-byte alignment.
using OddAttn = Bind<CausalSelfAttention<2>, Shape<7, 12>, 4>;
using Tied = Bind<TiedLinear<test::gpt_vocab>, Shape<C, W>, 7>;
using Block = Bind<TransformerBlock<4>, Shape<C, W>, 3>;
using RotaryBlock = Bind<TransformerBlock<4, Rotary<>>, Shape<C, W>, 3>;

}  // namespace

TEST_CASE("cuda transformer: Embedding and PositionEmbedding equal the CPU's to the bit") {
  const std::size_t n = 6;
  // Repeated bytes (spaces, e, t) make each row's gradient a sum of many tokens.
  same_as_cpu<Emb>(n, initial<Emb>(3), text_ids(n * C), {0.0, 0.0}, "Embedding");
  same_as_cpu<Pos>(n, initial<Pos>(3), test::random_vector<float>(n * C * W, 5), {0.0, 0.0},
                   "PositionEmbedding");
}

TEST_CASE("cuda transformer: LayerNorm, RMSNorm and TiedLinear follow the CPU") {
  const std::size_t n = 5;
  const auto x = test::random_vector<float>(n * C * W, 7, -2.0, 2.0);
  // Weights away from 1 and biases away from 0, so both gradients count.
  const auto affine = test::random_vector<float>(2 * W, 8, 0.5, 1.5);
  same_as_cpu<Norm>(n, affine, x, {1e-5, 1e-4}, "LayerNorm");
  same_as_cpu<Rms>(n, {affine.begin(), affine.begin() + W}, x, {1e-5, 1e-4}, "RMSNorm");
  same_as_cpu<Tied>(n, initial<Tied>(4), x, {1e-5, 1e-4}, "TiedLinear");
}

TEST_CASE("cuda transformer: causal self-attention follows the CPU, plain, rotary and unaligned") {
  const std::size_t n = 4;
  const auto x = test::random_vector<float>(n * C * W, 9);
  // Biases away from 0, so their gradients are checked too.
  auto params = test::random_vector<float>(Attn::param_count, 10, -0.3, 0.3);
  same_as_cpu<Attn>(n, params, x, {1e-5, 1e-4}, "4 heads");
  same_as_cpu<RotaryAttn>(n, params, x, {1e-5, 1e-4}, "4 rotary heads");
  same_as_cpu<OddAttn>(3, test::random_vector<float>(OddAttn::param_count, 11, -0.3, 0.3),
                       test::random_vector<float>(3 * 7 * 12, 12), {1e-5, 1e-4},
                       "2 heads of 6 over 7 positions");
}

TEST_CASE("cuda transformer: in bf16 the attention rounds what the CPU's emulation rounds") {
  // The owner's part done by hand: the input, weights and output gradient
  // rounded to bf16, as DeviceLayers and the CPU Model round them.
  const std::size_t n = 4;
  const auto rounded = [](std::vector<float> v) {
    round_to(Precision::bf16, v.data(), v.size());
    return v;
  };
  const auto x = rounded(test::random_vector<float>(n * C * W, 9));
  const auto params = rounded(test::random_vector<float>(Attn::param_count, 10, -0.3, 0.3));
  const auto dy = rounded(test::random_vector<float>(n * C * W, 41));
  const Pass1 cpu = on_cpu<Attn>(n, params, x, dy, Precision::bf16);
  const Pass1 gpu = on_gpu<Attn>(n, params, x, dy, Precision::bf16);
  // bf16 GEMMs take the rounded operands exactly; the scores' TF32
  // products and the sums' order move the last bits, which a rounding to
  // bf16 (8 bits) may turn into one bf16 step.
  test::require_close(gpu.y, cpu.y, {1e-2, 1e-2}, "output");
  test::require_close(gpu.dx, cpu.dx, {1e-2, 1e-2}, "input gradient");
  test::require_close(gpu.dparams, cpu.dparams, {1e-2, 1e-2}, "parameter gradients");
}

TEST_CASE("cuda transformer: a TransformerBlock runs as one layer, as on the CPU") {
  const std::size_t n = 3;
  const auto x = test::random_vector<float>(n * C * W, 13);
  same_as_cpu<Block>(n, initial<Block>(5), x, {1e-5, 1e-3}, "TransformerBlock<4>");
  same_as_cpu<RotaryBlock>(n, initial<RotaryBlock>(5), x, {1e-5, 1e-3},
                           "TransformerBlock<4, Rotary<>>");
}

TEST_CASE("cuda transformer: a strided-batched GEMM equals one product per batch") {
  gpu::BlasLt blas;
  gpu::Stream stream;
  // 3 batches of (5 x 4) x (6 x 4)^T, each a head's columns of wider rows.
  const std::size_t batch = 3, m = 5, n = 6, k = 4, lda = 12, ldb = 8, ldc = 7;
  const auto a = test::random_vector<float>(batch * m * lda, 14);
  const auto b = test::random_vector<float>(batch * n * ldb, 15);
  gpu::GemmOptions options;
  options.alignment_bytes = 4;
  gpu::GemmPlan plan(blas, {false, true, m, n, k, lda, ldb, ldc, batch, m * lda, n * ldb, m * ldc},
                     gpu::Epilogue::none, options);
  auto da = test::to_device(a), db = test::to_device(b);
  gpu::DeviceBuffer<float> dc(batch * m * ldc, "test product");
  LOOM_CUDA_CHECK(cudaMemset(dc.data(), 0, batch * m * ldc * sizeof(float)));
  gpu::DeviceBuffer<unsigned char> work(std::max<std::size_t>(1, plan.workspace_bytes()), "ws");
  gpu::GemmArgs args;
  args.a = da.data();
  args.b = db.data();
  args.c = dc.data();
  args.alpha = 0.5f;
  args.workspace = work.data();
  args.workspace_bytes = plan.workspace_bytes();
  args.stream = stream.get();
  plan.run(args);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  const auto c = test::to_host(dc);
  for (std::size_t s = 0; s < batch; ++s)
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < ldc; ++j) {
        double want = 0.0;
        for (std::size_t p = 0; p < k && j < n; ++p)
          want += 0.5 * a[s * m * lda + i * lda + p] * b[s * n * ldb + j * ldb + p];
        INFO("batch " << s << ", row " << i << ", column " << j);
        REQUIRE(c[s * m * ldc + i * ldc + j] == Approx(want).margin(1e-6));
      }
  // An epilogue with batches is refused.
  REQUIRE_THROWS_WITH(gpu::GemmPlan(blas, {false, true, m, n, k, lda, ldb, ldc, batch, 60, 48, 35},
                                    gpu::Epilogue::bias, options),
                      Catch::Contains("strided batches take the none epilogue only"));
}

namespace {

// The small GPT trained by the Trainer on CPU devices and on the GPU,
// compared step by step.
template <class Net, class Policy = SingleDevice>
void gpt_follows_cpu(const char* what, std::size_t gpu_ranks = 1) {
  INFO(what);
  const std::vector<Device> gpus(gpu_ranks, devices::gpus().front());
  std::vector<StepInfo> cpu_steps, gpu_steps;
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  Trainer<Net, SingleDevice, SGD, PositionCrossEntropy> cpu(devices::cpu(1), test::gpt_sgd,
                                                            {.seed = 9});
  cpu.fit(test::gpt_text().train, test::gpt_fit, Record{&cpu_steps});
  Trainer<Net, Policy, SGD, PositionCrossEntropy> gpu(gpus, test::gpt_sgd, {.seed = 9});
  gpu.fit(test::gpt_text().train, test::gpt_fit, Record{&gpu_steps});
  REQUIRE(gpu_steps.size() == cpu_steps.size());
  REQUIRE(gpu_steps.size() == 10);
  for (std::size_t i = 0; i < cpu_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(gpu_steps[i].loss == Approx(cpu_steps[i].loss).epsilon(1e-4));
  }
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), {1e-5, 1e-3},
                      "weights after 10 steps");
  const auto a = gpu.evaluate(test::gpt_text().test, 32);
  const auto b = cpu.evaluate(test::gpt_text().test, 32);
  REQUIRE(a.samples == 96);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-4));
}

}  // namespace

TEST_CASE("cuda transformer: the small GPT trains on a GPU as on the CPU") {
  gpt_follows_cpu<test::TinyGpt>("Residual layers, one GPU");
  gpt_follows_cpu<test::TinyGptBlocks>("TransformerBlocks, one GPU");
  gpt_follows_cpu<test::TinyGptBlocks, ModelSplit<Balanced<2>, OneFOneB<4>>>(
      "TransformerBlocks, 2 stages on one GPU", 2);
}

TEST_CASE("cuda transformer: a weight-tied GPT trains on a GPU as on the CPU, its copies equal") {
  // One stage: the pair summed on the device; two: on the host over the
  // pipe group (the embedding on the first stage, the head on the last).
  gpt_follows_cpu<test::TinyGptTied>("tied, one GPU");
  gpt_follows_cpu<test::TinyGptTied, ModelSplit<Balanced<2>, OneFOneB<4>>>(
      "tied, 2 stages on one GPU", 2);
  Trainer<test::TinyGptTied, SingleDevice, SGD, PositionCrossEntropy> gpu(
      {devices::gpus().front()}, test::gpt_sgd, {.seed = 9});
  gpu.fit(test::gpt_text().train, test::gpt_fit);
  const auto w = gpu.model().parameters();
  using Net = test::TinyGptTied;
  for (const auto& tie : Net::ties)
    for (std::size_t k = 0; k < tie.count; ++k) {
      INFO("element " << k);
      REQUIRE(w[tie.copy + k] == w[tie.source + k]);
    }
}

TEST_CASE("cuda transformer: the small GPT split over tensor ranks sharing a GPU trains as on "
          "the CPU") {
  // Ranks on one GPU sum and gather through the host (NCCL takes one rank
  // per device): the split layers' runners and the engine's wiring, not
  // NCCL's sums, are what this checks.
  gpt_follows_cpu<test::TinyGpt, TensorParallel<2>>("tensor 2 on one GPU", 2);
  gpt_follows_cpu<test::TinyGptBlocks, TensorParallel<4>>("TransformerBlocks, tensor 4 on one GPU",
                                                          4);
  gpt_follows_cpu<test::TinyGptBlocks, TensorParallel<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(
      "pipe 2 x tensor 2 on one GPU", 4);
  gpt_follows_cpu<test::TinyGptTied, TensorParallel<2, DataParallel<>>>(
      "tied, data 2 x tensor 2 on one GPU", 4);
}

TEST_CASE("cuda transformer: a token id outside the vocabulary is the CPU's loom::Error") {
  data::Dataset bad = data::head(test::gpt_text().train, 24);
  bad.images[3 * C + 5] = 300.0f;
  Trainer<test::TinyGpt, SingleDevice, SGD, PositionCrossEntropy> gpu(
      {devices::gpus().front()}, test::gpt_sgd, {.seed = 9});
  const auto before = gpu.model().parameters();
  const std::vector<float> kept(before.begin(), before.end());
  REQUIRE_THROWS_WITH(gpu.fit(bad, {.epochs = 1, .batch_size = 24, .shuffle = false}),
                      Catch::Contains("Embedding (layer 1): sample 3 holds 300 at position 5"));
  test::require_close(gpu.model().parameters(), kept, {0.0, 0.0}, "weights after the refusal");
}

}  // namespace cuda_transformer_tests
