// LeNet training throughput on the CPU backend: images per second for whole
// training steps (forward, loss, backward, SGD update) on real Fashion-MNIST
// batches. Prints one JSON line per batch size.
#include <loom/loom.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <vector>

using namespace loom;

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

namespace {

nlohmann::json measure(const data::Dataset& train, std::size_t batch, int warmup, int steps,
                       int threads) {
  Model<LeNet, float> model(0, batch);
  SGD::State<float> sgd({.lr = 0.01f, .momentum = 0.9f}, LeNet::parameter_count);
  cpu::set_threads(threads);
  std::vector<double> step_ms;
  const std::size_t batches = train.count / batch;
  for (int s = 0; s < warmup + steps; ++s) {
    // Consecutive real batches, never the same memory twice in a row.
    const std::size_t first = (static_cast<std::size_t>(s) % batches) * batch;
    const auto start = std::chrono::steady_clock::now();
    const float* logits = model.forward(train.images.data() + first * train.sample_size(), batch);
    SoftmaxCrossEntropy::evaluate<float>(logits, train.labels.data() + first, batch, 10, batch,
                                         model.output_gradient());
    model.backward();
    sgd.step(model.parameters(), model.gradients());
    const auto stop = std::chrono::steady_clock::now();
    if (s >= warmup) step_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  std::sort(step_ms.begin(), step_ms.end());
  const double median = step_ms[step_ms.size() / 2];
  const double flops = static_cast<double>(batch) *
                       [] {
                         double total = 0;
                         for (std::size_t i = 0; i < LeNet::layer_count; ++i)
                           total += static_cast<double>(LeNet::forward_flops[i] + LeNet::backward_flops[i]);
                         return total;
                       }();
  return {{"benchmark", "lenet_train_step"}, {"library", "loom"}, {"backend", "cpu"},
          {"threads", threads}, {"batch", batch}, {"steps", steps},
          {"median_step_ms", median}, {"images_per_s", 1000.0 * static_cast<double>(batch) / median},
          {"gflop_per_s", flops / median / 1e6}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LeNet training throughput on the CPU (JSON lines)"};
  std::vector<std::size_t> batches{64, 256};
  int steps = 60;
  int warmup = 5;
  int threads = devices::hardware_threads();
  std::string data_dir = data::default_fashion_mnist_dir;
  app.add_option("--batch", batches, "batch sizes")->capture_default_str();
  app.add_option("--steps", steps, "timed steps per batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--threads", threads, "BLAS threads")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--data", data_dir, "Fashion-MNIST folder")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto data = data::fashion_mnist(data_dir);
    for (const std::size_t batch : batches)
      std::cout << measure(data.train, batch, warmup, steps, threads).dump() << std::endl;
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
