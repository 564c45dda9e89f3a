// loom's AdamW update on the GPU (gpu::optimizer_update, the kernel a GPU
// stage runs: one pass over the flat buffers), with and without clipping by
// global norm (the norm summed on the device), against a device-to-device copy of the same
// buffers in the same run (what memory allows). Its PyTorch peer,
// benchmarks/pytorch/adamw.py --device cuda, times AdamW(fused=True) on the
// same parameter counts; scripts/gpu-check pairs the lines by "benchmark"
// and "batch" (here the parameter count). Time per update: CUDA events,
// median after warm-up. JSON lines.
#include <CLI/CLI.hpp>
#include <iostream>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <vector>

#include "gpu_bench.cuh"

namespace {

struct Buffers {
  loom::gpu::DeviceBuffer<float> weights, grads, exp_avg, exp_avg_sq, copy;
  explicit Buffers(std::size_t n)
      : weights(n, "AdamW weights"),
        grads(n, "AdamW gradients"),
        exp_avg(n, "AdamW exp_avg"),
        exp_avg_sq(n, "AdamW exp_avg_sq"),
        copy(n, "copy target") {
    // PyTorch's peer starts from the same values: weights 0.01, gradients 0.001.
    const std::vector<float> w(n, 0.01f), g(n, 0.001f), zero(n, 0.0f);
    LOOM_CUDA_CHECK(cudaMemcpy(weights.data(), w.data(), n * 4, cudaMemcpyHostToDevice));
    LOOM_CUDA_CHECK(cudaMemcpy(grads.data(), g.data(), n * 4, cudaMemcpyHostToDevice));
    LOOM_CUDA_CHECK(cudaMemcpy(exp_avg.data(), zero.data(), n * 4, cudaMemcpyHostToDevice));
    LOOM_CUDA_CHECK(cudaMemcpy(exp_avg_sq.data(), zero.data(), n * 4, cudaMemcpyHostToDevice));
    // Pageable copies may return before they land; the bench's stream does
    // not wait for the legacy one.
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

void print(const char* benchmark, std::size_t n, double ms, double bytes_per_parameter,
           const char* variant) {
  std::cout << nlohmann::json{{"benchmark", benchmark},
                              {"library", "loom"},
                              {"variant", variant},
                              {"batch", n},
                              {"parameters", n},
                              {"metric", "ms"},
                              {"value", ms},
                              {"higher_is_better", false},
                              {"gb_per_s", static_cast<double>(n) * bytes_per_parameter / ms / 1e6},
                              {"device", loom::bench::gpu_name()}}
                   .dump()
            << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom's AdamW update on the GPU, and a copy of the same bytes (JSON lines)"};
  std::vector<std::size_t> counts{431080, 11200000};
  int steps = 200;
  int warmup = 20;
  app.add_option("--parameters", counts, "parameter counts")->check(CLI::Range(1ul, 1ul << 32));
  app.add_option("--steps", steps, "timed updates per count")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", warmup, "untimed updates first")->check(CLI::Range(0, 100000));
  CLI11_PARSE(app, argc, argv);
  try {
    LOOM_CHECK(!loom::devices::gpus().empty(), "adamw_gpu_bench: no GPU found");
    loom::gpu::Stream stream;
    const auto optimizer = loom::gpu::device_optimizer(loom::AdamW::Options{.lr = 1e-3f});
    loom::gpu::DeviceBuffer<loom::gpu::UpdateScalars> scalars(1, "AdamW scalars");
    loom::gpu::DeviceBuffer<double> squares(1, "squared norm");
    for (const std::size_t n : counts) {
      Buffers b(n);
      const std::size_t scratch_bytes = loom::gpu::squared_norm_bytes(n);
      loom::gpu::DeviceBuffer<unsigned char> scratch(std::max<std::size_t>(scratch_bytes, 1),
                                                     "norm scratch");
      // Each update is step t's, as a GPU stage stages it: its scalars
      // copied first (AdamW's bias corrections change every step).
      std::vector<loom::gpu::UpdateScalars> staged(static_cast<std::size_t>(warmup + steps));
      const auto update = [&](int s, bool clip) {
        auto& next = staged[static_cast<std::size_t>(s)];
        next = loom::gpu::update_scalars(optimizer, optimizer.lr, static_cast<std::uint64_t>(s) + 1,
                                         clip ? 1.0f : 0.0f);
        LOOM_CUDA_CHECK(cudaMemcpyAsync(scalars.data(), &next, sizeof next,
                                        cudaMemcpyHostToDevice, stream.get()));
        if (clip)
          loom::gpu::squared_norm(b.grads.data(), n, squares.data(), scratch.data(),
                                  scratch_bytes, stream.get());
        loom::gpu::optimizer_update(optimizer, b.weights.data(), b.grads.data(), b.exp_avg.data(),
                                    b.exp_avg_sq.data(), n, scalars.data(),
                                    clip ? squares.data() : nullptr, nullptr, stream.get());
      };
      // Read w, g, m, v; write w, m, v (the same count PyTorch's line uses).
      const auto plain = loom::bench::time_gpu_steps(stream.get(), warmup, steps,
                                                     [&](int s) { update(s, false); });
      print("adamw_update_gpu", n, plain.median_ms, 28.0, "fused");
      const auto clipped = loom::bench::time_gpu_steps(stream.get(), warmup, steps,
                                                       [&](int s) { update(s, true); });
      print("adamw_update_clipped_gpu", n, clipped.median_ms, 32.0, "fused, clip_grad_norm");
      const auto copy = loom::bench::time_gpu_steps(stream.get(), warmup, steps, [&](int) {
        LOOM_CUDA_CHECK(cudaMemcpyAsync(b.copy.data(), b.weights.data(), n * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream.get()));
      });
      print("device_copy_gpu", n, copy.median_ms, 8.0, "cudaMemcpyAsync");
    }
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
