// ModelSplit on CPU worker devices (JSON lines), on real Fashion-MNIST
// batches, median over --steps after --warmup:
//   - bubble: the idle fraction of the busiest stage during a step's passes,
//     1 - (its forward/loss/backward time) / (first pass begun to last pass
//     ended, over all stages), for S = 2 and 4 stages and M micro-batches,
//     both schedules, against the ideal (S - 1) / (M + S - 1) of equal
//     stages (goal: within 10 % of it); mean_idle averages the idle fraction
//     over the stages, so it adds the cut's imbalance;
//   - throughput: a deep MLP trained by SingleDevice, DataParallel<> and
//     ModelSplit on the same CPU worker devices (images/s, ratio to DataParallel);
//   - hybrid: the same MLP on 4 CPU worker devices as DataParallel<> (4
//     replicas), ModelSplit<Balanced<4>> and Hybrid<2, ModelSplit<Balanced<2>>>
//     (images/s, ratio to DataParallel), and the fraction of Hybrid's
//     per-stage gradient all-reduce time that ran before the step's last
//     pass ended (hidden under the pipelines' work);
//   - balance: per-stage busy time for Balanced<S> cuts of LeNet and the
//     MLP (and a hand cut for contrast), beside the cost model's prediction.
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

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
// Eight 1024-wide layers: a network deep enough to cut evenly in 2 or 4.
using DeepMlp = Sequential<Input<1, 28, 28>, Flatten, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<10>>;

const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};

struct Options {
  std::size_t batch = 512;
  std::vector<std::size_t> micro_batches{4, 8, 16, 32};
  int steps = 10;
  int warmup = 2;
  std::string data_dir = data::default_fashion_mnist_dir;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Batches {
  const data::Dataset& train;
  std::size_t batch;
  std::size_t first(int s) const { return static_cast<std::size_t>(s) % (train.count / batch) * batch; }
  const float* images(int s) const { return train.images.data() + first(s) * train.sample_size(); }
  const std::int32_t* labels(int s) const { return train.labels.data() + first(s); }
};

// Runs --warmup untimed, then --steps timed optimizer steps of `engine`;
// measured(step ms) after each timed one.
template <class Engine, class Measured>
void run_steps(Engine& engine, const Batches& data, const Options& o, Measured&& measured) {
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto start = Clock::now();
    engine.micro_step(data.images(s), data.labels(s), data.batch, data.batch, false, true, {.lr = sgd.lr});
    const auto stop = Clock::now();
    if (s >= o.warmup) measured(ms(stop - start));
  }
}

struct PipelineFigures {
  double step_ms = 0.0;
  double passes_ms = 0.0;             // first pass begun to last pass ended
  double bubble = 0.0;                // 1 - the busiest stage's time / passes_ms
  double mean_idle = 0.0;             // 1 - mean stage time / passes_ms (adds imbalance)
  std::vector<double> stage_busy_ms;  // per stage, median
};

template <class Net, class Policy>
PipelineFigures pipeline(const Batches& data, const Options& o, PipelineSchedule schedule) {
  constexpr std::size_t S = Policy::stages;
  const Model<Net, float> initial(0);
  detail::PipelineEngine<Net, typename Policy::partition, SGD, SoftmaxCrossEntropy> engine(
      devices::cpu(S), {}, initial, sgd, pipeline_grid<Policy>(S), schedule);
  std::vector<double> step, passes, bubble, mean_idle;
  std::vector<std::vector<double>> busy(S);
  run_steps(engine, data, o, [&](double step_ms) {
    step.push_back(step_ms);
    Clock::time_point begin = Clock::time_point::max(), end{};
    for (std::size_t k = 0; k < S; ++k) {
      begin = std::min(begin, engine.report(k).begin);
      end = std::max(end, engine.report(k).end);
    }
    const double span = ms(end - begin);
    double total = 0.0, most = 0.0;
    for (std::size_t k = 0; k < S; ++k) {
      const double b = 1000.0 * engine.report(k).busy_seconds;
      busy[k].push_back(b);
      total += b;
      most = std::max(most, b);
    }
    passes.push_back(span);
    bubble.push_back(1.0 - most / span);
    mean_idle.push_back(1.0 - total / S / span);
  });
  PipelineFigures f{median(step), median(passes), median(bubble), median(mean_idle), {}};
  for (auto& b : busy) f.stage_busy_ms.push_back(median(b));
  return f;
}

template <class Net, class Policy>
double data_parallel_ms(const Batches& data, const Options& o, int workers) {
  detail::DataParallelEngine<Net, Policy, SGD, SoftmaxCrossEntropy> engine(devices::cpu(workers), {},
                                                                     0, sgd);
  engine.reserve(data.batch);
  std::vector<double> step;
  run_steps(engine, data, o, [&](double step_ms) { step.push_back(step_ms); });
  return median(step);
}

template <class Net>
double single_device_ms(const Batches& data, const Options& o) {
  cpu::set_threads(devices::hardware_threads());
  Model<Net, float> model(0, data.batch);
  SGD::State<float> optimizer(sgd, Net::parameter_count);
  std::vector<double> step;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto start = Clock::now();
    const float* logits = model.forward(data.images(s), data.batch);
    SoftmaxCrossEntropy::evaluate<float>(logits, data.labels(s), data.batch, 10, data.batch,
                                         model.output_gradient());
    model.backward();
    optimizer.step(model.parameters(), model.gradients());
    if (s >= o.warmup) step.push_back(ms(Clock::now() - start));
  }
  return median(step);
}

nlohmann::json line(const char* name, const char* network, std::size_t batch, const Options& o) {
  return {{"benchmark", name},   {"library", "loom"}, {"backend", "cpu"},
          {"network", network},  {"batch", batch},    {"steps", o.steps},
          {"cores", devices::hardware_threads()}};
}

template <class Net, std::size_t S>
void bubbles(const Batches& data, const Options& o) {
  using Policy = ModelSplit<Balanced<S>>;
  for (const auto kind : {PipelineKind::gpipe, PipelineKind::one_f_one_b})
    for (const std::size_t m : o.micro_batches) {
      const auto f = pipeline<Net, Policy>(data, o, {kind, m});
      auto j = line("model_split_bubble", "deep_mlp", data.batch, o);
      j["stages"] = S;
      j["schedule"] = pipeline_kind_name(kind);
      j["micro_batches"] = m;
      j["median_step_ms"] = f.step_ms;
      j["passes_ms"] = f.passes_ms;
      j["bubble"] = f.bubble;
      j["mean_idle"] = f.mean_idle;
      j["ideal_bubble"] = ideal_bubble(S, m);
      j["bubble_over_ideal"] = f.bubble / ideal_bubble(S, m);
      j["stage_busy_ms"] = f.stage_busy_ms;
      std::cout << j.dump() << std::endl;
    }
}

// Hybrid's step time, and the share of its stages' all-reduce time spent
// while some stage still ran a pass.
struct HybridFigures {
  double step_ms = 0.0;
  double hidden = 0.0;
};

template <class Net, class Policy>
HybridFigures hybrid(const Batches& data, const Options& o) {
  const Model<Net, float> initial(0);
  detail::PipelineEngine<Net, typename Policy::partition, SGD, SoftmaxCrossEntropy> engine(
      devices::cpu(Policy::devices_needed), {}, initial, sgd,
      pipeline_grid<Policy>(Policy::devices_needed), Policy::schedule);
  std::vector<double> step, hidden;
  run_steps(engine, data, o, [&](double step_ms) {
    step.push_back(step_ms);
    Clock::time_point passes_end{};
    for (std::size_t i = 0; i < Policy::devices_needed; ++i)
      passes_end = std::max(passes_end, engine.report(i).end);
    double reducing = 0.0, overlapped = 0.0;
    for (std::size_t i = 0; i < Policy::devices_needed; ++i) {
      const auto r = engine.report(i);
      for (std::size_t b = 0; b < r.reduce_begin.size(); ++b) {
        reducing += ms(r.reduce_end[b] - r.reduce_begin[b]);
        overlapped += std::max(0.0, ms(std::min(r.reduce_end[b], passes_end) - r.reduce_begin[b]));
      }
    }
    hidden.push_back(reducing > 0.0 ? overlapped / reducing : 0.0);
  });
  return {median(step), median(hidden)};
}

// Per-stage busy time beside the cost model's share of the work.
template <class Net, class Partition>
void balance(const char* network, const char* cut, const Batches& data, const Options& o) {
  using Policy = ModelSplit<Partition, OneFOneB<8>>;
  const auto f = pipeline<Net, Policy>(data, o, Policy::schedule);
  constexpr auto bounds = partition_bounds<Net, Partition>::bounds;
  std::vector<double> predicted, measured, layers;
  double total_cost = 0.0, total_busy = 0.0;
  for (std::size_t k = 0; k < Policy::stages; ++k) {
    total_cost += StageCostModel<Net>::stage(bounds[k], bounds[k + 1]);
    total_busy += f.stage_busy_ms[k];
  }
  for (std::size_t k = 0; k < Policy::stages; ++k) {
    predicted.push_back(StageCostModel<Net>::stage(bounds[k], bounds[k + 1]) / total_cost);
    measured.push_back(f.stage_busy_ms[k] / total_busy);
    layers.push_back(static_cast<double>(bounds[k] + 1));
  }
  auto j = line("model_split_balance", network, data.batch, o);
  j["partition"] = cut;
  j["stages"] = Policy::stages;
  j["first_layer"] = layers;
  j["stage_busy_ms"] = f.stage_busy_ms;
  j["measured_share"] = measured;
  j["predicted_share"] = predicted;
  j["median_step_ms"] = f.step_ms;
  std::cout << j.dump() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ModelSplit and Hybrid on CPU worker devices: bubble, throughput, balance (JSON "
               "lines)"};
  Options o;
  app.add_option("--batch", o.batch, "global batch")->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches, "M values for the bubble")->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--data", o.data_dir, "Fashion-MNIST folder")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto train = data::fashion_mnist(o.data_dir).train;
    LOOM_CHECK(o.batch >= 1 && o.batch <= train.count, "--batch ", o.batch,
               " must be between 1 and the ", train.count, " training samples");
    const Batches data{train, o.batch};

    bubbles<DeepMlp, 2>(data, o);
    bubbles<DeepMlp, 4>(data, o);

    const double single = single_device_ms<DeepMlp>(data, o);
    const double dp = data_parallel_ms<DeepMlp, DataParallel<>>(data, o, 2);
    const auto split = pipeline<DeepMlp, ModelSplit<Balanced<2>, OneFOneB<8>>>(
        data, o, OneFOneB<8>::schedule);
    auto j = line("model_split_throughput", "deep_mlp", o.batch, o);
    const double n = static_cast<double>(o.batch);
    j["devices"] = 2;
    j["single_device_images_per_s"] = 1000.0 * n / single;
    j["data_parallel_images_per_s"] = 1000.0 * n / dp;
    j["model_split_images_per_s"] = 1000.0 * n / split.step_ms;
    j["model_split_schedule"] = "1F1B, M = 8";
    j["model_split_over_data_parallel"] = dp / split.step_ms;
    std::cout << j.dump() << std::endl;

    {
      using Grid = Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>;
      const double dp4 = data_parallel_ms<DeepMlp, DataParallel<>>(data, o, 4);
      const auto split4 = pipeline<DeepMlp, ModelSplit<Balanced<4>, OneFOneB<8>>>(
          data, o, OneFOneB<8>::schedule);
      const auto grid = hybrid<DeepMlp, Grid>(data, o);
      auto h = line("hybrid_throughput", "deep_mlp", o.batch, o);
      h["devices"] = 4;
      h["single_device_images_per_s"] = 1000.0 * n / single;
      h["data_parallel_images_per_s"] = 1000.0 * n / dp4;
      h["model_split_images_per_s"] = 1000.0 * n / split4.step_ms;
      h["model_split_schedule"] = "Balanced<4>, 1F1B, M = 8";
      h["hybrid_images_per_s"] = 1000.0 * n / grid.step_ms;
      h["hybrid_layout"] = "2 replicas x Balanced<2>, 1F1B, M = 4 per replica";
      h["hybrid_over_data_parallel"] = dp4 / grid.step_ms;
      h["hybrid_reduce_hidden"] = grid.hidden;
      std::cout << h.dump() << std::endl;
    }
    balance<LeNet, Balanced<2>>("lenet", "Balanced<2>", data, o);
    balance<LeNet, At<4>>("lenet", "At<4>", data, o);
    balance<LeNet, Balanced<4>>("lenet", "Balanced<4>", data, o);
    balance<DeepMlp, Balanced<2>>("deep_mlp", "Balanced<2>", data, o);
    balance<DeepMlp, At<6>>("deep_mlp", "At<6>", data, o);
    balance<DeepMlp, Balanced<4>>("deep_mlp", "Balanced<4>", data, o);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
