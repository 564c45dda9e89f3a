// Tensor parallelism (TensorParallel<T, Inner>) on CPU worker devices: a
// small GPT on Debian's fortunes, its attention heads, MLPs and vocabulary
// split over 2 and 4 ranks, alone and on data, pipe and data x pipe grids,
// trains to one device's weights; checkpoints are whole and load under any
// mesh; the copies a tensor group holds alike stay equal bit for bit.
#include <cmath>
#include <filesystem>
#include <loom/loom.hpp>
#include <set>
#include <sstream>
#include <type_traits>
#include <vector>

#include "loom_test.hpp"
#include "policy_test.hpp"
#include "temp_dir.hpp"
#include "tiny_gpt.hpp"

using namespace loom;
namespace test = loom::test;

namespace {

using test::TinyGpt;
constexpr std::size_t width = test::gpt_width, vocab = test::gpt_vocab;
const SGD::Options& sgd = test::gpt_sgd;
const FitOptions& fit = test::gpt_fit;
const data::Split& text() { return test::gpt_text(); }

struct Trained {
  std::vector<float> weights;
  EpochInfo last;
  EvalResult eval;
};

struct Last {
  void on_epoch_end(const EpochInfo& epoch) { *out = epoch; }
  EpochInfo* out;
};

std::vector<Device> workers(std::size_t n) {
  auto d = devices::cpu(n);
  for (auto& device : d) device.threads = 1;
  return d;
}

template <class Policy, class Net = TinyGpt>
Trained train(std::size_t devices, FitOptions options = fit) {
  Trainer<Net, Policy, SGD, PositionCrossEntropy> trainer(workers(devices), sgd, {.seed = 9});
  Trained result;
  trainer.fit(text().train, options, Last{&result.last});
  const auto w = trainer.model().parameters();
  result.weights.assign(w.begin(), w.end());
  result.eval = trainer.evaluate(text().test, 32);
  return result;
}

const Trained& reference() {
  static const Trained one = train<SingleDevice>(1);
  return one;
}

// Each rank sums its share of what one device sums whole: fp32 rounding
// over 10 SGD steps, the bound the other policies' tests state.
void require_like_one_device(const Trained& got, const char* what) {
  INFO(what);
  test::require_close(got.weights, reference().weights, test::Tolerance{1e-6, 1e-4}, what);
  REQUIRE(got.last.loss == Approx(reference().last.loss).epsilon(1e-6));
  REQUIRE(got.eval.loss == Approx(reference().eval.loss).epsilon(1e-6));
}

using Shard2 = tensor_shard_t<TinyGpt, 2>;

}  // namespace

TEST_CASE("TensorParallel splits the heads, the MLPs' Linears and the vocabulary, nothing else") {
  using L = Shard2::layers;
  // Embedding, positions and the final norm run whole.
  STATIC_REQUIRE(std::is_same_v<type_at_t<0, L>::spec, Embedding<vocab, width>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, L>::spec, PositionEmbedding>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<6, L>::spec, LayerNorm>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<2, L>::spec,
                                Residual<LayerNorm, TensorHeads<CausalSelfAttention<4>, 2>>>);
  STATIC_REQUIRE(
      std::is_same_v<type_at_t<3, L>::spec,
                     Residual<LayerNorm, TensorColumns<Linear<4 * width>, 2>, GELU,
                              TensorRows<Linear<width>, 2>>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<7, L>::spec, TensorGather<Linear<vocab>, 2>>);
  // A rank holds its half of every split layer and all of the others.
  constexpr std::size_t split =
      2 * (4 * width * width + 4 * width - width) + 2 * (8 * width * width + 4 * width) +
      vocab * width + vocab;
  STATIC_REQUIRE(Shard2::parameter_count == TinyGpt::parameter_count - split / 2);
  // A LeNet's classifier pairs too: Linear<120>, ReLU, Linear<84>.
  using LeNetShard = tensor_shard_t<
      Sequential<Input<1, 28, 28>, Conv2d<6, 5>, ReLU, MaxPool2d<2>, Flatten, Linear<120>, ReLU,
                 Linear<84>, ReLU, Linear<10>>,
      2>;
  STATIC_REQUIRE(
      std::is_same_v<type_at_t<4, LeNetShard::layers>::spec, TensorColumns<Linear<120>, 2>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<6, LeNetShard::layers>::spec, TensorRows<Linear<84>, 2>>);
  STATIC_REQUIRE(
      std::is_same_v<type_at_t<8, LeNetShard::layers>::spec, TensorGather<Linear<10>, 2>>);
}

TEST_CASE("TensorParallel's ranks hold every weight once, or alike") {
  using Engine = detail::TensorEngine<TinyGpt, TensorParallel<2>, SGD, PositionCrossEntropy>;
  const LayerRange all{0, TinyGpt::executed::size};
  std::vector<int> split(TinyGpt::parameter_count, 0), alike(TinyGpt::parameter_count, 0);
  std::size_t own_total = 0;
  for (std::size_t rank = 0; rank < 2; ++rank) {
    std::set<std::size_t> local;
    for (const auto& s : Engine::segments(rank, all)) {
      for (std::size_t i = 0; i < s.count; ++i) {
        ++(s.split ? split : alike)[s.whole + i];
        REQUIRE(local.insert(s.local + i).second);  // no local index twice
      }
      own_total += s.count;
    }
    REQUIRE(local.size() == Shard2::parameter_count);
    REQUIRE(*local.rbegin() == Shard2::parameter_count - 1);
  }
  REQUIRE(own_total == 2 * Shard2::parameter_count);
  // Every whole weight: one rank's split run, or both ranks' alike run.
  for (std::size_t i = 0; i < TinyGpt::parameter_count; ++i) {
    INFO("weight " << i);
    REQUIRE(((split[i] == 1 && alike[i] == 0) || (split[i] == 0 && alike[i] == 2)));
  }
}

TEST_CASE("TensorParallel trains to one device's weights over 2 and 4 ranks and on every grid") {
  require_like_one_device(train<TensorParallel<2>>(2), "tensor 2");
  require_like_one_device(train<TensorParallel<4>>(4), "tensor 4");
  require_like_one_device(train<TensorParallel<2, DataParallel<>>>(4), "data 2 x tensor 2");
  require_like_one_device(train<TensorParallel<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(4),
                          "pipe 2 x tensor 2");
  require_like_one_device(
      train<TensorParallel<2, Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>>>(8),
      "data 2 x pipe 2 x tensor 2");
}

TEST_CASE("A tensor group's ranks keep the layers they hold alike equal, bit for bit") {
  using Policy = TensorParallel<2>;
  Trainer<TinyGpt, Policy, SGD, PositionCrossEntropy> trainer(workers(2), sgd, {.seed = 9});
  trainer.fit(text().train, fit);
  auto& engine = trainer.model_split();
  const auto a = engine.stage(0).parameters(), b = engine.stage(1).parameters();
  std::size_t compared = 0;
  const auto& runs0 = engine.stage(0).segments;
  const auto& runs1 = engine.stage(1).segments;
  REQUIRE(runs0.size() == runs1.size());
  for (std::size_t k = 0; k < runs0.size(); ++k) {
    if (runs0[k].split) continue;
    REQUIRE(runs1[k].local == runs0[k].local);
    for (std::size_t i = 0; i < runs0[k].count; ++i)
      REQUIRE(a[runs0[k].local + i] == b[runs1[k].local + i]);
    compared += runs0[k].count;
  }
  // Embeddings, norms and the row-parallel biases.
  REQUIRE(compared > vocab * width);
}

TEST_CASE("TensorParallel trains a LeNet-5 on Fashion-MNIST to one device's numbers: its "
          "classifier's Linear, ReLU pairs split and fused") {
  using LeNet5 = Sequential<Input<1, 28, 28>, Conv2d<6, 5>, ReLU, MaxPool2d<2>, Conv2d<16, 5>, ReLU,
                            MaxPool2d<2>, Flatten, Linear<120>, ReLU, Linear<84>, ReLU, Linear<10>>;
  using Shard = tensor_shard_t<LeNet5, 2>;
  STATIC_REQUIRE(Shard::executed::size == LeNet5::executed::size);
  STATIC_REQUIRE(std::is_same_v<type_at_t<6, Shard::executed>,
                                Bind<Fused<TensorRows<Linear<84>, 2>, ReLU>, Shape<60>, 10>>);
  const auto part = test::head(test::fashion().train, 480);
  const FitOptions options{.epochs = 1, .batch_size = 60, .seed = 3};
  Trainer<LeNet5, TensorParallel<2, DataParallel<>>> trainer(workers(4), test::sgd, {.seed = 7});
  test::require_same_reports(trainer, part, options, test::head(test::fashion().test, 1000), 8);
  test::require_close(trainer.model().parameters(), test::single_device<LeNet5>(part, options),
                      {1e-6, 1e-4}, "LeNet-5's weights");
}

TEST_CASE("TensorParallel splits each TransformerBlock inside, as the residuals written out") {
  using test::TinyGptBlocks;
  using Shard = tensor_shard_t<TinyGptBlocks, 2>;
  using Block = type_at_t<2, Shard::layers>;
  STATIC_REQUIRE(std::is_same_v<Block::spec, TensorBlock<TransformerBlock<4>, 2>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, Block::children>::spec,
                                type_at_t<3, Shard2::layers>::spec>);
  STATIC_REQUIRE(Shard::parameter_count == Shard2::parameter_count);
  STATIC_REQUIRE(Shard::executed::size == TinyGptBlocks::executed::size);
  // Pipe 2 x tensor 2 cuts between blocks and splits inside them.
  const Trained one = train<SingleDevice, TinyGptBlocks>(1);
  const Trained grid =
      train<TensorParallel<2, ModelSplit<Balanced<2>, OneFOneB<4>>>, TinyGptBlocks>(4);
  test::require_close(grid.weights, one.weights, test::Tolerance{1e-6, 1e-4}, "weights");
  REQUIRE(grid.last.loss == Approx(one.last.loss).epsilon(1e-6));
  REQUIRE(grid.eval.loss == Approx(one.eval.loss).epsilon(1e-6));
}

TEST_CASE("TensorParallel<1> trains as one device does") {
  require_like_one_device(train<TensorParallel<1>>(1), "tensor 1");
}

TEST_CASE("TensorParallel's placement names each rank's share") {
  Trainer<TinyGpt, TensorParallel<2, DataParallel<>>, SGD, PositionCrossEntropy> trainer(
      workers(4), sgd, {.seed = 9});
  const auto places = trainer.placement();
  REQUIRE(places.size() == 4);
  REQUIRE(places[1].replica == 0);
  REQUIRE(places[1].tensor == 1);
  REQUIRE(places[2].replica == 1);
  REQUIRE(places[2].tensor == 0);
  const std::string text = describe_placement(places);
  REQUIRE(text.find("cpu:3  replica 1  stage 0  tensor 1 of 2  layers 1-8") != std::string::npos);
}

TEST_CASE("TensorParallel refuses a device count its degree does not divide") {
  using Policy = TensorParallel<2, DataParallel<>>;
  REQUIRE_THROWS_WITH((Trainer<TinyGpt, Policy, SGD, PositionCrossEntropy>(workers(3), sgd)),
                      Catch::Contains("splits each layer over 2 ranks") &&
                          Catch::Contains("give a multiple of 2 devices (or processes), not 3"));
  REQUIRE_THROWS_WITH((Trainer<TinyGpt, TensorParallel<2>, SGD, PositionCrossEntropy>(workers(3),
                                                                                       sgd)),
                      Catch::Contains("TensorParallel runs on 2 device(s)"));
}

TEST_CASE("TensorParallel's checkpoints are whole: saved under one mesh, resumed under another") {
  const test::TempDir dir;
  const FitOptions one_epoch{.epochs = 1, .batch_size = 24, .seed = 5};
  // Saved under tensor 2 after one epoch: the file loads on one device.
  Trainer<TinyGpt, TensorParallel<2>, SGD, PositionCrossEntropy> split(workers(2), sgd,
                                                                       {.seed = 9});
  split.fit(text().train, one_epoch);
  split.save(dir.file("tensor2.safetensors"));
  Trainer<TinyGpt, SingleDevice, SGD, PositionCrossEntropy> one(workers(1), sgd, {.seed = 1});
  one.load(dir.file("tensor2.safetensors"));
  REQUIRE(one.resharded() ==
          "resharded: the checkpoint was saved by TensorParallel on data 1 x pipe 1 x tensor 2; "
          "this SingleDevice runs data 1 x pipe 1 x tensor 1: each rank takes the whole tensors "
          "of its layers (optimizer state alike)");
  const auto gathered = split.model().parameters();
  REQUIRE(std::equal(gathered.begin(), gathered.end(), one.model().parameters().begin()));
  // More data replicas cut no tensor: nothing to say.
  Trainer<TinyGpt, TensorParallel<2, DataParallel<>>, SGD, PositionCrossEntropy> wider(
      workers(4), sgd, {.seed = 1});
  wider.load(dir.file("tensor2.safetensors"));
  REQUIRE(wider.resharded().empty());
  // Resumed under tensor 4: the second epoch ends where one device's two
  // epochs end.
  Trainer<TinyGpt, TensorParallel<4>, SGD, PositionCrossEntropy> resumed(workers(4), sgd,
                                                                         {.seed = 1});
  resumed.load(dir.file("tensor2.safetensors"));
  // The split layers: 2 attentions' q, k, v and projection weights and
  // q, k, v biases, 2 MLPs' first Linear and second weight, the vocabulary.
  constexpr std::size_t split_weights = 2 * (4 * width * width + 3 * width) +
                                        2 * (8 * width * width + 4 * width) + vocab * width + vocab;
  REQUIRE(resumed.resharded() ==
          "resharded: the checkpoint was saved by TensorParallel on data 1 x pipe 1 x tensor 2; "
          "this TensorParallel runs data 1 x pipe 1 x tensor 4: each of its 4 tensor ranks "
          "takes its 1/4 of the split layers' " + std::to_string(split_weights) +
          " weights and all of the other " +
          std::to_string(TinyGpt::parameter_count - split_weights) +
          " (optimizer state alike)");
  EpochInfo last;
  resumed.fit(text().train, fit, Last{&last});
  const auto w = resumed.model().parameters();
  test::require_close(std::vector<float>(w.begin(), w.end()), reference().weights,
                      test::Tolerance{1e-6, 1e-4}, "resumed under tensor 4");
  REQUIRE(last.loss == Approx(reference().last.loss).epsilon(1e-6));
}
