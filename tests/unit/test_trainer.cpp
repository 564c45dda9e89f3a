// Trainer: training on real data lowers the loss, is reproducible from its
// seeds, reports progress, and turns misuse into clear errors.
#include <cmath>
#include <limits>
#include <loom/loom.hpp>
#include <sstream>

#include "fashion_test.hpp"
#include "loom_test.hpp"

using namespace loom;
using loom::test::fashion;
using loom::test::head;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;
using SmallCnn =
    Sequential<Input<1, 28, 28>, Conv2d<8, 5>, ReLU, MaxPool2d<2>, Flatten, Linear<10>>;

}  // namespace

TEST_CASE("trainer: a small CNN learns Fashion-MNIST and evaluate() measures it") {
  const auto train = head(fashion().train, 6000);
  const auto test = head(fashion().test, 2000);
  Trainer<SmallCnn> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  const EvalResult before = trainer.evaluate(test);
  REQUIRE(before.samples == 2000);
  REQUIRE(before.accuracy < 0.3);  // untrained: near chance (0.1)
  std::ostringstream log;
  callbacks::Evaluate evaluate(test, &log);
  trainer.fit(train, {.epochs = 2, .batch_size = 50}, evaluate);
  REQUIRE(evaluate.history.size() == 2);
  REQUIRE(evaluate.last.loss < before.loss / 2);
  REQUIRE(evaluate.last.accuracy > 0.75);
  const EvalResult again = trainer.evaluate(test, 333);  // batch size does not matter
  REQUIRE(again.accuracy == evaluate.last.accuracy);
  REQUIRE(again.loss == Approx(evaluate.last.loss).epsilon(1e-6));
  REQUIRE(log.str().find("epoch 2/2 fashion-mnist") != std::string::npos);
}

TEST_CASE("trainer: the same seeds give the same weights, another data seed does not") {
  const auto train = head(fashion().train, 1000);
  auto run = [&](std::uint64_t data_seed) {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, {.seed = 5});
    trainer.fit(train, {.epochs = 1, .batch_size = 64, .seed = data_seed});
    const auto p = trainer.model().parameters();
    return std::vector<float>(p.begin(), p.end());
  };
  const auto a = run(1);
  test::require_equal(run(1), a, "weights after identical runs");
  REQUIRE(run(2) != a);
}

TEST_CASE("trainer: MultiStepLR lowers the learning rate after its milestone epochs") {
  const auto train = head(fashion().train, 128);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.08f});
  trainer.fit(train, {.epochs = 4, .batch_size = 64},
              callbacks::MultiStepLR{.milestones = {1, 3}, .factor = 0.5f, .out = &out});
  REQUIRE(trainer.optimizer().options().lr == 0.02f);
  REQUIRE(out.str() == "learning rate 0.04 from epoch 2\nlearning rate 0.02 from epoch 4\n");
  REQUIRE_THROWS_WITH(trainer.optimizer().set_lr(-0.5f),
                      Catch::Contains("learning rate must be >= 0"));
}

TEST_CASE("trainer: the progress callback prints plain lines off a terminal") {
  const auto train = head(fashion().train, 640);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  trainer.fit(train, {.epochs = 2, .batch_size = 64},
              callbacks::Progress({.out = &out, .lines_per_epoch = 5}));
  const std::string text = out.str();
  REQUIRE(text.find("training: 640 samples, 2 epoch(s) of 10 steps, batch 64") !=
          std::string::npos);
  REQUIRE(text.find("epoch 1/2 step 2/10 loss ") != std::string::npos);
  REQUIRE(text.find("epoch 2/2 step 10/10 loss ") != std::string::npos);
  REQUIRE(text.find("samples/s ETA 0:00") != std::string::npos);
  REQUIRE(text.find("epoch 2/2 done: loss ") != std::string::npos);
  REQUIRE(text.find('\r') == std::string::npos);
  // 5 lines per epoch + a summary each + the header.
  REQUIRE(std::count(text.begin(), text.end(), '\n') == 2 * 6 + 1);
}

TEST_CASE("trainer: the progress bar is redrawn in place") {
  const auto train = head(fashion().train, 640);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  trainer.fit(train, {.epochs = 1, .batch_size = 64},
              callbacks::Progress(
                  {.out = &out, .style = callbacks::Progress::Style::bar, .bar_width = 10}));
  const std::string text = out.str();
  // The last redraw of the epoch: a full bar, erased to the end of the line,
  // then a newline so the summary starts on its own line.
  REQUIRE(text.find("\repoch 1/1 [==========] step 10/10 loss ") != std::string::npos);
  REQUIRE(text.find("\x1b[K\nepoch 1/1 done: loss ") != std::string::npos);
}

TEST_CASE("trainer: devices") {
  const auto all = devices::all();
  REQUIRE(all.size() == 1);
  REQUIRE(all[0].kind == Device::Kind::cpu);
  REQUIRE(all[0].threads == devices::hardware_threads());
  const auto workers = devices::cpu(2);
  REQUIRE(workers.size() == 2);
  REQUIRE(workers[1].name() == "cpu:1");
  REQUIRE(workers[0].threads == std::max(1, devices::hardware_threads() / 2));
  REQUIRE_THROWS_WITH(devices::cpu(0), Catch::Contains("need at least one device"));
}

TEST_CASE("trainer: misuse is a clear loom::Error") {
  SECTION("device count") {
    REQUIRE_THROWS_WITH((Trainer<Mlp>(devices::cpu(2), {})),
                        Catch::Contains("SingleDevice runs on 1 device(s) but 2 were given"));
  }
  SECTION("a GPU in a program the host compiler built (it has no CUDA executor)") {
    const Device gpu{.kind = Device::Kind::cuda, .index = 0};
    REQUIRE_THROWS_WITH((Trainer<Mlp>({gpu}, {})),
                        Catch::StartsWith("loom: device cuda:0 needs the CUDA backend: compile "
                                          "with nvcc, including <loom/loom.hpp>, or register "
                                          "this trainer from a CUDA translation unit "
                                          "(loom::gpu::register_trainers), to use GPUs ["));
    REQUIRE_THROWS_WITH((Trainer<Mlp, ModelSplit<Balanced<2>>>({gpu, gpu}, {})),
                        Catch::Contains("device cuda:0 needs the CUDA backend"));
  }
  SECTION("dataset shape") {
    using Wrong = Sequential<Input<1, 32, 32>, Flatten, Linear<10>>;
    Trainer<Wrong> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(
        trainer.fit(head(fashion().train, 10), {}),
        Catch::Contains("has samples of 1x28x28 = 784 values but the network's Input holds 1024"));
  }
  SECTION("more classes than outputs") {
    using Five = Sequential<Input<1, 28, 28>, Flatten, Linear<5>>;
    Trainer<Five> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.evaluate(head(fashion().test, 10)),
                        Catch::Contains("has 10 classes but the network outputs 5 scores"));
  }
  SECTION("a NaN loss stops training with the epoch and step") {
    auto bad = head(fashion().train, 256);
    bad.images[3 * bad.sample_size() + 100] = std::numeric_limits<float>::quiet_NaN();
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
    const auto p = trainer.model().parameters();
    const std::vector<float> initial(p.begin(), p.end());
    REQUIRE_THROWS_WITH(trainer.fit(bad, {.epochs = 1, .batch_size = 64, .shuffle = false}),
                        Catch::Contains("the training loss became nan at epoch 1, step 1"));
    // The failed step did not touch the weights.
    test::require_equal(trainer.model().parameters(), initial, "weights after the NaN step");
  }
  SECTION("an empty dataset") {
    Trainer<Mlp> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.evaluate(head(fashion().test, 0)), Catch::Contains("is empty"));
  }
  SECTION("bad fit options") {
    Trainer<Mlp> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.epochs = 0}),
                        Catch::Contains("epochs must be >= 1"));
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.batch_size = 0}),
                        Catch::Contains("fit: batch size must be >= 1"));
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.accumulation_steps = 0}),
                        Catch::Contains("fit: accumulation_steps must be >= 1"));
    for (const float norm : {-1.0f, std::numeric_limits<float>::quiet_NaN()})
      REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.max_grad_norm = norm}),
                          Catch::Contains("fit: max_grad_norm must be a finite number >= 0 (0: "
                                          "no clipping), got "));
  }
}
