// What the training features cost on the CPU backend, JSON lines:
//   optimizer_step   one update of the flat buffer: AdamW (one fused pass)
//                    and SGD with momentum, for LeNet's 431,080 parameters
//                    and 11.2 M (ResNet-18's count); benchmarks/adamw_vs_pytorch
//                    runs PyTorch's AdamW on the same counts beside it
//   precision_step   a LeNet and deep-MLP training step in fp32, bf16 and
//                    fp16: on the CPU the reduced precisions are emulated
//                    (rounding after each layer), so this measures that
//                    emulation's cost, not a speed-up
//   checkpoint       writing and reading LeNet's checkpoint (safetensors)
//   nonfinite_check  what a healthy LeNet step pays for the detection of
//                    NaN/Inf gradients (one scan of the gradient buffer),
//                    against the step itself
#include <filesystem>
#include <iostream>
#include <unistd.h>

#include "lenet_bench.hpp"

using namespace loom;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<1024>, ReLU, Linear<1024>, ReLU,
                       Linear<1024>, ReLU, Linear<10>>;

template <class Optimizer>
nlohmann::json optimizer_step(const char* name, typename Optimizer::Options options,
                              std::size_t parameters, const bench::Options& bench) {
  std::vector<float> weights(parameters, 0.01f), grads(parameters, 0.001f);
  typename Optimizer::template State<float> state(options, parameters);
  const double ms = bench::median_step_ms(bench, [&](std::size_t) { state.step(weights, grads); });
  // Bytes each update reads and writes: weights, gradients and the state buffers.
  const double bytes = static_cast<double>(parameters) * sizeof(float) *
                       static_cast<double>(3 + 2 * state.buffer_count());
  return {{"benchmark", "optimizer_step"}, {"library", "loom"}, {"optimizer", name},
          {"parameters", parameters},     {"threads", 1},      {"ms", ms},
          {"gb_per_s", bytes / ms / 1e6}};
}

template <class Net>
nlohmann::json precision_step(const char* network, const data::Dataset& train, std::size_t batch,
                              const bench::Options& options) {
  const double fp32 = bench::train_step_ms<Net>(train, batch, options, Precision::fp32);
  const double bf16 = bench::train_step_ms<Net>(train, batch, options, Precision::bf16);
  const double fp16 = bench::train_step_ms<Net>(train, batch, options, Precision::fp16);
  const auto images = static_cast<double>(batch);
  return {{"benchmark", "precision_step"},
          {"network", network},
          {"backend", "cpu (bf16/fp16 emulated)"},
          {"threads", options.threads},
          {"batch", batch},
          {"fp32_images_per_s", 1000.0 * images / fp32},
          {"bf16_images_per_s", 1000.0 * images / bf16},
          {"fp16_images_per_s", 1000.0 * images / fp16},
          {"bf16_over_fp32", fp32 / bf16}};
}

nlohmann::json checkpoint(const bench::Options& options) {
  const auto folder = std::filesystem::temp_directory_path() /
                      ("loom-bench-checkpoint-" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const std::string path = (folder / "lenet.safetensors").string();
  Trainer<bench::LeNet> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  const double save_ms = bench::median_step_ms(options, [&](std::size_t) { trainer.save(path); });
  const double load_ms = bench::median_step_ms(options, [&](std::size_t) { trainer.load(path); });
  const auto bytes = std::filesystem::file_size(path);
  std::filesystem::remove_all(folder);
  return {{"benchmark", "checkpoint"}, {"network", "lenet"}, {"bytes", bytes},
          {"save_ms", save_ms},         {"load_ms", load_ms}};
}

nlohmann::json nonfinite_check(const data::Dataset& train, std::size_t batch,
                               const bench::Options& options) {
  const double step_ms = bench::train_step_ms<bench::LeNet>(train, batch, options);
  Model<bench::LeNet, float> model(0, batch);
  bool finite = true;
  const double scan_ms = bench::median_step_ms(
      options, [&](std::size_t) { finite = model.gradients_finite() && finite; });
  LOOM_CHECK(finite, "nonfinite_check: a fresh model's gradients are not finite");
  return {{"benchmark", "nonfinite_check"}, {"network", "lenet"}, {"batch", batch},
          {"threads", options.threads},       {"step_ms", step_ms}, {"scan_ms", scan_ms},
          {"scan_over_step", scan_ms / step_ms}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Optimizer update, precision and checkpoint costs of loom on the CPU (JSON lines)"};
  bench::Options options;
  options.batches = {64};
  options.steps = 20;
  options.warmup = 2;
  std::vector<std::size_t> parameters{431080, 11200000};
  bench::add_options(app, options);
  app.add_option("--parameters", parameters, "parameter counts of the optimizer benchmark")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    for (const std::size_t n : parameters) {
      std::cout << optimizer_step<AdamW>("adamw", {.lr = 1e-3f}, n, options).dump() << std::endl;
      std::cout << optimizer_step<SGD>("sgd_momentum", {.lr = 0.01f, .momentum = 0.9f}, n, options)
                       .dump()
                << std::endl;
    }
    const auto train = data::fashion_mnist(options.data_dir).train;
    cpu::set_threads(options.threads);
    for (const std::size_t batch : options.batches) {
      bench::check_batch(batch, train.count);
      std::cout << precision_step<bench::LeNet>("lenet", train, batch, options).dump() << std::endl;
      std::cout << precision_step<Mlp>("mlp_3x1024", train, batch, options).dump() << std::endl;
      std::cout << nonfinite_check(train, batch, options).dump() << std::endl;
    }
    std::cout << checkpoint(options).dump() << std::endl;
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
