// Training-step throughput of the ResNet and sequence examples' networks on
// the CPU backend (ResNet-20 and the row-sequence GRU, real Fashion-MNIST
// batches), each fused (BatchNorm+ReLU, Conv+ReLU and Linear+ReLU in one
// pass) against the same network unfused, in the same run. JSON lines.
// --network row_gru times the GRU alone: benchmarks/gru_vs_pytorch puts it
// beside PyTorch's same network (benchmarks/pytorch/gru.py).
#include <algorithm>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "lenet_bench.hpp"

using namespace loom;

namespace {

template <std::size_t Channels, std::size_t Stride = 1>
using Block = Residual<Conv2d<Channels, 3, Stride, 1>, BatchNorm2d, ReLU,
                       Conv2d<Channels, 3, 1, 1>, BatchNorm2d>;
using ResNet20 = Sequential<Input<1, 28, 28>, Conv2d<16, 3, 1, 1>, BatchNorm2d, ReLU,  //
                            Block<16>, ReLU, Block<16>, ReLU, Block<16>, ReLU,
                            Block<32, 2>, ReLU, Block<32>, ReLU, Block<32>, ReLU,
                            Block<64, 2>, ReLU, Block<64>, ReLU, Block<64>, ReLU,  //
                            GlobalAvgPool, Linear<10>>;
using RowGru = Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<128>, Linear<64>, ReLU, Linear<10>>;

template <class Net>
nlohmann::json compare(const char* network, const data::Dataset& train, std::size_t batch,
                       const bench::Options& options) {
  const double fused = bench::train_step_ms<Net>(train, batch, options);
  const double unfused = bench::train_step_ms<Unfused<Net>>(train, batch, options);
  const auto images = static_cast<double>(batch);
  return {{"benchmark", "deep_train_step"},
          {"library", "loom"},
          {"network", network},
          {"backend", "cpu"},
          {"threads", options.threads},
          {"batch", batch},
          {"steps", options.steps},
          {"parameters", Net::parameter_count},
          {"fused_median_step_ms", fused},
          {"fused_images_per_s", 1000.0 * images / fused},
          {"unfused_images_per_s", 1000.0 * images / unfused},
          {"fused_speedup", unfused / fused}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ResNet-20 and row-GRU training throughput of loom on the CPU (JSON lines)"};
  bench::Options options;
  options.batches = {128};
  options.steps = 20;
  options.warmup = 2;
  bench::add_options(app, options);
  std::vector<std::string> networks{"resnet20", "row_gru"};
  app.add_option("--network", networks, "networks to time")
      ->check(CLI::IsMember({"resnet20", "row_gru"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const auto timed = [&](std::string_view network) {
    return std::find(networks.begin(), networks.end(), network) != networks.end();
  };
  try {
    const auto train = data::fashion_mnist(options.data_dir).train;
    cpu::set_threads(options.threads);
    for (const std::size_t batch : options.batches) {
      bench::check_batch(batch, train.count);
      if (timed("resnet20"))
        std::cout << compare<ResNet20>("resnet20", train, batch, options).dump() << std::endl;
      if (timed("row_gru"))
        std::cout << compare<RowGru>("row_gru", train, batch, options).dump() << std::endl;
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
