// LeNet training throughput on loom's CPU backend: whole training steps
// (forward, loss, backward, SGD update) on real Fashion-MNIST batches. Prints
// one JSON line per batch size.
#include <iostream>

#include "lenet_bench.hpp"

using namespace loom;
using bench::LeNet;

int main(int argc, char** argv) {
  CLI::App app{"LeNet training throughput of loom on the CPU (JSON lines)"};
  bench::Options options;
  bench::add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    const auto train = data::fashion_mnist(options.data_dir).train;
    cpu::set_threads(options.threads);
    for (const std::size_t batch : options.batches) {
      bench::check_batch(batch, train.count);
      Model<LeNet, float> model(0, batch);
      SGD::State<float> sgd({.lr = 0.01f, .momentum = 0.9f}, LeNet::parameter_count);
      const std::size_t batches = train.count / batch;
      const auto line = bench::time_steps("loom", batch, options, [&](std::size_t s) {
        // Consecutive real batches, never the same memory twice in a row.
        const std::size_t first = (s % batches) * batch;
        const float* logits =
            model.forward(train.images.data() + first * train.sample_size(), batch);
        SoftmaxCrossEntropy::evaluate<float>(logits, train.labels.data() + first, batch, 10, batch,
                                             model.output_gradient());
        model.backward();
        sgd.step(model.parameters(), model.gradients());
      });
      std::cout << line.dump() << std::endl;
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
