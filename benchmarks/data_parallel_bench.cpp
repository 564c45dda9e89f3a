// DataParallel on CPU worker devices (JSON lines):
//   - policy overhead: DataParallel<> on one device against the plain
//     single-device step, same data, same threads (goal: <= 2 % slower);
//   - scaling: global batch over 1, 2, 4 workers (images/s, speed-up);
//   - overlap: the fraction of the all-reduce time hidden under backward
//     (goal: >= 90 %), for bucket sizes of 64 KiB, 1 MiB (the default) and
//     4 MiB. A bucket's reduction is counted from the moment the last rank
//     reaches it (waiting for a slower rank is not communication) to its end;
//     the part of it after every rank's backward has ended is exposed.
// Steps are timed whole (forward, loss, backward, reduce, update) on real
// Fashion-MNIST batches, median of --steps after --warmup.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "lenet_bench.hpp"

namespace {

using loom::bench::LeNet;
using Clock = std::chrono::steady_clock;
const loom::SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Batches {
  const loom::data::Dataset& train;
  std::size_t batch;
  const float* images(int s) const { return train.images.data() + first(s) * train.sample_size(); }
  const std::int32_t* labels(int s) const { return train.labels.data() + first(s); }
  std::size_t first(int s) const {
    return static_cast<std::size_t>(s) % (train.count / batch) * batch;
  }
};

// The single-device step the Trainer runs, without its loader.
double single_device_ms(const Batches& data, const loom::bench::Options& o, int threads) {
  loom::cpu::set_threads(threads);
  loom::Model<LeNet, float> model(0, data.batch);
  loom::SGD::State<float> optimizer(sgd, LeNet::parameter_count);
  std::vector<double> ms;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto start = Clock::now();
    const float* logits = model.forward(data.images(s), data.batch);
    loom::SoftmaxCrossEntropy::evaluate<float>(logits, data.labels(s), data.batch, 10, data.batch,
                                               model.output_gradient());
    model.backward();
    optimizer.step(model.parameters(), model.gradients());
    if (s >= o.warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return median(ms);
}

struct DataParallelFigures {
  double step_ms = 0.0;
  double hidden = 0.0;  // all-reduce time overlapping backward / all-reduce time
  double reduce_ms = 0.0;
};

template <std::size_t BucketBytes>
DataParallelFigures data_parallel(const Batches& data, const loom::bench::Options& o,
                                  std::vector<loom::Device> devices) {
  using Policy = loom::DataParallel<BucketBytes>;
  loom::detail::DataParallelEngine<LeNet, Policy, loom::SGD, loom::SoftmaxCrossEntropy> engine(
      devices, {}, 0, sgd);
  engine.reserve(data.batch);
  std::vector<double> ms;
  double reduce = 0.0, hidden = 0.0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto start = Clock::now();
    engine.micro_step(data.images(s), data.labels(s), data.batch, data.batch, false, true, {.lr = sgd.lr});
    const auto stop = Clock::now();
    if (s < o.warmup) continue;
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    Clock::time_point backward_end{};
    for (std::size_t r = 0; r < devices.size(); ++r)
      backward_end = std::max(backward_end, engine.last_timeline(r).backward_end);
    for (std::size_t b = 0; b < engine.last_timeline().reduce_begin.size(); ++b) {
      Clock::time_point begin{}, end{};
      for (std::size_t r = 0; r < devices.size(); ++r) {
        begin = std::max(begin, engine.last_timeline(r).reduce_begin[b]);
        end = std::max(end, engine.last_timeline(r).reduce_end[b]);
      }
      const double whole = std::chrono::duration<double, std::milli>(end - begin).count();
      const double exposed =
          std::chrono::duration<double, std::milli>(end - std::max(begin, backward_end)).count();
      reduce += whole;
      hidden += whole - std::max(0.0, exposed);
    }
  }
  return {median(ms), reduce > 0 ? hidden / reduce : 0.0, reduce / o.steps};
}

nlohmann::json line(const std::string& name, std::size_t batch, const loom::bench::Options& o) {
  return {{"benchmark", name}, {"library", "loom"}, {"backend", "cpu"}, {"batch", batch},
          {"steps", o.steps}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"DataParallel on CPU worker devices: overhead, scaling, overlap (JSON lines)"};
  loom::bench::Options options;
  options.batches = {256};
  options.steps = 20;
  options.warmup = 3;
  loom::bench::add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    const auto train = loom::data::fashion_mnist(options.data_dir).train;
    const int cores = loom::devices::hardware_threads();
    for (const std::size_t batch : options.batches) {
      loom::bench::check_batch(batch, train.count);
      const Batches data{train, batch};
      const auto n = static_cast<double>(batch);

      const double single = single_device_ms(data, options, cores);
      const auto one = data_parallel<loom::default_bucket_bytes>(data, options, loom::devices::cpu(1));
      auto overhead = line("data_parallel_overhead", batch, options);
      overhead["single_device_step_ms"] = single;
      overhead["data_parallel_1_device_step_ms"] = one.step_ms;
      overhead["overhead"] = one.step_ms / single - 1.0;
      overhead["threads"] = cores;
      std::cout << overhead.dump() << std::endl;

      for (int workers : {1, 2, 4}) {
        const auto f = data_parallel<loom::default_bucket_bytes>(data, options,
                                                                 loom::devices::cpu(workers));
        auto scaling = line("data_parallel_scaling", batch, options);
        scaling["workers"] = workers;
        scaling["threads_per_worker"] = loom::devices::cpu(workers).front().threads;
        scaling["cores"] = cores;
        scaling["median_step_ms"] = f.step_ms;
        scaling["images_per_s"] = 1000.0 * n / f.step_ms;
        scaling["speedup_over_single_device"] = single / f.step_ms;
        std::cout << scaling.dump() << std::endl;
      }

      const auto report = [&](const char* bucket, const DataParallelFigures& f) {
        auto overlap = line("data_parallel_overlap", batch, options);
        overlap["workers"] = 2;
        overlap["bucket"] = bucket;
        overlap["median_step_ms"] = f.step_ms;
        overlap["all_reduce_ms_per_step"] = f.reduce_ms;
        overlap["hidden_under_backward"] = f.hidden;
        std::cout << overlap.dump() << std::endl;
      };
      const auto workers = loom::devices::cpu(2);
      report("64KiB", data_parallel<std::size_t{64} << 10>(data, options, workers));
      report("1MiB", data_parallel<std::size_t{1} << 20>(data, options, workers));
      report("4MiB", data_parallel<std::size_t{4} << 20>(data, options, workers));
    }
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
