// What lenet_throughput (loom) and peers/dlib_lenet share, so that both
// measure the same thing: the network's size and FLOPs, the command line,
// and how a training step is timed and reported (one JSON line).
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom::bench {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

struct Options {
  std::vector<std::size_t> batches{64, 256};
  int steps = 60;
  int warmup = 5;
  int threads = devices::hardware_threads();
  std::string data_dir = data::default_fashion_mnist_dir;
};

inline void add_options(CLI::App& app, Options& options) {
  app.add_option("--batch", options.batches, "batch sizes")->capture_default_str();
  app.add_option("--steps", options.steps, "timed steps per batch size")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed steps first")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--threads", options.threads, "BLAS threads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--data", options.data_dir, "Fashion-MNIST folder")->capture_default_str();
}

inline void check_batch(std::size_t batch, std::size_t samples) {
  LOOM_CHECK(batch >= 1 && batch <= samples, "--batch ", batch, " must be between 1 and the ",
             samples, " training samples");
}

// Forward + backward FLOPs of one sample, from loom's compile-time counts:
// the same measure of work for every library.
inline double flops_per_sample() {
  double total = 0;
  for (std::size_t i = 0; i < LeNet::layer_count; ++i)
    total += static_cast<double>(LeNet::forward_flops[i] + LeNet::backward_flops[i]);
  return total;
}

// Calls step(s) for s = 0 .. warmup + steps - 1, times each call, and
// returns the median of the timed ones, in milliseconds.
template <class Step>
double median_step_ms(const Options& options, Step&& step) {
  std::vector<double> step_ms;
  for (int s = 0; s < options.warmup + options.steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    step(static_cast<std::size_t>(s));
    const auto stop = std::chrono::steady_clock::now();
    if (s >= options.warmup)
      step_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  std::sort(step_ms.begin(), step_ms.end());
  return step_ms[step_ms.size() / 2];
}

// Median time of a training step of Net (forward in training mode, loss,
// backward, SGD with momentum) on real batches, computing in `precision`.
template <class Net>
double train_step_ms(const data::Dataset& train, std::size_t batch, const Options& options,
                     Precision precision = Precision::fp32) {
  Model<Net, float> model(0, batch);
  model.set_precision(precision);
  SGD::State<float> sgd({.lr = 0.01f, .momentum = 0.9f}, Net::parameter_count);
  const std::size_t batches = train.count / batch;
  return median_step_ms(options, [&](std::size_t s) {
    const std::size_t first = (s % batches) * batch;
    const float* logits = model.forward(train.images.data() + first * train.sample_size(), batch,
                                        0, Pass{.training = true, .step = s});
    SoftmaxCrossEntropy::evaluate<float>(logits, train.labels.data() + first, batch,
                                         Net::output_shape::size, batch, model.output_gradient());
    model.backward();
    sgd.step(model.parameters(), model.gradients());
  });
}

// LeNet's training step: median time, images/s and GFLOP/s.
template <class Step>
nlohmann::json time_steps(const char* library, std::size_t batch, const Options& options,
                          Step&& step) {
  const double median = median_step_ms(options, step);
  const auto images = static_cast<double>(batch);
  return {{"benchmark", "lenet_train_step"},
          {"library", library},
          {"backend", "cpu"},
          {"threads", options.threads},
          {"batch", batch},
          {"steps", options.steps},
          {"median_step_ms", median},
          {"images_per_s", 1000.0 * images / median},
          {"gflop_per_s", images * flops_per_sample() / median / 1e6}};
}

}  // namespace loom::bench
