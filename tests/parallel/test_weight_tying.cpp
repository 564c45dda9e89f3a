// Weight tying (TiedLinear): a GPT whose output head's weight is its
// embedding's, on Debian's fortunes. One step moves both copies by the sum
// of their gradients (clipping counts the tensor once); every policy, the
// tie across pipeline stages and tensor-parallel ranks included, trains it
// to one device's weights with the copies equal bit for bit; a checkpoint
// whose copies differ is refused.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <loom/loom.hpp>
#include <vector>

#include "loom_test.hpp"
#include "temp_dir.hpp"
#include "tiny_gpt.hpp"

using namespace loom;
namespace test = loom::test;

namespace {

using Net = test::TinyGptTied;
constexpr detail::TieRun tie = Net::ties[0];

std::vector<Device> workers(std::size_t n) {
  auto d = devices::cpu(n);
  for (auto& device : d) device.threads = 1;
  return d;
}

std::vector<float> weights_of(std::span<const float> w) { return {w.begin(), w.end()}; }

void require_copies_equal(const std::vector<float>& w, const char* what) {
  INFO(what);
  REQUIRE(std::equal(w.begin() + tie.source, w.begin() + tie.source + tie.count,
                     w.begin() + tie.copy));
}

template <class Policy>
std::vector<float> train(std::size_t devices) {
  Trainer<Net, Policy, SGD, PositionCrossEntropy> trainer(workers(devices), test::gpt_sgd,
                                                          {.seed = 9});
  trainer.fit(test::gpt_text().train, test::gpt_fit);
  return weights_of(std::as_const(trainer.model()).parameters());
}

}  // namespace

TEST_CASE("Weight tying: the head's weight is the embedding's, counted once") {
  STATIC_REQUIRE(Net::ties.size() == 1);
  STATIC_REQUIRE(tie.source == 0);
  STATIC_REQUIRE(tie.count == test::gpt_vocab * test::gpt_width);
  STATIC_REQUIRE(Net::unique_parameter_count == Net::parameter_count - tie.count);
  // The copy starts as the embedding's values.
  Model<Net, float> model(9);
  require_copies_equal(weights_of(model.parameters()), "initial weights");
}

TEST_CASE("Weight tying: one SGD step moves both copies by the sum of their gradients, and "
          "clipping counts the tensor once") {
  const auto batch = data::head(test::gpt_text().train, 24);
  // The step's gradients, each copy's on its own, from a Model.
  Model<Net, float> model(9, 24);
  const float* y = model.forward(batch.images.data(), 24, 0, Pass{.training = true});
  const auto sums = detail::loss_ops<PositionCrossEntropy, Net::output_shape>().compute(
      y, 24, data::targets_of(batch), 1.0f, model.output_gradient());
  model.backward(false);
  std::vector<double> g(model.gradients().begin(), model.gradients().end());
  for (auto& v : g) v /= sums.denominator;
  std::vector<double> expected_step(g);  // the gradient each weight steps by
  double squares = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (i < tie.copy || i >= tie.copy + tie.count) squares += g[i] * g[i];
  for (std::size_t k = 0; k < tie.count; ++k) {
    const double sum = g[tie.source + k] + g[tie.copy + k];
    squares += sum * sum - g[tie.source + k] * g[tie.source + k];
    expected_step[tie.source + k] = expected_step[tie.copy + k] = sum;
  }
  const double norm = std::sqrt(squares);

  const float lr = 0.1f;
  for (const float max_norm : {0.0f, 0.25f}) {
    INFO("max_grad_norm " << max_norm);
    Trainer<Net, SingleDevice, SGD, PositionCrossEntropy> trainer(workers(1), {.lr = lr},
                                                                  {.seed = 9});
    const auto before = weights_of(std::as_const(trainer.model()).parameters());
    trainer.fit(batch, {.epochs = 1, .batch_size = 24, .shuffle = false,
                        .max_grad_norm = max_norm});
    const auto after = weights_of(std::as_const(trainer.model()).parameters());
    require_copies_equal(after, "after the step");
    // clip_grad_norm_'s factor, over the norm that counts the tied weight once.
    const double factor = max_norm > 0.0f ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
    if (max_norm > 0.0f) REQUIRE(factor < 0.5);  // the clipping acts
    std::vector<double> moved(after.size()), step(after.size());
    for (std::size_t i = 0; i < after.size(); ++i) {
      moved[i] = static_cast<double>(before[i]) - static_cast<double>(after[i]);
      step[i] = lr * factor * expected_step[i];
    }
    test::require_close(moved, step, test::Tolerance{1e-7, 1e-3}, "the step");
  }
}

TEST_CASE("Weight tying: every policy trains a tied GPT to one device's weights, its copies "
          "equal bit for bit") {
  const auto one = train<SingleDevice>(1);
  require_copies_equal(one, "one device");
  const auto check = [&](const std::vector<float>& got, const char* what) {
    require_copies_equal(got, what);
    test::require_close(got, one, test::Tolerance{1e-6, 1e-4}, what);
  };
  check(train<DataParallel<>>(2), "data 2");
  // The embedding on the first stage, the head on the last: the tie spans them.
  check(train<ModelSplit<Balanced<2>, OneFOneB<4>>>(2), "pipe 2");
  check(train<Hybrid<2, ModelSplit<Balanced<3>, GPipe<2>>>>(6), "data 2 x pipe 3");
  check(train<TensorParallel<2>>(2), "tensor 2");
  check(train<TensorParallel<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(4), "pipe 2 x tensor 2");
}

TEST_CASE("Weight tying: a checkpoint whose two copies differ is refused, naming both") {
  test::TempDir dir;
  const std::string path = dir.file("tied.safetensors");
  Trainer<Net, SingleDevice, SGD, PositionCrossEntropy> trainer(workers(1), test::gpt_sgd,
                                                                {.seed = 9});
  trainer.save(path);
  Trainer<Net, SingleDevice, SGD, PositionCrossEntropy> resumed(workers(1), test::gpt_sgd,
                                                                {.seed = 3});
  resumed.load(path);
  require_copies_equal(weights_of(std::as_const(resumed.model()).parameters()), "loaded");
  REQUIRE(resumed.model().parameters()[tie.copy] == trainer.model().parameters()[tie.source]);

  trainer.model().parameters()[tie.copy + 5] += 1.0f;
  trainer.save(path);
  const auto kept = weights_of(std::as_const(resumed.model()).parameters());
  REQUIRE_THROWS_WITH(resumed.load(path),
                      Catch::Contains("holds the tied weights '6.tied_linear.weight' and "
                                      "'1.embedding.weight', which differ at element 5") &&
                          Catch::Contains("a tied pair trains as one tensor"));
  test::require_equal(weights_of(std::as_const(resumed.model()).parameters()), kept,
                      "the weights after the refused load");
}
