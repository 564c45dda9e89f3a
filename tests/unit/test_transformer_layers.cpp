// A GPT's layers on the CPU: Embedding, PositionEmbedding, LayerNorm,
// RMSNorm and CausalSelfAttention. Forward against plain references written
// here in double, backward against central finite differences in double,
// attention's causality (a later position changes no earlier output), the
// Embedding's errors for ids outside its vocabulary, and a small GPT's
// compile-time facts against nanoGPT's parameter count.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;
using loom::test::require_close;

namespace {

// Layer L on n samples in T: forward into y, backward with dy into dx and
// dparams (added to when `accumulate`), with the saved area and workspace
// it asks for.
template <class L, class T>
struct Run {
  std::size_t n;
  std::vector<T> params, x, y, work, saved;
  LayerContext<T> context;

  Run(std::size_t samples, const std::vector<double>& p, const std::vector<double>& in)
      : n(samples),
        params(p.begin(), p.end()),
        x(in.begin(), in.end()),
        y(samples * L::output_shape::size, T(-99)),
        work(samples * L::workspace + 1),
        saved(samples * L::saved + 1) {
    context.pass = {.training = true};
    context.saved = saved.data();
    detail::run_forward<L, T>(params.data(), x.data(), y.data(), work.data(), n, context);
  }
  void backward(const std::vector<T>& dy, std::vector<T>& dx, std::vector<T>& dparams,
                bool accumulate = false) {
    detail::run_backward<L, T>(params.data(), x.data(), y.data(), dy.data(), dx.data(),
                               dparams.data(), work.data(), n, accumulate, context);
  }
};

// L(x, p) = sum(forward(x, p) * r) in double: backward with dy = r against
// central differences over every parameter and (with `input_gradient`)
// every input; then accumulate = true adds to what is there.
template <class L>
void check_gradients(std::size_t n, const std::vector<double>& x, const std::vector<double>& params,
                     bool input_gradient = true) {
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  const auto r = random_vector<double>(n * out, 91);
  Run<L, double> run(n, params, x);
  std::vector<double> dx(n * in, -99.0), dparams(L::param_count, -99.0);
  run.backward(r, dx, dparams);

  auto objective = [&](const std::vector<double>& p, const std::vector<double>& v) {
    const auto y = Run<L, double>(n, p, v).y;
    double sum = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  using test::central_differences;
  if (input_gradient)
    require_close(dx, central_differences(x, [&](const auto& v) { return objective(params, v); }),
                  {1e-7, 1e-6}, "dL/dx");
  require_close(dparams,
                central_differences(params, [&](const auto& p) { return objective(p, x); }),
                {1e-7, 1e-6}, "dL/dparams");

  std::vector<double> accumulated(L::param_count, 0.25), unused(n * in);
  run.backward(r, unused, accumulated, true);
  for (auto& g : dparams) g += 0.25;
  require_close(accumulated, dparams, {1e-12, 1e-12}, "accumulated gradient");
}

template <class Spec, class In>
using At1 = Bind<Spec, In, 1>;

// --- Embedding ------------------------------------------------------------

using Emb = At1<Embedding<7, 3>, Shape<5>>;

std::vector<double> ids(std::initializer_list<int> values) {
  return {values.begin(), values.end()};
}

}  // namespace

TEST_CASE("transformer layers: Embedding looks up each id's row and sums the rows' gradients") {
  static_assert(std::is_same_v<Emb::output_shape, Shape<5, 3>>);
  static_assert(Emb::param_count == 21);
  const auto weight = random_vector<double>(Emb::param_count, 3);
  const auto x = ids({6, 0, 3, 3, 1, 2, 2, 5, 4, 6});  // two samples of 5
  Run<Emb, double> run(2, weight, x);
  for (std::size_t i = 0; i < x.size(); ++i)
    for (std::size_t c = 0; c < 3; ++c)
      REQUIRE(run.y[i * 3 + c] == weight[static_cast<std::size_t>(x[i]) * 3 + c]);
  check_gradients<Emb>(2, x, weight, false);
}

TEST_CASE("transformer layers: an id outside the Embedding's vocabulary is a loom::Error naming it") {
  const auto weight = random_vector<double>(Emb::param_count, 3);
  REQUIRE_THROWS_WITH((Run<Emb, double>(2, weight, ids({1, 2, 3, 4, 5, 6, 0, 7, 1, 1}))),
                      Catch::Contains("Embedding (layer 1): sample 1 holds 7 at position 2") &&
                          Catch::Contains("vocabulary of 7 (whole numbers 0 to 6)"));
  REQUIRE_THROWS_WITH((Run<Emb, double>(1, weight, ids({1, -1, 3, 4, 5}))),
                      Catch::Contains("sample 0 holds -1 at position 1"));
  std::vector<double> fraction{1, 2, 2.5, 4, 5};
  REQUIRE_THROWS_WITH((Run<Emb, double>(1, weight, fraction)),
                      Catch::Contains("sample 0 holds 2.5 at position 2"));
  std::vector<double> nan{1, 2, 3, std::numeric_limits<double>::quiet_NaN(), 5};
  REQUIRE_THROWS_WITH((Run<Emb, double>(1, weight, nan)),
                      Catch::Contains("sample 0 holds nan at position 3"));
}

TEST_CASE("transformer layers: PositionEmbedding adds its table to every sample") {
  using Pos = At1<PositionEmbedding, Shape<4, 3>>;
  const auto table = random_vector<double>(Pos::param_count, 5);
  const auto x = random_vector<double>(2 * 12, 6);
  Run<Pos, double> run(2, table, x);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(run.y[i] == x[i] + table[i % 12]);
  check_gradients<Pos>(2, x, table);
}

namespace {

// Rows of `features`: LayerNorm (centered, with bias) or RMSNorm.
std::vector<double> norm_reference(const std::vector<double>& x, const std::vector<double>& p,
                                   std::size_t features, bool centered) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < x.size() / features; ++r) {
    double mean = 0.0, squares = 0.0;
    if (centered) {
      for (std::size_t c = 0; c < features; ++c) mean += x[r * features + c];
      mean /= static_cast<double>(features);
    }
    for (std::size_t c = 0; c < features; ++c)
      squares += (x[r * features + c] - mean) * (x[r * features + c] - mean);
    const double eps = centered ? 1e-5 : 1e-6;
    const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(features) + eps);
    for (std::size_t c = 0; c < features; ++c)
      y[r * features + c] =
          (x[r * features + c] - mean) * rstd * p[c] + (centered ? p[features + c] : 0.0);
  }
  return y;
}

template <class Spec, bool Centered>
void norm_follows_reference() {
  using L = At1<Spec, Shape<3, 6>>;
  static_assert(L::param_count == (Centered ? 12 : 6));
  auto params = random_vector<double>(L::param_count, 8, -0.5, 0.5);
  for (std::size_t c = 0; c < 6; ++c) params[c] += 1.0;
  const auto x = random_vector<double>(2 * 18, 9, -2.0, 3.0);
  Run<L, double> run(2, params, x);
  require_close(run.y, norm_reference(x, params, 6, Centered), {1e-12, 1e-12}, "output");
  Run<L, float> single(2, params, x);
  require_close(single.y, norm_reference(x, params, 6, Centered), {1e-5, 1e-5}, "float output");
  check_gradients<L>(2, x, params);
}

}  // namespace

TEST_CASE("transformer layers: LayerNorm normalises each position over its features") {
  norm_follows_reference<LayerNorm, true>();
}

TEST_CASE("transformer layers: RMSNorm scales each position by its root mean square") {
  norm_follows_reference<RMSNorm, false>();
}

namespace {

using Attn = At1<CausalSelfAttention<2>, Shape<5, 8>>;

// x [n, C, W] and the layer's parameters -> y, each head's causal softmax
// written out with loops; `theta` > 0: each head's queries and keys turned
// by rotary positions of that base first (feature i and i + d/2 of a head
// by the angle t theta^(-2i/d) at position t).
std::vector<double> attention_reference(const std::vector<double>& x, const std::vector<double>& p,
                                        std::size_t n, std::size_t C, std::size_t W, std::size_t H,
                                        double theta = 0.0) {
  const std::size_t d = W / H;
  const double* wqkv = p.data();
  const double* bqkv = wqkv + 3 * W * W;
  const double* wo = bqkv + 3 * W;
  const double* bo = wo + W * W;
  std::vector<double> y(n * C * W);
  for (std::size_t s = 0; s < n; ++s) {
    std::vector<double> qkv(C * 3 * W), heads(C * W);
    for (std::size_t t = 0; t < C; ++t)
      for (std::size_t o = 0; o < 3 * W; ++o) {
        double sum = bqkv[o];
        for (std::size_t i = 0; i < W; ++i) sum += x[(s * C + t) * W + i] * wqkv[o * W + i];
        qkv[t * 3 * W + o] = sum;
      }
    for (std::size_t t = 0; theta > 0.0 && t < C; ++t)
      for (std::size_t part = 0; part < 2; ++part)
        for (std::size_t h = 0; h < H; ++h)
          for (std::size_t i = 0; i < d / 2; ++i) {
            const double angle = static_cast<double>(t) *
                                 std::pow(theta, -2.0 * static_cast<double>(i) / double(d));
            double& a = qkv[t * 3 * W + part * W + h * d + i];
            double& b = qkv[t * 3 * W + part * W + h * d + d / 2 + i];
            const double a0 = a, b0 = b;
            a = a0 * std::cos(angle) - b0 * std::sin(angle);
            b = b0 * std::cos(angle) + a0 * std::sin(angle);
          }
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < C; ++t) {
        std::vector<double> score(t + 1);
        double top = -1e300;
        for (std::size_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (std::size_t j = 0; j < d; ++j)
            dot += qkv[t * 3 * W + h * d + j] * qkv[u * 3 * W + W + h * d + j];
          score[u] = dot / std::sqrt(static_cast<double>(d));
          top = std::max(top, score[u]);
        }
        double total = 0.0;
        for (auto& v : score) total += (v = std::exp(v - top));
        for (std::size_t j = 0; j < d; ++j) {
          double sum = 0.0;
          for (std::size_t u = 0; u <= t; ++u)
            sum += score[u] / total * qkv[u * 3 * W + 2 * W + h * d + j];
          heads[t * W + h * d + j] = sum;
        }
      }
    for (std::size_t t = 0; t < C; ++t)
      for (std::size_t o = 0; o < W; ++o) {
        double sum = bo[o];
        for (std::size_t i = 0; i < W; ++i) sum += heads[t * W + i] * wo[o * W + i];
        y[(s * C + t) * W + o] = sum;
      }
  }
  return y;
}

}  // namespace

TEST_CASE("transformer layers: CausalSelfAttention follows a plain reference, forward and backward") {
  static_assert(Attn::param_count == 3 * 8 * 8 + 3 * 8 + 8 * 8 + 8);
  const auto params = random_vector<double>(Attn::param_count, 12, -0.4, 0.4);
  const auto x = random_vector<double>(3 * 40, 13);
  Run<Attn, double> run(3, params, x);
  require_close(run.y, attention_reference(x, params, 3, 5, 8, 2), {1e-12, 1e-12}, "output");
  Run<Attn, float> single(3, params, x);
  require_close(single.y, attention_reference(x, params, 3, 5, 8, 2), {1e-5, 1e-4},
                "float output");
  check_gradients<Attn>(3, x, params);
}

using RotaryAttn = At1<CausalSelfAttention<2, Rotary<>>, Shape<6, 8>>;

TEST_CASE("transformer layers: rotary attention follows a plain reference, forward and backward") {
  static_assert(RotaryAttn::param_count == Attn::param_count);  // no parameters of its own
  static_assert(RotaryAttn::kind == "rotary_attention" && Attn::kind == "attention");
  const auto params = random_vector<double>(RotaryAttn::param_count, 15, -0.4, 0.4);
  const auto x = random_vector<double>(2 * 48, 16);
  Run<RotaryAttn, double> run(2, params, x);
  const auto reference = attention_reference(x, params, 2, 6, 8, 2, 10000.0);
  require_close(run.y, reference, {1e-12, 1e-12}, "output");
  // Not the unturned attention's output (positions 1.. move).
  REQUIRE(std::abs(reference[47] - attention_reference(x, params, 2, 6, 8, 2)[47]) > 1e-3);
  Run<RotaryAttn, float> single(2, params, x);
  require_close(single.y, reference, {1e-5, 1e-4}, "float output");
  check_gradients<RotaryAttn>(2, x, params);
  using Base100 = At1<CausalSelfAttention<2, Rotary<100>>, Shape<6, 8>>;
  require_close(Run<Base100, double>(2, params, x).y,
                attention_reference(x, params, 2, 6, 8, 2, 100.0), {1e-12, 1e-12}, "base 100");
}

TEST_CASE("transformer layers: rotary scores depend on how far apart two positions are") {
  // The same input at every position: without rotation every score of a
  // row is the same; with it, P[t][u] / P[t][t] is a function of t - u alone.
  const auto params = random_vector<double>(RotaryAttn::param_count, 17, -0.6, 0.6);
  const auto one = random_vector<double>(8, 18, -2.0, 2.0);
  std::vector<double> x;
  for (std::size_t t = 0; t < 6; ++t) x.insert(x.end(), one.begin(), one.end());
  Run<RotaryAttn, double> run(1, params, x);
  const double* p = run.saved.data() + RotaryAttn::probabilities_at;  // head 0
  const auto ratio = [&](std::size_t t, std::size_t u) { return p[t * 6 + u] / p[t * 6 + t]; };
  bool varies = false;
  for (std::size_t t = 1; t < 6; ++t)
    for (std::size_t u = 0; u < t; ++u) {
      REQUIRE(ratio(t, u) == Approx(ratio(t - u, 0)).epsilon(1e-12));
      varies = varies || std::abs(ratio(t, u) - 1.0) > 1e-3;
    }
  REQUIRE(varies);
  Run<Attn, double> plain(1, params, std::vector<double>(x.begin(), x.begin() + 40));
  const double* q = plain.saved.data() + Attn::probabilities_at;
  for (std::size_t u = 0; u < 5; ++u) REQUIRE(q[4 * 5 + u] == Approx(0.2).epsilon(1e-12));
}

TEST_CASE("transformer layers: CausalSelfAttention's output at a position ignores later positions") {
  Model<Sequential<Input<5, 8>, CausalSelfAttention<2>>, double> model(4, 1);
  auto x = random_vector<double>(40, 14);
  const double* first = model.forward(x.data(), 1);
  const std::vector<double> before(first, first + 40);
  for (std::size_t i = 3 * 8; i < 40; ++i) x[i] += 10.0;  // positions 3 and 4
  const double* after = model.forward(x.data(), 1);
  for (std::size_t i = 0; i < 3 * 8; ++i) REQUIRE(after[i] == before[i]);
  bool moved = false;
  for (std::size_t i = 3 * 8; i < 40; ++i) moved = moved || after[i] != before[i];
  REQUIRE(moved);
}

namespace {

// nanoGPT's "baby GPT" (4 layers, 4 heads, width 128, context 64) over
// bytes: its blocks written as two pre-norm residuals each.
constexpr std::size_t vocab = 256, width = 128, context = 64;
using BabyGpt =
    Sequential<Input<context>, Embedding<vocab, width>, PositionEmbedding,
               Residual<LayerNorm, CausalSelfAttention<4>>,
               Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>,
               Residual<LayerNorm, CausalSelfAttention<4>>,
               Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>,
               Residual<LayerNorm, CausalSelfAttention<4>>,
               Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>,
               Residual<LayerNorm, CausalSelfAttention<4>>,
               Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>, LayerNorm,
               Linear<vocab>>;

}  // namespace

TEST_CASE("transformer layers: the baby GPT's shapes and parameters are nanoGPT's, at compile time") {
  static_assert(std::is_same_v<BabyGpt::output_shape, Shape<context, vocab>>);
  // nanoGPT (bias=True, untied head): wte + wpe + 4 x (2 LayerNorms + c_attn +
  // c_proj + c_fc + mlp c_proj) + ln_f + lm_head.
  constexpr std::size_t block = 2 * (2 * width) + (3 * width * width + 3 * width) +
                                (width * width + width) + (4 * width * width + 4 * width) +
                                (4 * width * width + width);
  constexpr std::size_t expected =
      vocab * width + context * width + 4 * block + 2 * width + (vocab * width + vocab);
  static_assert(BabyGpt::parameter_count == expected);
  REQUIRE(BabyGpt::parameter_count == 867'328);
}

namespace {

// The baby GPT with each block as one layer.
using BabyGptBlocks = Sequential<Input<context>, Embedding<vocab, width>, PositionEmbedding,
                                 TransformerBlock<4>, TransformerBlock<4>, TransformerBlock<4>,
                                 TransformerBlock<4>, LayerNorm, Linear<vocab>>;

}  // namespace

TEST_CASE("transformer layers: a TransformerBlock is its two residuals, one layer of the network") {
  STATIC_REQUIRE(BabyGptBlocks::parameter_count == BabyGpt::parameter_count);
  STATIC_REQUIRE(BabyGptBlocks::layer_count == 8);
  STATIC_REQUIRE(BabyGptBlocks::memory_plan.activations == BabyGpt::memory_plan.activations);
  using Block3 = type_at_t<2, BabyGptBlocks::layers>;
  STATIC_REQUIRE(BabyGptBlocks::forward_flops[2] ==
                 BabyGpt::forward_flops[2] + BabyGpt::forward_flops[3]);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, Block3::children>::spec,
                                Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>>);

  // The same weights give the same outputs and gradients, bit for bit, on
  // windows of Debian's fortunes.
  Model<BabyGptBlocks, float> blocks(3, 4);
  Model<BabyGpt, float> written(4, 4);
  std::ranges::copy(blocks.parameters(), written.parameters().begin());
  const auto windows = data::text_split(data::read_fortunes(), context, 5).train;
  const std::vector<float> ids(windows.images.begin(),
                               windows.images.begin() + 4 * static_cast<std::ptrdiff_t>(context));
  const Pass pass{.training = true};
  const float* yb = blocks.forward(ids.data(), 4, 0, pass);
  const float* yw = written.forward(ids.data(), 4, 0, pass);
  test::require_equal(std::vector<float>(yb, yb + 4 * context * vocab),
                      std::vector<float>(yw, yw + 4 * context * vocab), "logits");
  const auto r = random_vector<float>(4 * context * vocab, 17);
  std::ranges::copy(r, blocks.output_gradient());
  std::ranges::copy(r, written.output_gradient());
  blocks.backward(false);
  written.backward(false);
  test::require_equal(blocks.gradients(), written.gradients(), "gradients");

  // A block that starts with the Embedding tells the network its input
  // holds token ids (which no precision may round).
  using Stem = Sequential<Input<context>, Series<Embedding<vocab, width>, PositionEmbedding>,
                          TransformerBlock<4>, LayerNorm, Linear<vocab>>;
  STATIC_REQUIRE(type_at_t<0, Stem::layers>::takes_ids);
  REQUIRE(Model<Stem, float>(1).input_takes_ids());

  // Checkpoint names follow the block's path.
  const auto table = tensor_table<BabyGptBlocks>();
  REQUIRE(table[2].name == "3.transformer.0.residual.body.0.layernorm.weight");
  REQUIRE(table[4].name == "3.transformer.0.residual.body.1.attention.qkv.weight");
  REQUIRE(table[10].name == "3.transformer.1.residual.body.1.linear.weight");
}

TEST_CASE("transformer layers: a TransformerBlock's gradients match finite differences") {
  using Block = At1<TransformerBlock<2>, Shape<5, 8>>;
  STATIC_REQUIRE(Block::param_count == 2 * (2 * 8) + Attn::param_count + (8 * 32 + 32) +
                                           (32 * 8 + 8));
  check_gradients<Block>(3, random_vector<double>(3 * 40, 18),
                         random_vector<double>(Block::param_count, 19, -0.4, 0.4));
  using RotaryBlock = At1<TransformerBlock<2, Rotary<>>, Shape<6, 8>>;
  check_gradients<RotaryBlock>(2, random_vector<double>(2 * 48, 20),
                               random_vector<double>(RotaryBlock::param_count, 21, -0.4, 0.4));
}

TEST_CASE("transformer layers: windows longer or shorter than the network's context are refused") {
  using TinyGpt = Sequential<Input<8>, Embedding<256, 8>, PositionEmbedding, Linear<256>>;
  Trainer<TinyGpt, SingleDevice, SGD, PositionCrossEntropy> trainer(devices::cpu(1), {.lr = 0.1f});
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const auto long_windows = data::text_windows(text, 12, 6, 1, "fox");
  REQUIRE_THROWS_WITH(trainer.fit(long_windows, {.epochs = 1, .batch_size = 2}),
                      Catch::Contains("fit: dataset 'fox' has windows of 12 token ids, longer "
                                      "than the network's context of 8 (Input<8>") &&
                          Catch::Contains("cut the windows to 8"));
  REQUIRE_THROWS_WITH(trainer.evaluate(long_windows),
                      Catch::Contains("evaluate: dataset 'fox' has windows of 12 token ids"));
  REQUIRE_THROWS_WITH(trainer.fit(data::text_windows(text, 5, 6, 1, "fox"), {.batch_size = 2}),
                      Catch::Contains("has windows of 5 token ids, shorter than the network's "
                                      "context of 8"));
  // The network's own context trains.
  trainer.fit(data::text_windows(text, 8, 6, 1, "fox"), {.epochs = 1, .batch_size = 2});
  REQUIRE(trainer.evaluate(data::text_windows(text, 8, 4, 2, "fox")).samples == 4);
}

TEST_CASE("transformer layers: in bf16 the attention rounds its heads' output and its q, k, v "
          "gradient, which its projections read") {
  const auto params = random_vector<double>(Attn::param_count, 12, -0.4, 0.4);
  const auto x = random_vector<double>(3 * 40, 13);
  const auto dy = random_vector<float>(3 * 40, 14);
  // Bits below bf16's 8-bit mantissa: what rounding leaves as zero.
  const auto bf16_exact = [](float v) {
    float r = v;
    round_to(Precision::bf16, &r, 1);
    return r == v;
  };
  // A sample's heads' output: after every sample's q, k, v and probabilities
  // in the saved area (3 samples); in the workspace the q, k, v gradient
  // after the heads' output gradient.
  const auto heads_of = [](const std::vector<float>& saved, std::size_t s) {
    const auto* at = saved.data() + 3 * Attn::heads_out_at + s * 5 * 8;
    return std::vector<float>(at, at + 5 * 8);
  };
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    INFO("precision " << static_cast<int>(precision));
    Run<Attn, float> run(3, params, x);
    run.context.precision = precision;
    detail::run_forward<Attn, float>(run.params.data(), run.x.data(), run.y.data(),
                                     run.work.data(), 3, run.context);
    std::vector<float> dx(3 * 40), dparams(Attn::param_count);
    run.backward(dy, dx, dparams);
    std::vector<float> read;
    for (std::size_t s = 0; s < 3; ++s) {
      const auto heads = heads_of(run.saved, s);
      read.insert(read.end(), heads.begin(), heads.end());
    }
    const float* d_qkv = run.work.data() + 3 * 5 * 8;
    read.insert(read.end(), d_qkv, d_qkv + 3 * 5 * 24);
    const auto count = read.size();
    const auto exact = static_cast<std::size_t>(std::count_if(read.begin(), read.end(), bf16_exact));
    if (precision == Precision::bf16)
      REQUIRE(exact == count);
    else
      REQUIRE(exact < count / 10);  // fp32 values keep their low bits
  }
}
