// A small GPT (byte embeddings, learned positions, two pre-norm blocks of
// causal self-attention and a GELU MLP) trained on real text, Debian's
// fortunes, with next-token cross-entropy at every position: it learns on
// one device, and DataParallel, ModelSplit and Hybrid on CPU worker devices
// train it to one device's weights and sums over the same global batches.
#include <cmath>
#include <loom/loom.hpp>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
namespace test = loom::test;

namespace {

constexpr std::size_t context = 16, width = 32, vocab = 256;
using Attention = Residual<LayerNorm, CausalSelfAttention<2>>;
using Mlp = Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>;
using TinyGpt = Sequential<Input<context>, Embedding<vocab, width>, PositionEmbedding, Attention,
                           Mlp, Attention, Mlp, LayerNorm, Linear<vocab>>;

const AdamW::Options adamw{.lr = 3e-3f, .weight_decay = 0.1f};
// The policies are compared under SGD: the keys' bias has a gradient of
// exactly 0 (a shift of every key moves every score of a row alike, which
// the softmax ignores), so what backward computes there is rounding noise,
// which Adam's normalisation would blow up to a step of lr in a direction
// that depends on the summation order.
const SGD::Options sgd{.lr = 0.1f, .momentum = 0.9f};
// 120 windows in batches of 24 (the second epoch's order shuffled): 10 steps.
const FitOptions fit{.epochs = 2, .batch_size = 24, .seed = 5};

const data::Split& text() {
  static const data::Split split = [] {
    data::Split s = data::text_split(data::read_fortunes(), context, 17);
    return data::Split{data::head(s.train, 120), data::head(s.test, 96)};
  }();
  return split;
}

struct Trained {
  std::vector<float> weights;
  EpochInfo last;
  EvalResult eval;
};

template <class Policy, class Optimizer = SGD>
Trained train(std::size_t devices, const typename Optimizer::Options& options = sgd) {
  auto workers = devices::cpu(devices);
  for (auto& d : workers) d.threads = 1;
  Trainer<TinyGpt, Policy, Optimizer, PositionCrossEntropy> trainer(workers, options,
                                                                    {.seed = 9});
  struct Last {
    void on_epoch_end(const EpochInfo& epoch) { *out = epoch; }
    EpochInfo* out;
  };
  Trained result;
  trainer.fit(text().train, fit, Last{&result.last});
  const auto w = trainer.model().parameters();
  result.weights.assign(w.begin(), w.end());
  result.eval = trainer.evaluate(text().test, 32);
  return result;
}

}  // namespace

TEST_CASE("GPT: a small GPT learns the next byte of the fortunes text on one device") {
  Trainer<TinyGpt, SingleDevice, AdamW, PositionCrossEntropy> untrained(devices::cpu(1), adamw,
                                                                        {.seed = 9});
  const auto before = untrained.evaluate(text().test, 32);
  // Uniform over 256 bytes at the start: a loss near log(256) = 5.55 a position.
  REQUIRE(before.loss == Approx(std::log(256.0)).epsilon(0.1));
  const Trained one = train<SingleDevice, AdamW>(1, adamw);
  // Ten steps: the frequent bytes (space, e, t) are learned first.
  REQUIRE(one.eval.loss < before.loss - 1.0);
  REQUIRE(one.eval.samples == 96);
}

TEST_CASE("GPT trains to one device's weights under DataParallel, ModelSplit and Hybrid") {
  const Trained reference = train<SingleDevice>(1);
  // Sums of the same gradients in other orders: fp32 rounding over 10 SGD steps.
  const test::Tolerance tolerance{1e-6, 1e-4};
  const auto check = [&](const Trained& got, const char* what) {
    INFO(what);
    test::require_close(got.weights, reference.weights, tolerance, what);
    REQUIRE(got.last.loss == Approx(reference.last.loss).epsilon(1e-6));
    REQUIRE(got.eval.loss == Approx(reference.eval.loss).epsilon(1e-6));
  };
  check(train<DataParallel<>>(3), "DataParallel over 3");
  check(train<ModelSplit<Balanced<2>, OneFOneB<4>>>(2), "ModelSplit over 2");
  check(train<Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>>(4), "Hybrid 2 x 2");
}
