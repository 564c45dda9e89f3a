// Adam and AdamW against a plain reference, learning-rate schedules,
// gradient clipping, checkpoints (names, round trips, mismatches), exact
// resume and the metrics log, on one CPU device.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

using namespace loom;
using loom::test::fashion;
using loom::test::head;
using loom::test::StopAfter;
using loom::test::TempDir;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<32>, ReLU, Linear<10>>;
// Running statistics and dropout masks are state a resumed run must get back.
using Regularised = Sequential<Input<1, 28, 28>, Flatten, Linear<32>, BatchNorm1d, ReLU,
                               Dropout<0.25>, Linear<10>>;

std::vector<float> copy(std::span<const float> values) { return {values.begin(), values.end()}; }

// Adam as Kingma & Ba write it, in double: the reference the fused float
// update is held to.
struct ReferenceAdam {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;
  std::vector<double> m, v;
  int t = 0;
  void step(std::vector<double>& w, const std::vector<double>& g) {
    ++t;
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (decoupled) w[i] -= lr * weight_decay * w[i];
      const double grad = g[i] + (decoupled ? 0.0 : weight_decay * w[i]);
      m[i] = beta1 * m[i] + (1 - beta1) * grad;
      v[i] = beta2 * v[i] + (1 - beta2) * grad * grad;
      const double m_hat = m[i] / (1 - std::pow(beta1, t));
      const double v_hat = v[i] / (1 - std::pow(beta2, t));
      w[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

// The learning rate each step begins with.
struct RecordRates {
  std::vector<float>* rates;
  template <class T>
  void on_step_begin(const StepBegin&, T& trainer) {
    rates->push_back(trainer.optimizer().options().lr);
  }
};

// Asks fit() to stop as optimizer step k + 1 begins: it ends after that step.
struct StopAtStepBegin {
  std::uint64_t k;
  template <class T>
  void on_step_begin(const StepBegin&, T& trainer) {
    if (trainer.steps() == k) trainer.stop();
  }
};

// Asks fit() to stop before its first step.
struct StopAtFitBegin {
  template <class T>
  void on_fit_begin(const FitInfo&, T& trainer) {
    trainer.stop();
  }
};

// Saves a checkpoint after optimizer step k and lets the fit go on, as a
// run that dies later does: a run resumed from it repeats the steps after k.
struct SaveAt {
  std::uint64_t k;
  std::string path;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() == k) trainer.save(path);
  }
};

// A copy of checkpoint `from` without the metadata `dropped`, as an older
// loom wrote it, and with the values `changed`, as a corrupted or
// hand-edited file holds them.
void copy_without(const std::string& from, const std::string& to,
                  const std::vector<std::string>& dropped,
                  const std::vector<std::pair<std::string, std::string>>& changed = {}) {
  const auto file = io::SafetensorsFile::read(from);
  io::SafetensorsWriter writer;
  for (const auto& tensor : file.tensors()) {
    std::vector<float> values((tensor.end - tensor.begin) / sizeof(float));
    file.read(tensor.name, values, tensor.shape);
    writer.add(tensor.name, values, tensor.shape);
  }
  for (const auto& [key, value] : file.metadata())
    if (std::ranges::find(dropped, key) == dropped.end()) writer.set_metadata(key, value);
  for (const auto& [key, value] : changed) writer.set_metadata(key, value);
  writer.write(to);
}

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace

TEST_CASE("adam: the first step moves each weight by lr against its gradient's sign") {
  // m_hat = g and v_hat = g^2 after one step: the update is lr * g / (|g| + eps).
  Adam::State<double> adam({.lr = 0.1f}, 3);
  std::vector<double> w{1.0, -2.0, 0.5}, g{0.3, -4.0, 0.0};
  adam.step(w, g);
  // The options are floats: lr and eps as the optimizer holds them.
  const double lr = 0.1f, eps = 1e-8f;
  REQUIRE(w[0] == Approx(1.0 - lr * 0.3 / (0.3 + eps)).epsilon(1e-12));
  REQUIRE(w[1] == Approx(-2.0 + lr * 4.0 / (4.0 + eps)).epsilon(1e-12));
  REQUIRE(w[2] == 0.5);
  REQUIRE(adam.steps() == 1);
  REQUIRE(adam.buffer_count() == 2);
  REQUIRE(adam.buffer_name(0) == "exp_avg");
  REQUIRE(adam.buffer(0)[1] == Approx((1.0 - double(0.9f)) * -4.0).epsilon(1e-12));
  REQUIRE(adam.buffer(1)[1] == Approx((1.0 - double(0.999f)) * 16.0).epsilon(1e-12));

  SECTION("Adam adds weight decay to the gradient, AdamW decays the weight apart") {
    Adam::State<double> l2({.lr = 0.1f, .weight_decay = 0.5f}, 1);
    AdamW::State<double> decoupled({.lr = 0.1f, .weight_decay = 0.5f}, 1);
    std::vector<double> a{2.0}, b{2.0};
    l2.step(a, std::vector<double>{-0.2});  // gradient -0.2 + 0.5 * 2 = 0.8 > 0
    decoupled.step(b, std::vector<double>{-0.2});
    REQUIRE(a[0] == Approx(2.0 - lr * 0.8 / (0.8 + eps)).epsilon(1e-12));
    REQUIRE(b[0] == Approx(2.0 * (1 - lr * 0.5) + lr * 0.2 / (0.2 + eps)).epsilon(1e-12));
  }
  SECTION("AdamW's defaults are PyTorch's") {
    REQUIRE(AdamW::Options{}.lr == 1e-3f);
    REQUIRE(AdamW::Options{}.weight_decay == 1e-2f);
    REQUIRE(Adam::Options{}.weight_decay == 0.0f);
    REQUIRE(AdamW::Options{}.beta2 == 0.999f);
  }
  SECTION("bad options") {
    REQUIRE_THROWS_WITH(AdamW::State<float>({.lr = 0.0f}, 1),
                        Catch::Contains("AdamW: learning rate must be positive"));
    REQUIRE_THROWS_WITH(Adam::State<float>({.beta2 = 1.0f}, 1),
                        Catch::Contains("Adam: beta2 must be in [0, 1)"));
    REQUIRE_THROWS_WITH(Adam::State<float>({.eps = 0.0f}, 1),
                        Catch::Contains("eps must be positive"));
  }
}

TEST_CASE("adam: 50 float steps follow the double reference, with and without decoupled decay") {
  for (const bool decoupled : {false, true}) {
    const std::size_t n = 257;
    auto w = test::random_vector<float>(n, 3);
    std::vector<double> ref(w.begin(), w.end());
    ReferenceAdam reference{0.01, 0.9, 0.999, 1e-8, 0.05, decoupled,
                            std::vector<double>(n), std::vector<double>(n)};
    Adam::State<float> adam({.lr = 0.01f, .weight_decay = 0.05f}, n);
    AdamW::State<float> adamw({.lr = 0.01f, .weight_decay = 0.05f}, n);
    for (int s = 0; s < 50; ++s) {
      const auto g = test::random_vector<float>(n, 100 + s, -2.0, 2.0);
      if (decoupled)
        adamw.step(w, g);
      else
        adam.step(w, g);
      reference.step(ref, std::vector<double>(g.begin(), g.end()));
    }
    test::require_close(w, ref, {1e-5, 1e-5}, decoupled ? "AdamW weights" : "Adam weights");
  }
}

TEST_CASE("schedules: constant, step decay, cosine and warm-up factors") {
  REQUIRE(schedules::Constant{}(7, 10) == 1.0);
  const schedules::StepDecay decay{.every = 3, .gamma = 0.5};
  REQUIRE(decay(2, 100) == 1.0);
  REQUIRE(decay(3, 100) == 0.5);
  REQUIRE(decay(7, 100) == 0.25);
  const schedules::Cosine cosine{.min_factor = 0.1};
  REQUIRE(cosine(0, 100) == 1.0);
  REQUIRE(cosine(50, 100) == Approx(0.55));
  REQUIRE(cosine(100, 100) == Approx(0.1));
  const schedules::Warmup<schedules::Cosine> warm{.steps = 4, .start_factor = 0.2, .after = {}};
  REQUIRE(warm(0, 14) == 0.2);
  REQUIRE(warm(2, 14) == Approx(0.6));
  REQUIRE(warm(4, 14) == 1.0);               // the cosine's first step
  REQUIRE(warm(9, 14) == Approx(0.5));       // half-way through its 10
  REQUIRE_THROWS_WITH((schedules::StepDecay{.every = 0}(1, 2)), Catch::Contains("at least 1"));
}

TEST_CASE("schedules: LrSchedule sets each step's rate, scaled linearly with the global batch") {
  const auto train = head(fashion().train, 320);
  std::vector<float> rates;
  Trainer<Mlp, SingleDevice, AdamW> trainer(devices::cpu(1), {.lr = 0.004f});
  // 320 samples in batches of 32, two per step: 5 steps an epoch, 10 in all;
  // the rate is for 128 samples a step, and a step has 64.
  trainer.fit(train, {.epochs = 2, .batch_size = 32, .accumulation_steps = 2},
              callbacks::LrSchedule<schedules::Warmup<schedules::Cosine>>{
                  .schedule = {.steps = 2, .start_factor = 0.5, .after = {}},
                  .reference_batch = 128},
              RecordRates{&rates});
  REQUIRE(rates.size() == 10);
  const double base = 0.004 * 64.0 / 128.0;
  REQUIRE(rates[0] == Approx(base * 0.5));
  REQUIRE(rates[1] == Approx(base * 0.75));
  REQUIRE(rates[2] == Approx(base));
  for (std::size_t s = 2; s < 10; ++s)
    REQUIRE(rates[s] == Approx(base * 0.5 * (1 + std::cos(M_PI * double(s - 2) / 8.0))));
  REQUIRE(trainer.base_lr() == 0.004f);
  REQUIRE(trainer.steps() == 10);
}

TEST_CASE("clipping: gradients above the global norm are scaled to it, layer by layer in double") {
  Model<Mlp, float> model(1);
  auto g = model.gradients();
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = (i % 7 == 0 ? 0.01f : -0.002f) * float(i % 5);
  double squares = 0.0;
  for (const float x : g) squares += double(x) * double(x);
  const double norm = std::sqrt(squares);
  const auto before = copy(g);
  SECTION("above: scaled by max / (norm + 1e-6)") {
    const float factor = clip_gradients<Mlp>(g, norm / 4);
    REQUIRE(factor == static_cast<float>((norm / 4) / (norm + 1e-6)));
    for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == before[i] * factor);
  }
  SECTION("below: untouched") {
    REQUIRE(clip_gradients<Mlp>(g, norm * 2) == 1.0f);
    test::require_equal(g, before, "gradients under the norm");
  }
}

TEST_CASE("clipping: fit with max_grad_norm equals a hand-written clipped loop") {
  const auto train = head(fashion().train, 256);
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.5f, .momentum = 0.9f}, {.seed = 4});
  trainer.fit(train, {.epochs = 1, .batch_size = 64, .shuffle = false, .max_grad_norm = 0.25f});

  Model<Mlp, float> model(4);
  SGD::State<float> sgd({.lr = 0.5f, .momentum = 0.9f}, Mlp::parameter_count);
  std::size_t clipped = 0;
  for (std::size_t first = 0; first < 256; first += 64) {
    const float* logits = model.forward(train.images.data() + first * 784, 64);
    SoftmaxCrossEntropy::evaluate<float>(logits, train.labels.data() + first, 64, 10, 64,
                                         model.output_gradient());
    model.backward();
    clipped += clip_gradients<Mlp>(model.gradients(), 0.25) < 1.0f;
    sgd.step(model.parameters(), model.gradients());
  }
  REQUIRE(clipped >= 2);  // the bound was reached: the test compares clipped steps
  test::require_equal(trainer.model().parameters(), model.parameters(), "clipped weights");
}

TEST_CASE("checkpoints: tensors are named by layer index and kind, in PyTorch's shapes") {
  using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>,
                           ReLU, MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
  const auto table = tensor_table<LeNet>();
  REQUIRE(table.size() == 8);
  REQUIRE(table[0].name == "1.conv.weight");
  REQUIRE(table[0].shape == std::vector<std::size_t>{20, 1, 5, 5});
  REQUIRE(table[3].name == "4.conv.bias");
  REQUIRE(table[4].name == "8.linear.weight");
  REQUIRE(table[4].shape == std::vector<std::size_t>{500, 800});
  REQUIRE(table[7].name == "10.linear.bias");
  REQUIRE(table[7].offset + 10 == LeNet::parameter_count);

  SECTION("every parameter and running statistic once, residual bodies and GRUs included") {
    using Deep = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 1, 1>, BatchNorm2d, ReLU,
                            Residual<Conv2d<8, 3, 2, 1>, BatchNorm2d, ReLU, Conv2d<8, 3, 1, 1>>,
                            GlobalAvgPool, Reshape<2, 4>, GRU<6>, Linear<10>>;
    const auto deep = tensor_table<Deep>();
    std::vector<int> params(Deep::parameter_count), state(Deep::state_count);
    for (const auto& slot : deep)
      for (std::size_t i = 0; i < slot.size(); ++i) ++(slot.state ? state : params)[slot.offset + i];
    REQUIRE(std::ranges::count(params, 1) == std::ssize(params));
    REQUIRE(std::ranges::count(state, 1) == std::ssize(state));
    const auto named = [&](const std::string& name) {
      return std::ranges::find_if(deep, [&](const auto& s) { return s.name == name; }) != deep.end();
    };
    REQUIRE(named("2.batchnorm.running_var"));
    REQUIRE(named("4.residual.body.0.conv.weight"));
    REQUIRE(named("4.residual.body.1.batchnorm.running_mean"));
    REQUIRE(named("4.residual.shortcut.conv.weight"));
    REQUIRE(named("7.gru.weight_hh_l0"));
  }
}

TEST_CASE("checkpoints: save and load give back weights, statistics and optimizer state") {
  TempDir dir;
  const auto train = head(fashion().train, 256);
  const auto test = head(fashion().test, 200);
  Trainer<Regularised, SingleDevice, AdamW> trainer(devices::cpu(1), {.lr = 0.002f});
  trainer.fit(train, {.epochs = 1, .batch_size = 64});
  trainer.save(dir.file("a.safetensors"));

  Trainer<Regularised, SingleDevice, AdamW> loaded(devices::cpu(1), {.lr = 0.002f}, {.seed = 9});
  loaded.load(dir.file("a.safetensors"));
  test::require_equal(loaded.model().parameters(), trainer.model().parameters(), "weights");
  test::require_equal(loaded.model().state(), trainer.model().state(), "running statistics");
  test::require_equal(loaded.optimizer().buffer(1), trainer.optimizer().buffer(1), "exp_avg_sq");
  REQUIRE(loaded.optimizer().steps() == 4);
  REQUIRE(loaded.steps() == 4);
  REQUIRE(loaded.evaluate(test, 100).loss == trainer.evaluate(test, 100).loss);

  const auto file = io::SafetensorsFile::read(dir.file("a.safetensors"));
  REQUIRE(file.metadata("optimizer") == "AdamW");
  REQUIRE(file.metadata("optimizer.beta1") == "0.9");
  REQUIRE(file.metadata("optimizer.beta2") == "0.999");
  REQUIRE(file.metadata("optimizer.eps") == "1e-08");
  REQUIRE(file.metadata("optimizer.weight_decay") == "0.01");
  REQUIRE(file.metadata("trainer.nonfinite_steps") == "0");
  REQUIRE(file.metadata("position.epoch") == "1");
  REQUIRE(file.metadata("position.ended") == "1");
  REQUIRE(file.contains("optimizer.exp_avg.2.linear.weight"));
  REQUIRE(file.info("3.batchnorm.running_mean").shape == std::vector<std::size_t>{32});
}

TEST_CASE("AnyOptimizer: the chosen optimizer's numbers, name and checkpoints") {
  TempDir dir;
  const auto train = head(fashion().train, 256);
  const FitOptions fit{.epochs = 1, .batch_size = 64};
  // Chosen at run time, each trains bit for bit as its own type.
  Trainer<Regularised, SingleDevice, AdamW> typed(devices::cpu(1), {.lr = 0.002f});
  Trainer<Regularised, SingleDevice, AnyOptimizer> chosen(devices::cpu(1),
                                                          AdamW::Options{.lr = 0.002f});
  typed.fit(train, fit);
  chosen.fit(train, fit);
  test::require_equal(chosen.model().parameters(), typed.model().parameters(), "AdamW");
  REQUIRE(std::string(chosen.optimizer().optimizer()) == "AdamW");
  REQUIRE(chosen.optimizer().buffer_count() == 2);
  REQUIRE(chosen.optimizer().steps() == 4);
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  Trainer<Mlp, SingleDevice, AnyOptimizer> chosen_sgd(devices::cpu(1),
                                                      SGD::Options{.lr = 0.01f, .momentum = 0.9f});
  sgd.fit(train, fit);
  chosen_sgd.fit(train, fit);
  test::require_equal(chosen_sgd.model().parameters(), sgd.model().parameters(), "SGD");
  REQUIRE(chosen_sgd.optimizer().buffer_name(0) == "momentum_buffer");
  // A schedule's rate reaches the chosen optimizer.
  chosen_sgd.optimizer().set_lr(0.005f);
  REQUIRE(chosen_sgd.optimizer().options().lr == 0.005f);
  REQUIRE(std::get<SGD::Options>(chosen_sgd.optimizer().options().chosen()).lr == 0.005f);
  // lr is the one that counts: the chosen options follow it.
  AnyOptimizer::Options edited = AdamW::Options{.lr = 0.002f, .weight_decay = 0.05f};
  edited.lr = 0.004f;
  REQUIRE(std::get<AdamW::Options>(edited.chosen()).lr == 0.004f);
  REQUIRE(std::get<AdamW::Options>(edited.chosen()).weight_decay == 0.05f);
  Trainer<Mlp, SingleDevice, AnyOptimizer> edited_trainer(devices::cpu(1), edited);
  REQUIRE(edited_trainer.base_lr() == 0.004f);

  // Checkpoints carry the chosen one's name and buffers, both ways.
  chosen.save(dir.file("chosen.safetensors"));
  REQUIRE(io::SafetensorsFile::read(dir.file("chosen.safetensors")).metadata("optimizer") ==
          "AdamW");
  Trainer<Regularised, SingleDevice, AdamW> back(devices::cpu(1), {.lr = 0.002f}, {.seed = 9});
  back.load(dir.file("chosen.safetensors"));
  test::require_equal(back.optimizer().buffer(1), chosen.optimizer().buffer(1), "exp_avg_sq");
  typed.save(dir.file("typed.safetensors"));
  Trainer<Regularised, SingleDevice, AnyOptimizer> forth(devices::cpu(1),
                                                         AdamW::Options{.lr = 0.002f}, {.seed = 9});
  forth.load(dir.file("typed.safetensors"));
  test::require_equal(forth.model().parameters(), typed.model().parameters(), "loaded weights");
  REQUIRE(forth.optimizer().steps() == 4);
  // One that chose SGD refuses AdamW's state, as the SGD type does.
  Trainer<Regularised, SingleDevice, AnyOptimizer> other(devices::cpu(1),
                                                         SGD::Options{.lr = 0.01f});
  REQUIRE_THROWS_WITH(other.load(dir.file("typed.safetensors")),
                      Catch::Contains("was written by a trainer using AdamW, but this one uses "
                                      "SGD"));
  // The chosen optimizer checks its options as its type does.
  REQUIRE_THROWS_WITH((Trainer<Mlp, SingleDevice, AnyOptimizer>(devices::cpu(1),
                                                                 AdamW::Options{.beta1 = 1.0f})),
                      Catch::Contains("AdamW: beta1 must be in [0, 1), got 1"));
}

TEST_CASE("checkpoints: a checkpoint that does not fit is refused, and loses nothing") {
  TempDir dir;
  const auto train = head(fashion().train, 128);
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  sgd.fit(train, {.epochs = 1, .batch_size = 64});
  sgd.save(dir.file("mlp.safetensors"));

  SECTION("another network: the first tensor whose shape differs") {
    using Wider = Sequential<Input<1, 28, 28>, Flatten, Linear<48>, ReLU, Linear<10>>;
    Trainer<Wider> wider(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    const auto before = copy(wider.model().parameters());
    REQUIRE_THROWS_WITH(wider.load(dir.file("mlp.safetensors")),
                        Catch::Contains("'2.linear.weight'") && Catch::Contains("[32,784]") &&
                            Catch::Contains("[48,784]"));
    test::require_equal(wider.model().parameters(), before, "weights after a refused load");
  }
  SECTION("another optimizer") {
    Trainer<Mlp, SingleDevice, Adam> adam(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(adam.load(dir.file("mlp.safetensors")),
                        Catch::Contains("written by a trainer using SGD, but this one uses Adam"));
  }
  SECTION("load(path, false) takes the weights, not the position") {
    Trainer<Mlp> fresh(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    fresh.load(dir.file("mlp.safetensors"), false);
    REQUIRE(fresh.position().epoch == 0);
    fresh.save(dir.file("fresh.safetensors"));
    REQUIRE(io::SafetensorsFile::read(dir.file("fresh.safetensors")).metadata("position.epoch") ==
            "0");
  }
  SECTION("SGD with and without momentum") {
    Trainer<Mlp> plain(devices::cpu(1), {.lr = 0.01f});
    REQUIRE_THROWS_WITH(plain.load(dir.file("mlp.safetensors")),
                        Catch::Contains("holds tensor 'optimizer.momentum_buffer.2.linear.weight'"));
    Trainer<Mlp> plain_source(devices::cpu(1), {.lr = 0.01f});
    plain_source.save(dir.file("plain.safetensors"));
    REQUIRE_THROWS_WITH(sgd.load(dir.file("plain.safetensors")),
                        Catch::Contains("has no optimizer tensor 'optimizer.momentum_buffer"));
  }
  SECTION("a missing file, and a safetensors file that is no checkpoint") {
    REQUIRE_THROWS_WITH(sgd.load(dir.file("none.safetensors")), Catch::Contains("none.safetensors"));
    io::SafetensorsWriter writer;
    const std::vector<float> one{1.0f};
    writer.add("x", one, {1});
    writer.write(dir.file("plain-tensors.safetensors"));
    REQUIRE_THROWS_WITH(sgd.load(dir.file("plain-tensors.safetensors")),
                        Catch::Contains("not a loom checkpoint"));
  }
  SECTION("resuming with other optimizer options (another lr, or a new fit, may differ)") {
    const std::string path = dir.file("mlp.safetensors");
    Trainer<Mlp> other(devices::cpu(1), {.lr = 0.01f, .momentum = 0.8f});
    const auto before = copy(other.model().parameters());
    REQUIRE_THROWS_WITH(other.load(path),
                        Catch::Contains("checkpoint '" + path + "' was written by a trainer using "
                                        "SGD with momentum 0.9, but this one has 0.8; resume "
                                        "with the same SGD options (lr may differ), or "
                                        "load(path, false)"));
    test::require_equal(other.model().parameters(), before, "weights after a refused load");
    Trainer<Mlp> nesterov(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f, .nesterov = true});
    REQUIRE_THROWS_WITH(nesterov.load(path), Catch::Contains("with nesterov 0, but this one has 1"));
    Trainer<Mlp> decay(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f, .weight_decay = 1e-4f});
    REQUIRE_THROWS_WITH(decay.load(path),
                        Catch::Contains("with weight_decay 0, but this one has 1e-04"));
    other.load(path, false);
    REQUIRE(other.optimizer().options().momentum == 0.8f);
    Trainer<Mlp> faster(devices::cpu(1), {.lr = 0.5f, .momentum = 0.9f});
    faster.load(path);
    REQUIRE(faster.optimizer().options().lr == 0.01f);  // the checkpoint's goes on
  }
  SECTION("resuming with other fit options") {
    Trainer<Mlp> again(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    sgd.fit(train, {.epochs = 2, .batch_size = 64}, callbacks::Checkpoint({
                                                        .path = dir.file("mid.safetensors"),
                                                        .every_steps = 3,
                                                        .every_epoch = false,
                                                        .at_end = false}));
    again.load(dir.file("mid.safetensors"));
    REQUIRE_THROWS_WITH(again.fit(train, {.epochs = 2, .batch_size = 32}),
                        Catch::Contains("with batch size 64, but this fit has 32"));
  }
}

TEST_CASE("checkpoints: a position that its fit's options cannot reach is refused, naming the field") {
  TempDir dir;
  const auto train = head(fashion().train, 128);  // 2 batches of 64: position epoch 1, ended
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  sgd.fit(train, {.epochs = 1, .batch_size = 64});
  const std::string path = dir.file("mlp.safetensors");
  sgd.save(path);
  struct Case {
    std::vector<std::pair<std::string, std::string>> changed;
    std::string message;
  };
  const std::vector<Case> cases{
      // The issue's edit: the epoch reopened after more batches than it has.
      {{{"position.ended", "0"}, {"position.batches", "5"}, {"position.samples", "320"}},
       "metadata position.batches is 5, but an epoch of fit.samples 128 in batches of "
       "fit.batch_size 64 has 2"},
      // ended and batches alone: once a misleading non-finite-gradient error.
      {{{"position.ended", "0"}, {"position.batches", "1"}},
       "metadata position.steps is 2, but position.batches 1 in steps of 1 batch(es) make 1"},
      {{{"position.samples", "100"}},
       "metadata position.samples is 100, but position.batches 2 of fit.batch_size 64 hold 128"},
      {{{"position.ended", "1"}, {"position.batches", "1"}, {"position.steps", "1"},
        {"position.samples", "64"}},
       "metadata position.ended is 1, but position.batches 1 is short of the epoch's 2"},
      {{{"position.correct", "129"}}, "metadata position.correct is 129, but only position.samples 128"},
      {{{"position.loss_sum", "-1"}}, "metadata position.loss_sum is -1"},
      {{{"position.epoch", "0"}},
       "metadata position.epoch is 0, but position.batches 2, position.steps 2, "
       "position.samples 128 and position.ended 1 must all be 0 before the first epoch"},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const std::string edited = dir.file("edited-" + std::to_string(c) + ".safetensors");
    copy_without(path, edited, {}, cases[c].changed);
    Trainer<Mlp> other(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
    const auto before = copy(other.model().parameters());
    INFO(cases[c].message);
    REQUIRE_THROWS_WITH(other.load(edited),
                        Catch::Contains("checkpoint '" + edited + "': " + cases[c].message) &&
                            Catch::Contains("the checkpoint is corrupt"));
    test::require_equal(other.model().parameters(), before, "weights after a refused load");
  }
  // The file as written loads.
  Trainer<Mlp> fine(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  fine.load(path);
  REQUIRE(fine.position().ended);
}

TEST_CASE("checkpoints: a resume refusal names the setting (ResumeMismatch), for a program's flags") {
  TempDir dir;
  const auto train = head(fashion().train, 128);
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  sgd.fit(train, {.epochs = 1, .batch_size = 64}, StopAfter{1});
  sgd.save(dir.file("mid.safetensors"));
  Trainer<Mlp> resumed(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  resumed.load(dir.file("mid.safetensors"));
  try {
    resumed.fit(train, {.epochs = 1, .batch_size = 32});
    FAIL("a resume with another batch size was accepted");
  } catch (const ResumeMismatch& refused) {
    REQUIRE(refused.setting == "batch_size");
    REQUIRE(refused.was == "64");
    REQUIRE(refused.now == "32");
  }
  Trainer<Mlp> momentum(devices::cpu(1), {.lr = 0.01f, .momentum = 0.5f});
  try {
    momentum.load(dir.file("mid.safetensors"));
    FAIL("a resume with another momentum was accepted");
  } catch (const ResumeMismatch& refused) {
    REQUIRE(refused.setting == "momentum");
    REQUIRE(refused.was == "0.9");
    REQUIRE(refused.now == "0.5");
  }
}

TEST_CASE("checkpoints: a fit stopped before its first epoch saves its own position, which loads") {
  TempDir dir;
  const auto train = head(fashion().train, 128);
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  sgd.fit(train, {.epochs = 1, .batch_size = 64});
  REQUIRE(sgd.position().ended);
  // The second fit (other batches) trains nothing; its checkpoint must not
  // pair the first fit's position with its own options.
  const std::string path = dir.file("stopped.safetensors");
  sgd.fit(train, {.epochs = 1, .batch_size = 32}, StopAtFitBegin{},
          callbacks::Checkpoint({.path = path}));
  REQUIRE(sgd.position().epoch == 0);
  Trainer<Mlp> other(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  other.load(path);
  REQUIRE(other.position().epoch == 0);
  REQUIRE(other.steps() == 2);
}

TEST_CASE("fit: a batch larger than the data set plans memory for the data set, not for the batch") {
  const auto train = head(fashion().train, 100);
  Trainer<Mlp> one(devices::cpu(1), {.lr = 0.01f});
  one.fit(train, {.epochs = 1, .batch_size = std::size_t{1} << 20});
  REQUIRE(one.model().capacity() == 100);
  REQUIRE(one.steps() == 1);
  Trainer<Mlp, DataParallel<>> two(devices::cpu(2), {.lr = 0.01f});
  two.fit(train, {.epochs = 1, .batch_size = std::size_t{1} << 20});
  for (std::size_t r = 0; r < 2; ++r) REQUIRE(two.data_parallel().replica_model(r).capacity() == 50);
  test::require_close(two.model().parameters(), one.model().parameters(), {1e-6, 1e-5},
                      "weights after the one step");
}

TEST_CASE("checkpoints: callbacks::Checkpoint refuses a folder or an unwritable place before training") {
  TempDir dir;
  const auto train = head(fashion().train, 128);
  Trainer<Mlp> sgd(devices::cpu(1), {.lr = 0.01f});
  REQUIRE_THROWS_WITH(sgd.fit(train, {.epochs = 1, .batch_size = 64},
                              callbacks::Checkpoint({.path = dir.path()})),
                      Catch::Contains("callbacks::Checkpoint: '" + dir.path() + "' is a folder"));
  REQUIRE(sgd.steps() == 0);
  // /proc takes no new files, not even from root (CI runs as root, whom
  // file permissions do not stop).
  REQUIRE_THROWS_WITH(sgd.fit(train, {.epochs = 1, .batch_size = 64},
                              callbacks::Checkpoint({.path = "/proc/loom.safetensors"})),
                      Catch::Contains("callbacks::Checkpoint: cannot create a file in the folder "
                                      "of '/proc/loom.safetensors'"));
  REQUIRE(sgd.steps() == 0);
  // A writable place: the probe leaves nothing behind.
  sgd.fit(train, {.epochs = 1, .batch_size = 64},
          callbacks::Checkpoint({.path = dir.file("ok.safetensors")}));
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    files.push_back(entry.path().filename().string());
  REQUIRE(files == std::vector<std::string>{"ok.safetensors"});
}

TEST_CASE("checkpoints: optimizer options round-trip exactly, and an older checkpoint has none to check") {
  TempDir dir;
  const std::string path = dir.file("adamw.safetensors");
  // Values that six significant digits would not give back.
  const AdamW::Options odd{.lr = 0.002f, .beta2 = std::nextafter(0.999f, 1.0f), .eps = 1.2345678e-8f};
  Trainer<Mlp, SingleDevice, AdamW> source(devices::cpu(1), odd);
  source.save(path);
  const auto file = io::SafetensorsFile::read(path);
  REQUIRE(file.metadata("optimizer.beta2") == "0.9990001");
  REQUIRE(file.metadata("optimizer.eps") == "1.2345678e-08");
  Trainer<Mlp, SingleDevice, AdamW> same(devices::cpu(1), odd);
  REQUIRE_NOTHROW(same.load(path));
  AdamW::Options rounded = odd;
  rounded.beta2 = 0.999f;
  Trainer<Mlp, SingleDevice, AdamW> other(devices::cpu(1), rounded);
  REQUIRE_THROWS_WITH(other.load(path),
                      Catch::Contains("using AdamW with beta2 0.9990001, but this one has 0.999;"));

  const std::string older = dir.file("older.safetensors");
  copy_without(path, older,
               {"optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
                "trainer.nonfinite_steps"});
  REQUIRE_FALSE(io::SafetensorsFile::read(older).metadata().contains("optimizer.beta2"));
  REQUIRE_NOTHROW(other.load(older));
  REQUIRE(other.nonfinite_steps() == 0);
}

TEST_CASE("checkpoints: callbacks::Checkpoint names the steps it saves after") {
  TempDir dir;
  const callbacks::Checkpoint every_5({.path = dir.file("c.safetensors"), .every_steps = 5});
  REQUIRE(!every_5.needs_state_at_step(4));
  REQUIRE(every_5.needs_state_at_step(5));
  REQUIRE(every_5.needs_state_at_step(10));
  const callbacks::Checkpoint by_epoch({.path = dir.file("c.safetensors")});
  REQUIRE(!by_epoch.needs_state_at_step(5));
}

TEST_CASE("checkpoints: stopping after k steps and resuming gives the uninterrupted weights") {
  TempDir dir;
  const auto train = head(fashion().train, 600);
  // 600 samples, batches of 50 two to a step: 6 steps an epoch, 18 in all.
  const FitOptions fit{.epochs = 3, .batch_size = 50, .seed = 3, .accumulation_steps = 2,
                       .augment = {.crop_padding = 2, .horizontal_flip = true},
                       .max_grad_norm = 1.0f};
  using Schedule = callbacks::LrSchedule<schedules::Warmup<schedules::Cosine>>;
  const Schedule schedule{.schedule = {.steps = 3, .start_factor = 0.3, .after = {}}};
  const AdamW::Options adamw{.lr = 0.003f};

  Trainer<Regularised, SingleDevice, AdamW> whole(devices::cpu(1), adamw, {.seed = 11});
  std::vector<EpochInfo> whole_epochs;
  struct Epochs {
    std::vector<EpochInfo>* seen;
    void on_epoch_end(const EpochInfo& e) { seen->push_back(e); }
  };
  whole.fit(train, fit, schedule, Epochs{&whole_epochs});

  // Stops after step k: 8 is mid-epoch; 12 ends epoch 2, saved before its
  // end callbacks ran, or (at_end) after. A fresh trainer loads the
  // checkpoint and goes on; `resumed`: the epochs it then ends.
  struct Case {
    std::size_t k;
    bool at_end;
    std::size_t resumed;
  };
  for (const auto [k, at_end, resumed] : {Case{8, false, 2}, Case{12, false, 2}, Case{12, true, 1}}) {
    const auto path = dir.file("resume-" + std::to_string(k) + ".safetensors");
    {
      Trainer<Regularised, SingleDevice, AdamW> first(devices::cpu(1), adamw, {.seed = 11});
      first.fit(train, fit, schedule, StopAfter{k},
                callbacks::Checkpoint(
                    {.path = path, .every_steps = k, .every_epoch = false, .at_end = at_end}));
      REQUIRE(first.steps() == k);
    }
    Trainer<Regularised, SingleDevice, AdamW> second(devices::cpu(1), adamw, {.seed = 99});
    second.load(path);
    std::vector<EpochInfo> epochs;
    second.fit(train, fit, schedule, Epochs{&epochs});
    INFO("stopped after step " << k << (at_end ? ", saved at the end" : ""));
    REQUIRE(second.steps() == 18);
    test::require_equal(second.model().parameters(), whole.model().parameters(), "weights");
    test::require_equal(second.model().state(), whole.model().state(), "running statistics");
    test::require_equal(second.optimizer().buffer(0), whole.optimizer().buffer(0), "exp_avg");
    // The resumed epochs report what the uninterrupted ones did.
    REQUIRE(epochs.size() == resumed);
    REQUIRE(epochs.back().loss == whole_epochs.back().loss);
    REQUIRE(epochs.front().loss == whole_epochs[whole_epochs.size() - epochs.size()].loss);
  }
}

TEST_CASE("checkpoints: stop() mid-step, a refused resume, and a re-saved checkpoint resume exactly") {
  TempDir dir;
  const auto train = head(fashion().train, 400);
  // 8 batches of 50, two to a step: 4 steps an epoch, 8 in all.
  const FitOptions fit{.epochs = 2, .batch_size = 50, .seed = 1, .accumulation_steps = 2};
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  Trainer<Regularised> whole(devices::cpu(1), sgd, {.seed = 5});
  whole.fit(train, fit);
  {
    // stop() as step 6 begins: step 6 completes, both its batches.
    Trainer<Regularised> first(devices::cpu(1), sgd, {.seed = 5});
    first.fit(train, fit, StopAtStepBegin{5},
              callbacks::Checkpoint({.path = dir.file("a.safetensors"), .every_epoch = false}));
    REQUIRE(first.steps() == 6);
    REQUIRE(first.position().batches == 4);
    REQUIRE(first.position().steps == 2);
  }
  {
    // load, then save again before any fit: the fit it belongs to goes along.
    Trainer<Regularised> relay(devices::cpu(1), sgd, {.seed = 5});
    relay.load(dir.file("a.safetensors"));
    relay.save(dir.file("b.safetensors"));
  }
  Trainer<Regularised> second(devices::cpu(1), sgd, {.seed = 5});
  second.load(dir.file("b.safetensors"));
  FitOptions other = fit;
  other.seed = 2;
  REQUIRE_THROWS_WITH(second.fit(train, other), Catch::Contains("with seed 1, but this fit has 2"));
  second.fit(train, fit);  // the refused fit took nothing: this one resumes
  REQUIRE(second.steps() == 8);
  test::require_equal(second.model().parameters(), whole.model().parameters(), "weights");
}

TEST_CASE("checkpoints: an error in a step leaves the position at the step's start") {
  TempDir dir;
  auto train = head(fashion().train, 300);
  // A NaN in batch 5 (step 3, its second batch) with 2 batches of 50 a step.
  train.images[5 * 50 * 784 + 7] = std::numeric_limits<float>::quiet_NaN();
  Trainer<Regularised> trainer(devices::cpu(1), {.lr = 0.05f}, {.seed = 5});
  REQUIRE_THROWS_WITH(
      trainer.fit(train, {.epochs = 1, .batch_size = 50, .shuffle = false, .accumulation_steps = 2}),
      Catch::Contains("at epoch 1, step 3"));
  REQUIRE(trainer.position().batches == 4);
  REQUIRE(trainer.position().steps == 2);
  REQUIRE(trainer.steps() == 2);
  trainer.save(dir.file("after-nan.safetensors"));
  REQUIRE(io::SafetensorsFile::read(dir.file("after-nan.safetensors")).metadata("trainer.batches") ==
          "4");
}

TEST_CASE("metrics: one JSON line per step and per epoch, with the test set's figures") {
  TempDir dir;
  const auto train = head(fashion().train, 256);
  const auto test = head(fashion().test, 100);
  callbacks::Evaluate evaluate(test, nullptr);
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.02f, .momentum = 0.9f});
  trainer.fit(train, {.epochs = 2, .batch_size = 64}, evaluate,
              callbacks::MultiStepLR{.milestones = {1}, .factor = 0.5f, .out = nullptr},
              callbacks::Metrics({.path = dir.file("m.jsonl"), .evaluate = &evaluate}));
  std::ifstream in(dir.file("m.jsonl"));
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  REQUIRE(lines.size() == 2 * 4 + 2);
  const auto& first = lines[0];
  REQUIRE(first["kind"] == "step");
  REQUIRE(first["step"] == 1);
  REQUIRE(first["epoch"] == 1);
  REQUIRE(first["lr"].get<double>() == Approx(0.02));
  REQUIRE(first["loss"].get<double>() > 1.5);  // untrained: about ln 10
  REQUIRE(first["samples_per_second"].get<double>() > 0.0);
  REQUIRE(first["device_step_seconds"].size() == 1);
  // The epoch's running loss is the mean of its steps' (equal batches).
  double sum = 0.0;
  for (int s = 0; s < 4; ++s) sum += lines[s]["loss"].get<double>();
  REQUIRE(lines[3]["epoch_loss"].get<double>() == Approx(sum / 4));
  const auto& epoch = lines[4];
  REQUIRE(epoch["kind"] == "epoch");
  REQUIRE(epoch["loss"].get<double>() == Approx(sum / 4));
  REQUIRE(epoch["test_accuracy"].get<double>() == evaluate.history[0].accuracy);
  REQUIRE(lines[5]["lr"].get<double>() == Approx(0.01));
  REQUIRE(lines[9]["step"] == 8);

  REQUIRE_THROWS_WITH(callbacks::Metrics({.path = dir.file("no-such-folder/m.jsonl")}),
                      Catch::Contains("cannot open") && Catch::Contains("no-such-folder"));
}

TEST_CASE("metrics: appending after a resume keeps one line per step and per epoch") {
  TempDir dir;
  const auto train = head(fashion().train, 256);
  // 4 steps an epoch, 8 in all. The first run saves after step k and goes
  // on to the end; the second resumes there and appends. k = 4 is an
  // epoch's last step, saved before its end: the resumed run ends epoch 1
  // again.
  const FitOptions fit{.epochs = 2, .batch_size = 64};
  const SGD::Options sgd{.lr = 0.02f, .momentum = 0.9f};
  for (const std::uint64_t k : {3, 4}) {
    INFO("saved after step " << k);
    const std::string metrics = dir.file("m" + std::to_string(k) + ".jsonl");
    const std::string checkpoint = dir.file("c" + std::to_string(k) + ".safetensors");
    Trainer<Mlp> first(devices::cpu(1), sgd);
    first.fit(train, fit, SaveAt{k, checkpoint}, callbacks::Metrics({.path = metrics}));
    const auto uninterrupted = json_lines(metrics);
    REQUIRE(uninterrupted.size() == 8 + 2);
    Trainer<Mlp> second(devices::cpu(1), sgd);
    second.load(checkpoint);
    second.fit(train, fit, callbacks::Metrics({.path = metrics, .append = true}));
    const auto lines = json_lines(metrics);
    REQUIRE(lines.size() == uninterrupted.size());
    for (std::size_t i = 0; i < lines.size(); ++i) {
      INFO("line " << i + 1);
      REQUIRE(lines[i]["kind"] == uninterrupted[i]["kind"]);
      REQUIRE(lines[i]["step"] == uninterrupted[i]["step"]);
      REQUIRE(lines[i]["loss"] == uninterrupted[i]["loss"]);  // the resume is exact
    }
    std::vector<std::uint64_t> steps;
    for (const auto& line : lines)
      if (line["kind"] == "step") steps.push_back(line["step"].get<std::uint64_t>());
    REQUIRE(steps == std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6, 7, 8});
  }

  SECTION("a last line cut short by a crash is dropped; a malformed earlier line is an error") {
    const std::string metrics = dir.file("m3.jsonl");
    const auto whole = json_lines(metrics);
    std::ofstream(metrics, std::ios::app) << R"({"kind": "step", "st)";
    Trainer<Mlp> done(devices::cpu(1), sgd);
    done.load(dir.file("c3.safetensors"));
    done.fit(train, fit, callbacks::Metrics({.path = metrics, .append = true}));
    REQUIRE(json_lines(metrics).size() == whole.size());

    std::ofstream(metrics, std::ios::trunc) << whole[0].dump() << "\nnot json\n";
    Trainer<Mlp> third(devices::cpu(1), sgd);
    third.load(dir.file("c3.safetensors"));
    REQUIRE_THROWS_WITH(third.fit(train, fit, callbacks::Metrics({.path = metrics, .append = true})),
                        Catch::Contains("callbacks::Metrics: line 2 of '" + metrics +
                                        "' is not a metrics line") &&
                            Catch::Contains("'not json'"));
  }
}

TEST_CASE("batch size: the largest batch that fits a memory budget, from the memory plan") {
  const std::size_t one = training_bytes<Regularised, SGD>(1);
  REQUIRE(largest_batch<Regularised, SGD>(one - 1) == 0);
  REQUIRE(largest_batch<Regularised, SGD>(one) == 1);
  constexpr std::size_t budget = 8u << 20;
  constexpr std::size_t batch = largest_batch<Regularised, AdamW>(budget);  // at compile time
  static_assert(batch > 100);
  REQUIRE(training_bytes<Regularised, AdamW>(batch) <= budget);
  REQUIRE(training_bytes<Regularised, AdamW>(batch + 1) > budget);
  // AdamW keeps two moments, SGD one velocity; bf16 adds the rounded
  // weights and room for a layer's gradient sums (counted as all of them).
  REQUIRE(training_bytes<Regularised, AdamW>(batch) -
              training_bytes<Regularised, SGD>(batch) ==
          4 * Regularised::parameter_count);
  REQUIRE(training_bytes<Regularised, SGD>(batch, Precision::bf16) -
              training_bytes<Regularised, SGD>(batch) ==
          8 * Regularised::parameter_count);
  // The activations counted are what a model reserves.
  Model<Regularised, float> model(0, batch);
  REQUIRE(model.arena_elements() == Model<Regularised, float>::activation_elements(batch));
  // This machine's memory, as a CPU device sees it.
  REQUIRE(devices::memory_available(devices::cpu(1).front()) > (std::size_t{64} << 20));
}

TEST_CASE("hardware: Prescott-class OpenBLAS kernels are replaced by the best the CPU's flags allow") {
  const std::string avx512 = "fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl";
  // Intel's 5th-generation Xeon, which Debian 12's OpenBLAS runs on Prescott's kernels.
  CHECK(cpu::better_blas_kernels("Prescott", avx512 + " avx512_bf16 avx512_fp16") == "Cooperlake");
  CHECK(cpu::better_blas_kernels("Prescott", avx512) == "SkylakeX");
  CHECK(cpu::better_blas_kernels("Sandybridge", "sse2 avx avx2 fma") == "Haswell");
  // Every flag is needed, and whole names only ("avx2" is not "avx512f"'s prefix).
  CHECK(cpu::better_blas_kernels("Prescott", "sse2 avx avx2").empty());
  CHECK(cpu::better_blas_kernels("Prescott", "sse2 avx avx2x fma").empty());
  CHECK(cpu::better_blas_kernels("Prescott", "avx512f avx512bw avx2 fma") == "Haswell");
  // OpenBLAS's own modern choice stays, whatever the flags.
  CHECK(cpu::better_blas_kernels("Haswell", avx512).empty());
  CHECK(cpu::better_blas_kernels("Cooperlake", avx512 + " avx512_bf16").empty());
  CHECK(cpu::better_blas_kernels("Zen", "avx2 fma").empty());
  // This process's OpenBLAS names its kernels.
  CHECK_FALSE(cpu::blas_kernels().empty());
  CHECK(cpu::blas_kernels() != "unknown");
  if (const char* replaced = std::getenv("LOOM_OPENBLAS_REPLACED")) {
    // scripts/lib.sh replaced OpenBLAS's choice (scripts/test on such a
    // CPU): by this table's, and OpenBLAS runs it.
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    REQUIRE(coretype != nullptr);
    CHECK(cpu::better_blas_kernels(replaced, cpu::cpu_flags()) == coretype);
    CHECK(cpu::blas_kernels() == coretype);
    CHECK(cpu::blas_kernels_note().empty());
  } else if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    const auto better = cpu::better_blas_kernels(cpu::blas_kernels(), cpu::cpu_flags());
    if (better.empty())
      CHECK(cpu::blas_kernels_note().empty());
    else
      CHECK_THAT(cpu::blas_kernels_note(), Catch::Contains("OPENBLAS_CORETYPE=" + better));
  }
}
