// NCCL all-reduce bandwidth through loom's NcclComm, one rank per visible GPU
// in this process (a thread each), message sizes 4 KiB to 1 GiB of float32:
// time per all-reduce (CUDA events, median after warm-up), algorithm
// bandwidth (bytes / time) and bus bandwidth (x 2(n-1)/n, NCCL's measure,
// which is 0 for one rank: there is then nothing to move). One JSON line per size.
#include <CLI/CLI.hpp>
#include <iostream>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "gpu_bench.cuh"

int main(int argc, char** argv) {
  CLI::App app{"NCCL all-reduce bandwidth over the GPUs of this machine (JSON lines)"};
  int steps = 20;
  int warmup = 3;
  std::size_t largest_mib = 1024;
  app.add_option("--steps", steps, "timed all-reduces per size")->check(CLI::Range(1, 10000));
  app.add_option("--warmup", warmup, "untimed all-reduces first")->check(CLI::Range(0, 10000));
  app.add_option("--max-mib", largest_mib, "largest message, MiB")->check(CLI::Range(1, 16384));
  CLI11_PARSE(app, argc, argv);
  try {
    const auto gpus = loom::devices::gpus();
    LOOM_CHECK(!gpus.empty(), "nccl_allreduce_gpu_bench: no GPU found");
    std::vector<int> ordinals;
    for (const auto& gpu : gpus) ordinals.push_back(gpu.index);
    auto ranks = loom::comm::NcclComm::create_local(ordinals);
    const std::size_t n = ranks.size();
    for (std::size_t bytes = 4096; bytes <= largest_mib << 20; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<double> rank_ms(n);
      std::vector<std::thread> threads;
      std::vector<std::exception_ptr> errors(n);
      for (std::size_t r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
          try {
            auto& comm = ranks[r];
            LOOM_CUDA_CHECK(cudaSetDevice(comm.device()));
            loom::gpu::DeviceBuffer<float> data(count, "all-reduce message");
            // 1/n each: averaging keeps the values (never zeros, never growing).
            std::vector<float> ones(count, 1.0f / static_cast<float>(n));
            LOOM_CUDA_CHECK(cudaMemcpy(data.data(), ones.data(), bytes, cudaMemcpyHostToDevice));
            const auto times = loom::bench::time_gpu_steps(comm.stream(), warmup, steps, [&](int) {
              comm.all_reduce_async(data.data(), count, loom::comm::ReduceOp::average,
                                    comm.stream());
            });
            rank_ms[r] = times.median_ms;
          } catch (...) {
            errors[r] = std::current_exception();
          }
        });
      for (auto& t : threads) t.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
      double ms = 0.0;
      for (double m : rank_ms) ms = std::max(ms, m);
      const double algbw = static_cast<double>(bytes) / ms / 1e6;  // GB/s
      const double busbw = algbw * 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
      std::cout << nlohmann::json{{"benchmark", "nccl_all_reduce"},
                                  {"library", "loom"},
                                  {"batch", bytes},
                                  {"ranks", n},
                                  {"bytes", bytes},
                                  {"median_ms", ms},
                                  {"metric", "algbw_GBps"},
                                  {"value", algbw},
                                  {"busbw_GBps", busbw},
                                  {"device", loom::bench::gpu_name()}}
                       .dump()
                << std::endl;
    }
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
