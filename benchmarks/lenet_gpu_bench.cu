// LeNet training throughput on one GPU (loom's DeviceModel): whole training
// steps on real Fashion-MNIST batches already in GPU memory, FP32 without
// TF32, timed with CUDA events after warm-up; the median of many steps. One
// JSON line per batch size, in the format of lenet_throughput and
// benchmarks/pytorch/lenet.py, so scripts/gpu-check can set them side by side.
//
// Each step still waits for its loss on the host (softmax_xent copies the
// sums back); the CUDA-graph step without that wait is the next step.
#include <algorithm>
#include <iostream>
#include <loom/backend/cuda/model.cuh>
#include <loom/backend/cuda/stream.hpp>
#include <vector>

#include "lenet_bench.hpp"

namespace {

nlohmann::json measure(const loom::data::Dataset& train, std::size_t batch,
                       const loom::bench::Options& options) {
  loom::bench::check_batch(batch, train.count);
  const std::size_t batches = std::min<std::size_t>(train.count / batch, 64);
  const std::size_t sample = train.sample_size();
  loom::cuda::DeviceBuffer<float> images(batches * batch * sample, "benchmark images");
  loom::cuda::DeviceBuffer<std::int32_t> labels(batches * batch, "benchmark labels");
  LOOM_CUDA_CHECK(cudaMemcpy(images.data(), train.images.data(), images.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  LOOM_CUDA_CHECK(cudaMemcpy(labels.data(), train.labels.data(),
                             labels.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  loom::Model<loom::bench::LeNet, float> initial(0);
  loom::cuda::DeviceModel<loom::bench::LeNet> model(initial, batch,
                                                    {.lr = 0.01f, .momentum = 0.9f});

  cudaEvent_t start, stop;
  LOOM_CUDA_CHECK(cudaEventCreate(&start));
  LOOM_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> step_ms;
  for (int s = 0; s < options.warmup + options.steps; ++s) {
    const std::size_t first = static_cast<std::size_t>(s) % batches * batch;
    LOOM_CUDA_CHECK(cudaEventRecord(start, model.stream()));
    model.train_step(images.data() + first * sample, labels.data() + first);
    LOOM_CUDA_CHECK(cudaEventRecord(stop, model.stream()));
    LOOM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (s >= options.warmup) step_ms.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(step_ms.begin(), step_ms.end());
  const double median = step_ms[step_ms.size() / 2];
  const auto n = static_cast<double>(batch);
  return {{"benchmark", "lenet_train_step"},
          {"library", "loom"},
          {"backend", "cuda"},
          {"batch", batch},
          {"steps", options.steps},
          {"median_step_ms", median},
          {"images_per_s", 1000.0 * n / median},
          {"gflop_per_s", n * loom::bench::flops_per_sample() / median / 1e6}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LeNet training throughput of loom on one GPU (JSON lines)"};
  loom::bench::Options options;
  options.batches = {64, 256, 1024};
  options.steps = 200;
  options.warmup = 20;
  loom::bench::add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    const auto train = loom::data::fashion_mnist(options.data_dir).train;
    for (const std::size_t batch : options.batches)
      std::cout << measure(train, batch, options).dump() << std::endl;
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
