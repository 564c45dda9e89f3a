// An MLP of 4 x (Linear 4096 + ReLU) trained at batch 8192 on one GPU, FP32,
// TF32 and bf16 (tensor cores, fp32 master weights): how close loom's whole
// training step (11 GEMMs with their epilogues, the loss, the update), as
// the Trainer's SingleDevice runs it (the grid engine over one GPU stage,
// each batch copied from host memory), comes to the cuBLASLt GEMM peak
// measured in the same run. The peak is the best of the step's three GEMM layouts
// (forward X W^T, weight gradient dZ^T X, input gradient dZ W) timed alone,
// without epilogues, at the step's precision; the step's useful work is the
// 11 GEMMs' 2MNK FLOPs.
//
// Two JSON lines per precision, paired by scripts/gpu-check on
// "benchmark" and "batch": loom's step ("library":"loom") and the peak
// ("library":"cublaslt-peak"), both with images_per_s (for the peak: the
// rate if every step FLOP ran at peak speed), so loom / cublaslt-peak is
// the fraction of peak. The data are normally distributed random numbers: no
// data set has 4096 features (the time does not depend on the values, and
// none is zero). bf16's rows also carry the fp32 step of the same run
// ("library":"loom-fp32"): the speed-up bf16 brings.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <iostream>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench.cuh"

namespace {

constexpr std::size_t width = 4096;
using Mlp = loom::Sequential<loom::Input<width>, loom::Linear<width>, loom::ReLU,
                             loom::Linear<width>, loom::ReLU, loom::Linear<width>, loom::ReLU,
                             loom::Linear<width>, loom::ReLU>;
constexpr std::size_t layers = 4;

struct Options {
  std::size_t batch = 8192;
  int steps = 20;
  int warmup = 3;
  std::vector<std::string> precisions{"fp32", "tf32"};
};

// Forward, weight-gradient and input-gradient GEMMs of every layer but the
// first (which has no input gradient).
double gemm_flops_per_step(std::size_t batch) {
  const double one = 2.0 * static_cast<double>(batch) * width * width;
  return one * static_cast<double>(3 * layers - 1);
}

// The best of the three GEMM layouts of a step, alone, in TFLOP/s.
double gemm_peak_tflops(std::size_t batch, const std::string& precision, const Options& options,
                        loom::gpu::DeviceBuffer<float>& a, loom::gpu::DeviceBuffer<float>& b,
                        loom::gpu::DeviceBuffer<float>& c) {
  using loom::gpu::GemmShape;
  const std::size_t n = batch, w = width;
  const GemmShape shapes[] = {
      {false, true, n, w, w, w, w, w},  // Y = X W^T
      {true, false, w, w, n, w, w, w},  // dW = dZ^T X
      {false, false, n, w, w, w, w, w},  // dX = dZ W
  };
  loom::gpu::BlasLt lt;
  loom::gpu::Stream stream;
  double best = 0.0;
  for (const auto& shape : shapes) {
    loom::gpu::GemmOptions gemm_options;
    gemm_options.allow_tf32 = precision == "tf32";
    gemm_options.allow_bf16 = precision == "bf16";
    loom::gpu::GemmPlan plan(lt, shape, loom::gpu::Epilogue::none, gemm_options);
    loom::gpu::DeviceBuffer<unsigned char> workspace(std::max<std::size_t>(plan.workspace_bytes(), 1),
                                                     "GEMM peak workspace");
    loom::gpu::GemmArgs args;
    args.a = a.data();
    args.b = b.data();
    args.c = c.data();
    args.workspace = workspace.data();
    args.workspace_bytes = workspace.size();
    args.stream = stream.get();
    const auto times = loom::bench::time_gpu_steps(stream.get(), options.warmup, options.steps,
                                                   [&](int) { plan.run(args); });
    const double flops = 2.0 * static_cast<double>(shape.m * shape.n * shape.k);
    best = std::max(best, flops / times.median_ms / 1e9);
  }
  return best;
}

// fp32_ms: the fp32 step's median from the same run (0: not measured), a
// "loom-fp32" peer for the bf16 rows.
std::vector<nlohmann::json> measure(const std::string& precision, const Options& options,
                                    double& loom_ms, double fp32_ms) {
  const bool tf32 = precision == "tf32";
  const loom::Precision compute =
      precision == "bf16" ? loom::Precision::bf16 : loom::Precision::fp32;
  const std::size_t batch = options.batch;
  // Two batches, alternated, so no step reads the same input twice in a row.
  std::vector<float> host(2 * batch * width);
  std::mt19937_64 random(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : host) x = normal(random);
  std::vector<std::int32_t> host_labels(2 * batch);
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(width) - 1);
  for (auto& y : host_labels) y = label(random);
  // Each step copies its batch from host memory, as the Trainer's do.
  const auto step_on = [&](auto& steps, int s) {
    const std::size_t first = static_cast<std::size_t>(s % 2) * batch;
    steps.step(host.data() + first * width, host_labels.data() + first, batch);
  };
  const double step_flops = gemm_flops_per_step(batch);
  std::vector<nlohmann::json> lines;
  const std::string name = "mlp_4x4096_" + precision;
  {
    loom::bench::EngineSteps<Mlp> steps({.lr = 1e-3f, .momentum = 0.9f},
                                        {.precision = compute, .allow_tf32 = tf32});
    const auto times = loom::bench::time_host_steps(options.warmup, options.steps,
                                                    [&](int s) { step_on(steps, s); });
    loom_ms = times.median_ms;
    lines.push_back({{"benchmark", name},
                     {"library", "loom"},
                     {"batch", batch},
                     {"steps", options.steps},
                     {"median_step_ms", times.median_ms},
                     {"mean_step_ms", times.mean_ms},
                     {"images_per_s", 1000.0 * static_cast<double>(batch) / times.median_ms},
                     {"gemm_tflop_per_s", step_flops / times.median_ms / 1e9},
                     {"precision", precision},
                     {"data", "random"},
                     {"device", loom::bench::gpu_name()}});
    if (compute != loom::Precision::fp32 && fp32_ms > 0.0)
      lines.push_back({{"benchmark", name},
                       {"library", "loom-fp32"},
                       {"batch", batch},
                       {"median_step_ms", fp32_ms},
                       {"images_per_s", 1000.0 * static_cast<double>(batch) / fp32_ms},
                       {"precision", "fp32"},
                       {"data", "random"},
                       {"device", loom::bench::gpu_name()}});
  }
  // The models' memory is back before the peak's operands take theirs.
  loom::gpu::DeviceBuffer<float> a(batch * width, "GEMM peak A");
  loom::gpu::DeviceBuffer<float> b(width * std::max(batch, width), "GEMM peak B");
  loom::gpu::DeviceBuffer<float> c(width * std::max(batch, width), "GEMM peak C");
  LOOM_CUDA_CHECK(cudaMemcpy(a.data(), host.data(), a.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  LOOM_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), std::min(b.size(), host.size()) * sizeof(float),
                             cudaMemcpyHostToDevice));
  const double peak = gemm_peak_tflops(batch, precision, options, a, b, c);
  const double peak_ms = step_flops / peak / 1e9;
  lines.push_back({{"benchmark", name},
                   {"library", "cublaslt-peak"},
                   {"batch", batch},
                   {"steps", options.steps},
                   {"peak_tflop_per_s", peak},
                   {"median_step_ms", peak_ms},
                   {"images_per_s", 1000.0 * static_cast<double>(batch) / peak_ms},
                   {"fraction_of_peak_loom", peak_ms / loom_ms},
                   {"precision", precision},
                   {"device", loom::bench::gpu_name()}});
  return lines;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"4 x (Linear 4096 + ReLU) training on one GPU against the cuBLASLt GEMM peak "
               "(JSON lines)"};
  Options options;
  app.add_option("--batch", options.batch, "samples per step")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 17))
      ->capture_default_str();
  app.add_option("--steps", options.steps, "timed steps (and timed GEMMs per layout)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--precision", options.precisions,
                 "fp32, tf32, bf16 (tensor cores, fp32 master weights), any of them")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    // fp32 first, so that bf16's rows carry it as their peer.
    std::ranges::stable_sort(options.precisions, {}, [](const std::string& p) { return p != "fp32"; });
    double fp32_ms = 0.0;
    for (const auto& precision : options.precisions) {
      double loom_ms = 0.0;
      for (const auto& line : measure(precision, options, loom_ms, fp32_ms))
        std::cout << line.dump() << std::endl;
      if (precision == "fp32") fp32_ms = loom_ms;
    }
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
