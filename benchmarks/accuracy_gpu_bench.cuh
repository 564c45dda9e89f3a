// What the time-to-accuracy GPU benchmarks share (lenet_accuracy_gpu_bench,
// gru_accuracy_gpu_bench): the recipe and its command line, the epoch loop
// and the JSON line. A network is trained on Fashion-MNIST by loom's
// Trainer on one GPU, epoch by epoch, the test set measured after each; the
// time counted is the training alone (set-up, graph capture and every
// epoch's data shuffling included; the evaluations not). SGD with momentum
// 0.9, the learning rate 10x lower after each milestone epoch; FP32 without
// TF32.
//
// One JSON line: "metric":"train_seconds_to_accuracy" with "value" in
// seconds, and the accuracy after each epoch. Exits 1 (and says so in the
// line) when the target is not reached within the epochs.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpu_bench.cuh"

namespace loom::bench {

struct AccuracyRecipe {
  std::size_t batch = 64;
  float lr = 0.01f;
  float weight_decay = 0.0f;
  std::vector<int> milestones;  // epochs after which the learning rate drops 10x
  int epochs = 15;              // given up after
  double target = 0.91;
  std::uint64_t seed = 0;
  std::string data_dir = data::default_fashion_mnist_dir;
};

inline void add_accuracy_options(CLI::App& app, AccuracyRecipe& recipe) {
  app.add_option("--data", recipe.data_dir, "Fashion-MNIST folder")->capture_default_str();
  app.add_option("--target", recipe.target, "test accuracy to reach, in [0, 1]")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--epochs", recipe.epochs, "give up after this many epochs")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--batch-size", recipe.batch, "samples per step")
      ->check(CLI::Range(std::size_t{1}, std::size_t{60000}))
      ->capture_default_str();
  app.add_option("--lr", recipe.lr, "SGD learning rate")->capture_default_str();
  app.add_option("--seed", recipe.seed, "seed for weights and data order")->capture_default_str();
}

// Trains Net to the recipe's target and prints the line named `benchmark`;
// returns the program's exit status.
template <class Net>
int time_to_accuracy(const std::string& program, const std::string& benchmark,
                     const AccuracyRecipe& recipe) {
  try {
    const auto data = data::fashion_mnist(recipe.data_dir);
    const auto gpus = devices::gpus();
    LOOM_CHECK(!gpus.empty(), program, ": no GPU found");
    using Clock = std::chrono::steady_clock;
    double train_seconds = 0.0;
    auto started = Clock::now();
    Trainer<Net> trainer({gpus.front()},
                         {.lr = recipe.lr, .momentum = 0.9f, .weight_decay = recipe.weight_decay},
                         {.seed = recipe.seed});
    train_seconds += std::chrono::duration<double>(Clock::now() - started).count();
    nlohmann::json accuracies = nlohmann::json::array();
    int reached_at = 0;
    float lr = recipe.lr;
    for (int epoch = 1; epoch <= recipe.epochs && reached_at == 0; ++epoch) {
      for (const int milestone : recipe.milestones)
        if (epoch == milestone + 1) lr *= 0.1f;
      trainer.optimizer().set_lr(lr);
      started = Clock::now();
      // One epoch per call; the seed moves on so each epoch has its own order.
      trainer.fit(data.train, {.epochs = 1,
                               .batch_size = recipe.batch,
                               .seed = recipe.seed + static_cast<std::uint64_t>(epoch)});
      train_seconds += std::chrono::duration<double>(Clock::now() - started).count();
      const double accuracy = trainer.evaluate(data.test).accuracy;
      accuracies.push_back(accuracy);
      if (accuracy >= recipe.target) reached_at = epoch;
    }
    const nlohmann::json line{{"benchmark", benchmark},
                              {"library", "loom"},
                              {"batch", recipe.batch},
                              {"metric", "train_seconds_to_accuracy"},
                              {"value", reached_at ? nlohmann::json(train_seconds) : nullptr},
                              {"higher_is_better", false},
                              {"target_accuracy", recipe.target},
                              {"reached", reached_at != 0},
                              {"epochs", accuracies.size()},
                              {"train_seconds", train_seconds},
                              {"epoch_accuracies", accuracies},
                              {"precision", "fp32"},
                              {"data", "fashion-mnist"},
                              {"device", gpu_name()}};
    std::cout << line.dump() << std::endl;
    if (!reached_at) {
      std::cerr << program << ": test accuracy " << recipe.target << " not reached in "
                << recipe.epochs << " epochs\n";
      return 1;
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}

}  // namespace loom::bench
