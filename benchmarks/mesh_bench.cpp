// Hybrid 2 x 2 across MPI processes (JSON lines from rank 0): the deep MLP
// of model_split_bench as Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>
// on real Fashion-MNIST batches, median over --steps after --warmup:
//   - images/s of the whole mesh;
//   - reduce_hidden: the share of the stages' gradient all-reduce time
//     (over the data axis) that ran before the step's last pass ended on
//     any rank, i.e. hidden under the pipelines' work (goal: at least 0.9).
// Run it under mpirun, one rank per process (mpirun -np 4 mesh_bench) or
// ranks as threads of fewer processes (mpirun -np 2 mesh_bench --threads 2);
// every process takes --threads CPU worker devices of one core each.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

using namespace loom;
using Clock = std::chrono::steady_clock;

// Eight 1024-wide layers (model_split_bench's): cut evenly in 2.
using DeepMlp = Sequential<Input<1, 28, 28>, Flatten, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<10>>;
using Grid = Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>;

const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};

struct Options {
  std::size_t batch = 512;
  std::size_t threads = 1;
  int steps = 10;
  int warmup = 2;
  std::string data_dir = data::default_fashion_mnist_dir;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
double since_epoch_ms(Clock::time_point t) { return ms(t.time_since_epoch()); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Hybrid 2 x 2 across MPI processes: images/s and the hidden all-reduce (JSON "
               "lines, from rank 0)"};
  Options o;
  app.add_option("--batch", o.batch, "global batch")->capture_default_str();
  app.add_option("--threads", o.threads, "worker devices (mesh ranks) per process")
      ->check(CLI::Range(1, 4))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--data", o.data_dir, "Fashion-MNIST folder")->capture_default_str();
  try {
    dist::Environment env(argc, argv);
    CLI11_PARSE(app, argc, argv);
    const auto train = data::fashion_mnist(o.data_dir).train;
    LOOM_CHECK(o.batch >= 1 && o.batch <= train.count, "--batch ", o.batch,
               " must be between 1 and the ", train.count, " training samples");
    comm::Comm world(env.world());
    std::vector<Device> workers;
    for (std::size_t t = 0; t < o.threads; ++t)
      workers.push_back(Device{Device::Kind::cpu, static_cast<int>(t), 1});
    const auto ranks = static_cast<std::size_t>(world.size()) * o.threads;
    LOOM_CHECK(ranks == Grid::devices_needed, "Hybrid 2 x 2 takes 4 ranks: processes x --threads "
               "is ", ranks);
    const Model<DeepMlp, float> initial(0);
    detail::PipelineEngine<DeepMlp, Grid::partition, SGD, SoftmaxCrossEntropy> engine(
        workers, world, initial, sgd, pipeline_grid<Grid>(ranks), Grid::schedule);

    std::vector<double> step, hidden;
    const std::size_t batches = train.count / o.batch;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      const std::size_t first = static_cast<std::size_t>(s) % batches * o.batch;
      const auto start = Clock::now();
      engine.micro_step(train.images.data() + first * train.sample_size(),
                        train.labels.data() + first, o.batch, o.batch, false,
                        true, {.lr = sgd.lr});
      const auto stop = Clock::now();
      if (s < o.warmup) continue;
      // The mesh's last pass: the latest over every rank (one clock: one node).
      double passes_end = 0.0;
      for (std::size_t i = 0; i < engine.local_stages(); ++i)
        passes_end = std::max(passes_end, since_epoch_ms(engine.report(i).end));
      const double mine[1] = {passes_end};
      for (const double end : engine.gather_rows(mine)) passes_end = std::max(passes_end, end);
      double sums[2] = {0.0, 0.0};  // reducing, overlapped
      for (std::size_t i = 0; i < engine.local_stages(); ++i) {
        const auto r = engine.report(i);
        for (std::size_t b = 0; b < r.reduce_begin.size(); ++b) {
          const double begin = since_epoch_ms(r.reduce_begin[b]);
          const double end = since_epoch_ms(r.reduce_end[b]);
          sums[0] += end - begin;
          sums[1] += std::max(0.0, std::min(end, passes_end) - begin);
        }
      }
      const auto all = engine.gather_rows(sums);
      double reducing = 0.0, overlapped = 0.0;
      for (std::size_t p = 0; p + 1 < all.size(); p += 2) {
        reducing += all[p];
        overlapped += all[p + 1];
      }
      step.push_back(ms(stop - start));
      hidden.push_back(reducing > 0.0 ? overlapped / reducing : 0.0);
    }
    if (env.rank() == 0) {
      nlohmann::json j;
      j["benchmark"] = "mesh_hybrid";
      j["network"] = "deep_mlp";
      j["batch"] = o.batch;
      j["steps"] = o.steps;
      j["processes"] = world.size();
      j["threads_per_process"] = o.threads;
      j["mesh"] = engine.mesh().describe();
      j["layout"] = "2 replicas x Balanced<2>, 1F1B, M = 4 per replica";
      j["median_step_ms"] = median(step);
      j["images_per_s"] = 1000.0 * static_cast<double>(o.batch) / median(step);
      j["reduce_hidden"] = median(hidden);
      std::cout << j.dump() << std::endl;
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
