// LeNet training throughput on one GPU: whole training steps as the
// Trainer's SingleDevice runs them (the grid engine over one GPU stage: its
// forward and backward replayed from CUDA graphs, the softmax loss on the
// device, the host waiting at each stage call), on real Fashion-MNIST
// batches (consecutive batches over the whole training set, as the PyTorch
// peer takes them), FP32 without TF32. Each step copies its batch from
// host memory (through pinned memory; ~3 MB at batch 1024), counted in the
// time, where the PyTorch peer's batches already lie in GPU memory. One
// JSON line per batch size in the format of benchmarks/pytorch/lenet.py, so
// scripts/gpu-check sets them side by side.
// With --precision bf16 (or fp16) the same steps in bf16 (fp16, its loss
// scaled by a fixed 1024; tensor cores, fp32 master weights) make
// "lenet_train_step_bf16" ("_fp16") lines, paired in the same run with the
// fp32 step ("library":"loom-fp32") and PyTorch's autocast peer.
//
// Then DataParallel on the GPUs: one epoch through the Trainer (batches
// staged from host memory) with DataParallel<> on GPU 0 (one NCCL rank: the
// policy's cost; more GPUs take one process each, under mpirun) against
// SingleDevice, as "lenet_fit_epoch" lines ("library":"loom" is DataParallel,
// "loom-single-device" its peer), ModelSplit<Balanced<2>, OneFOneB<4>>
// with both stages on GPU 0, each on its own streams ("loom-model-split"),
// and Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>, its 4 ranks on GPU 0
// ("loom-hybrid": the cost of the grid and of summing the stage copies).
// With --precision bf16 (fp16), that ModelSplit's epoch in bf16 (fp16) makes
// "lenet_split_epoch_bf16" ("_fp16") lines, paired with its fp32 epoch
// ("library":"loom-fp32").
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "gpu_bench.cuh"
#include "lenet_bench.hpp"

namespace {

nlohmann::json measure(const loom::data::Dataset& train, std::size_t batch,
                       const loom::bench::Options& options, loom::Precision precision) {
  loom::bench::check_batch(batch, train.count);
  const std::size_t batches = train.count / batch;
  const std::size_t sample = train.sample_size();
  loom::bench::EngineSteps<loom::bench::LeNet> steps({.lr = 0.01f, .momentum = 0.9f},
                                                     {.precision = precision});
  const auto times = loom::bench::time_host_steps(options.warmup, options.steps, [&](int s) {
    const std::size_t first = static_cast<std::size_t>(s) % batches * batch;
    steps.step(train.images.data() + first * sample, train.labels.data() + first, batch);
  });
  const auto n = static_cast<double>(batch);
  const bool fp32 = precision == loom::Precision::fp32;
  return {{"benchmark", fp32 ? std::string("lenet_train_step")
                             : "lenet_train_step_" + std::string(loom::precision_name(precision))},
          {"library", "loom"},
          {"backend", "cuda"},
          {"batch", batch},
          {"steps", options.steps},
          {"median_step_ms", times.median_ms},
          {"mean_step_ms", times.mean_ms},
          {"images_per_s", 1000.0 * n / times.median_ms},
          {"gflop_per_s", n * loom::bench::flops_per_sample() / times.median_ms / 1e6},
          {"graphs", steps.graphs()},
          {"input", "host memory"},
          {"data", "fashion-mnist"},
          {"device", loom::bench::gpu_name()},
          {"precision", std::string(loom::precision_name(precision))}};
}

template <class Policy>
nlohmann::json fit_epoch(const loom::data::Dataset& train, std::size_t batch, const char* library,
                         loom::Precision precision = loom::Precision::fp32) {
  // One GPU for each device the policy takes (ModelSplit, Hybrid: a rank each).
  const std::vector<loom::Device> gpu(std::max<std::size_t>(Policy::devices_needed, 1),
                                      loom::devices::gpus().front());
  loom::Trainer<loom::bench::LeNet, Policy> trainer(gpu, {.lr = 0.01f, .momentum = 0.9f},
                                                    {.precision = precision});
  // A first epoch warms up (plans, cuDNN and NCCL set up); the second is timed.
  trainer.fit(train, {.epochs = 1, .batch_size = batch});
  double seconds = 0.0;
  struct Time {
    double* seconds;
    void on_epoch_end(const loom::EpochInfo& e) { *seconds = e.seconds; }
  };
  trainer.fit(train, {.epochs = 1, .batch_size = batch, .seed = 1}, Time{&seconds});
  return {{"benchmark", "lenet_fit_epoch"},
          {"library", library},
          {"policy", Policy::name},
          {"backend", "cuda"},
          {"batch", batch},
          {"epoch_s", seconds},
          {"images_per_s", static_cast<double>(train.count) / seconds},
          {"data", "fashion-mnist"},
          {"device", loom::bench::gpu_name()},
          {"precision", std::string(loom::precision_name(precision))}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LeNet training throughput of loom on one GPU (JSON lines)"};
  loom::bench::Options options;
  options.batches = {64, 256, 1024};
  options.steps = 200;
  options.warmup = 20;
  loom::bench::add_options(app, options);
  std::vector<std::string> precisions{"fp32"};
  app.add_option("--precision", precisions,
                 "fp32, bf16, fp16, any of them (bf16 and fp16 are timed with fp32)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto train = loom::data::fashion_mnist(options.data_dir).train;
    for (const std::size_t batch : options.batches) {
      const auto fp32 = measure(train, batch, options, loom::Precision::fp32);
      std::cout << fp32.dump() << std::endl;
      for (const auto precision : {loom::Precision::bf16, loom::Precision::fp16}) {
        const std::string name(loom::precision_name(precision));
        if (std::ranges::find(precisions, name) == precisions.end()) continue;
        std::cout << measure(train, batch, options, precision).dump() << std::endl;
        auto peer = fp32;
        peer["benchmark"] = "lenet_train_step_" + name;
        peer["library"] = "loom-fp32";
        std::cout << peer.dump() << std::endl;
      }
    }
    for (const std::size_t batch : options.batches) {
      std::cout << fit_epoch<loom::DataParallel<>>(train, batch, "loom").dump() << std::endl;
      std::cout << fit_epoch<loom::SingleDevice>(train, batch, "loom-single-device").dump()
                << std::endl;
      using Split = loom::ModelSplit<loom::Balanced<2>, loom::OneFOneB<4>>;
      const auto split = fit_epoch<Split>(train, batch, "loom-model-split");
      std::cout << split.dump() << std::endl;
      for (const auto precision : {loom::Precision::bf16, loom::Precision::fp16}) {
        const std::string name(loom::precision_name(precision));
        if (std::ranges::find(precisions, name) == precisions.end()) continue;
        auto reduced = fit_epoch<Split>(train, batch, "loom", precision);
        reduced["benchmark"] = "lenet_split_epoch_" + name;
        std::cout << reduced.dump() << std::endl;
        auto peer = split;
        peer["benchmark"] = "lenet_split_epoch_" + name;
        peer["library"] = "loom-fp32";
        std::cout << peer.dump() << std::endl;
      }
      std::cout << fit_epoch<loom::Hybrid<2, loom::ModelSplit<loom::Balanced<2>, loom::OneFOneB<4>>>>(
                       train, batch, "loom-hybrid")
                       .dump()
                << std::endl;
    }
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
