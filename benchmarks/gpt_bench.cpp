// The GPT example's network on the CPU, JSON lines (benchmarks/gpt_vs_pytorch
// runs it beside benchmarks/pytorch/gpt.py, the same network in PyTorch, on
// the same windows of Debian's fortunes):
//   gpt_step        the median training step (AdamW) after --warmup steps,
//                   over --steps batches of --batch windows, tokens/s, the
//                   first batch's loss at the initial weights, and the
//                   median step's time inside OpenBLAS's sgemm (sgemm_ms)
//                   and outside it (other_ms);
//   attention_step  CausalSelfAttention alone at the network's shape
//                   (--batch x context 64 x width 128, 4 heads), the median
//                   forward + backward;
//   gpt_convergence with --train-steps N (instead of the two above): N
//                   steps with the example's settings (AdamW lr 1e-3,
//                   weight decay 0.1, a 100-step warm-up from a tenth, then a
//                   cosine to 0; clipping at norm 1) and the loss on the
//                   validation windows.
//   gpt_tensor_step with --tensor T (instead of the others): the median step
//                   under TensorParallel<T> on T worker devices (--threads / T
//                   BLAS threads each) against SingleDevice on --threads, in
//                   one run, and the first batch's loss after the timed steps
//                   under both (equal to fp32 rounding).
// --tied: the network with its head's weight tied to its embedding's
// (nanoGPT's default; gpt.py --tied builds the same).
// --dump FILE writes the training windows in the order they are taken, the
// validation windows and loom's initial parameters, so that PyTorch starts
// from the same weights and sees the same batches.
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <loom/data/text.hpp>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "../examples/gpt_network.hpp"

using namespace loom;
using examples::BabyGpt;
using examples::gpt_context;

namespace {

using Clock = std::chrono::steady_clock;

// Nanoseconds spent in OpenBLAS's sgemm so far, all threads together.
std::atomic<std::int64_t> sgemm_ns{0};

}  // namespace

// This program's cblas_sgemm stands in front of OpenBLAS's (an executable's
// definition takes precedence over a shared library's), times each call
// into sgemm_ns and forwards it: a step's line then says how much of the
// step is GEMMs, which loom and PyTorch both leave to OpenBLAS, and how
// much is everything else.
extern "C" void cblas_sgemm(OPENBLAS_CONST enum CBLAS_ORDER order,
                            OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_a,
                            OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_b, OPENBLAS_CONST blasint m,
                            OPENBLAS_CONST blasint n, OPENBLAS_CONST blasint k,
                            OPENBLAS_CONST float alpha, OPENBLAS_CONST float* a,
                            OPENBLAS_CONST blasint lda, OPENBLAS_CONST float* b,
                            OPENBLAS_CONST blasint ldb, OPENBLAS_CONST float beta, float* c,
                            OPENBLAS_CONST blasint ldc) {
  using Sgemm = void (*)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint,
                         blasint, blasint, float, const float*, blasint, const float*, blasint,
                         float, float*, blasint);
  static const auto openblas = reinterpret_cast<Sgemm>(dlsym(RTLD_NEXT, "cblas_sgemm"));
  if (openblas == nullptr) {
    std::cerr << "gpt_bench: OpenBLAS's cblas_sgemm not found behind this program's\n";
    std::abort();
  }
  const auto begin = Clock::now();
  openblas(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  sgemm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count();
}

namespace {

double ms_since(Clock::time_point begin) {
  return std::chrono::duration<double, std::milli>(Clock::now() - begin).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Each window's context + 1 bytes: its ids, then the target at its last position.
void write_windows(std::ofstream& out, const data::Dataset& set) {
  std::vector<std::uint8_t> window(gpt_context + 1);
  for (std::size_t s = 0; s < set.count; ++s) {
    for (std::size_t p = 0; p < gpt_context; ++p)
      window[p] = static_cast<std::uint8_t>(set.images[s * gpt_context + p]);
    window[gpt_context] = static_cast<std::uint8_t>(set.targets[s * gpt_context + gpt_context - 1]);
    out.write(reinterpret_cast<const char*>(window.data()),
              static_cast<std::streamsize>(window.size()));
  }
}

// Four int64 (training windows, validation windows, context, parameters),
// the windows (context + 1 bytes each), the parameters (float32, loom's order).
void dump(const data::Split& split, std::span<const float> parameters, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  LOOM_CHECK(out.good(), "gpt_bench: cannot write --dump '", path, "'");
  const std::int64_t header[4] = {
      static_cast<std::int64_t>(split.train.count), static_cast<std::int64_t>(split.test.count),
      static_cast<std::int64_t>(gpt_context), static_cast<std::int64_t>(parameters.size())};
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  write_windows(out, split.train);
  write_windows(out, split.test);
  out.write(reinterpret_cast<const char*>(parameters.data()),
            static_cast<std::streamsize>(parameters.size_bytes()));
  LOOM_CHECK(out.good(), "gpt_bench: writing --dump '", path, "' failed");
}

// Each step's wall time, from its first batch to its end, and (with
// sgemm) its time inside sgemm.
struct StepTimes {
  void on_step_begin(const StepBegin&) {
    begin = Clock::now();
    sgemm_begin = sgemm_ns.load();
  }
  void on_step(const StepInfo&) {
    ms->push_back(ms_since(begin));
    if (sgemm != nullptr)
      sgemm->push_back(static_cast<double>(sgemm_ns.load() - sgemm_begin) / 1e6);
  }
  std::vector<double>* ms;
  std::vector<double>* sgemm = nullptr;
  Clock::time_point begin{};
  std::int64_t sgemm_begin = 0;
};

// The example's learning rate: a 100-step warm-up from a tenth, then a cosine to 0.
struct WarmupCosine {
  template <class T>
  void on_step_begin(const StepBegin& step, T& trainer) {
    const double f =
        schedules::Warmup<schedules::Cosine>{100, 0.1, {}}(step.fit_step, step.total_steps);
    trainer.optimizer().set_lr(static_cast<float>(trainer.base_lr() * f));
  }
};


// The median step of the example's network under Policy on `devices`,
// after `warmup` steps, and the loss of the first batch's windows after
// the timed steps (the policies must agree on it).
template <class Policy>
std::pair<double, double> policy_step(std::vector<Device> devices, const data::Split& split,
                                      std::size_t batch, std::size_t warmup) {
  Trainer<BabyGpt, Policy, AdamW, PositionCrossEntropy> trainer(
      std::move(devices), AdamW::Options{.lr = 1e-3f, .weight_decay = 0.1f});
  std::vector<double> ms;
  trainer.fit(split.train, {.epochs = 1, .batch_size = batch, .shuffle = false},
              StepTimes{.ms = &ms});
  return {median(std::vector<double>(ms.begin() + static_cast<std::ptrdiff_t>(warmup), ms.end())),
          trainer.evaluate(data::head(split.train, batch)).loss};
}

std::vector<Device> cpu_device(std::size_t threads) {
  auto devices = devices::cpu(1);
  devices.front().threads = static_cast<int>(threads);
  return devices;
}

// CausalSelfAttention alone: the median forward + backward over `steps`
// after `warmup`, on the first windows' embeddings (the trained network's
// input to its first attention, at initialisation).
double attention_ms(const data::Dataset& windows, std::size_t batch, std::size_t steps,
                    std::size_t warmup) {
  using Embed = Sequential<Input<gpt_context>, Embedding<examples::gpt_vocab, examples::gpt_width>,
                           PositionEmbedding>;
  using Attention =
      Sequential<Input<gpt_context, examples::gpt_width>, CausalSelfAttention<examples::gpt_heads>>;
  Model<Embed, float> embed(1, batch);
  const float* x = embed.forward(windows.images.data(), batch);
  const std::vector<float> input(x, x + batch * gpt_context * examples::gpt_width);
  Model<Attention, float> attention(2, batch);
  std::vector<float> dx(input.size());  // PyTorch's side takes the input's gradient too
  std::vector<double> ms;
  for (std::size_t i = 0; i < warmup + steps; ++i) {
    const auto begin = Clock::now();
    const float* y = attention.forward(input.data(), batch, 0, {.training = true});
    float* dy = attention.output_gradient();
    for (std::size_t k = 0; k < batch * gpt_context * examples::gpt_width; ++k)
      dy[k] = 1e-3f * y[k];
    attention.backward(0, false, dx.data());
    if (i >= warmup) ms.push_back(ms_since(begin));
  }
  return median(ms);
}

// One device's step, attention and convergence lines for Net (the baby
// GPT, or its weight-tied form), or with `tensor` the TensorParallel line.
template <class Net>
void run(const data::Split& split, const std::string& dump_path, std::size_t batch,
         std::size_t steps, std::size_t warmup, std::size_t threads, std::size_t train_steps,
         std::size_t tensor = 0) {
  const bool converge = train_steps > 0;
  Trainer<Net, SingleDevice, AdamW, PositionCrossEntropy> trainer(
      cpu_device(threads), AdamW::Options{.lr = 1e-3f, .weight_decay = 0.1f});
  if (!dump_path.empty()) dump(split, trainer.model().parameters(), dump_path);
  nlohmann::json line{{"library", "loom"},
                      {"network", Net::ties.empty() ? "baby_gpt" : "baby_gpt_tied"},
                      {"parameters", Net::unique_parameter_count},
                      {"batch", batch},
                      {"context", gpt_context},
                      {"threads", threads}};
  const FitOptions fit{.epochs = 1, .batch_size = batch, .shuffle = false};
  if (tensor > 0) {
    // Tensor parallelism's cost against one device, on the same cores.
    auto ranks = devices::cpu(tensor);
    for (auto& d : ranks) d.threads = static_cast<int>(std::max<std::size_t>(1, threads / tensor));
    const auto [one_ms, one_loss] =
        policy_step<SingleDevice>(cpu_device(threads), split, batch, warmup);
    const auto [split_ms, split_loss] =
        tensor == 2 ? policy_step<TensorParallel<2>>(ranks, split, batch, warmup)
                    : policy_step<TensorParallel<4>>(ranks, split, batch, warmup);
    line["benchmark"] = "gpt_tensor_step";
    line["steps"] = steps;
    line["tensor"] = tensor;
    line["single_device_ms"] = one_ms;
    line["tensor_parallel_ms"] = split_ms;
    line["tensor_vs_single"] = one_ms / split_ms;  // >1: TensorParallel faster
    line["loss_after"] = {{"single_device", one_loss}, {"tensor_parallel", split_loss}};
    std::cout << line.dump() << '\n';
    return;
  }
  if (converge) {
    const auto begin = Clock::now();
    trainer.fit(split.train,
                {.epochs = 1, .batch_size = batch, .shuffle = false, .max_grad_norm = 1.0f},
                WarmupCosine{});
    const double seconds = ms_since(begin) / 1e3;
    const EvalResult validation = trainer.evaluate(split.test);
    line["benchmark"] = "gpt_convergence";
    line["steps"] = train_steps;
    line["validation_windows"] = split.test.count;
    line["validation_loss"] = validation.loss;
    line["train_seconds"] = seconds;
    std::cout << line.dump() << '\n';
    return;
  }
  // The first batch's loss at the initial weights: PyTorch's side must
  // find the same (gpt.py --expect-initial-loss), or the networks differ.
  const double initial_loss = trainer.evaluate(data::head(split.train, batch)).loss;
  std::vector<double> ms, sgemm;
  trainer.fit(split.train, fit, StepTimes{.ms = &ms, .sgemm = &sgemm});
  const auto timed = static_cast<std::ptrdiff_t>(warmup);
  const double step_ms = median(std::vector<double>(ms.begin() + timed, ms.end()));
  // The median step's split: the step whose time is the median.
  std::size_t middle = static_cast<std::size_t>(timed);
  for (std::size_t i = middle; i < ms.size(); ++i)
    if (ms[i] == step_ms) middle = i;
  line["benchmark"] = "gpt_step";
  line["steps"] = steps;
  line["median_step_ms"] = step_ms;
  line["tokens_per_s"] = static_cast<double>(batch * gpt_context) / (step_ms / 1e3);
  line["sgemm_ms"] = sgemm[middle];
  line["other_ms"] = step_ms - sgemm[middle];
  line["initial_loss"] = initial_loss;
  std::cout << line.dump() << '\n';
  cpu::set_threads(static_cast<int>(threads));
  line["benchmark"] = "attention_step";
  line.erase("parameters");
  line.erase("tokens_per_s");
  line.erase("sgemm_ms");
  line.erase("other_ms");
  line.erase("initial_loss");
  line["network"] = "causal_self_attention";
  line["width"] = examples::gpt_width;
  line["heads"] = examples::gpt_heads;
  line["median_step_ms"] = attention_ms(split.train, batch, steps, warmup);
  std::cout << line.dump() << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  std::string corpus_dir = data::fortunes_dir, dump_path;
  std::size_t batch = 32, steps = 20, warmup = 3, threads = 1, train_steps = 0, tensor = 0;
  bool tied = false;
  CLI::App app{"loom's baby GPT (the gpt_fortunes example's network) on the CPU, JSON lines"};
  app.add_option("--data", corpus_dir, "folder of text files")->capture_default_str();
  app.add_option("--batch", batch, "windows a step")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--threads", threads)->capture_default_str();
  app.add_option("--train-steps", train_steps,
                 "train this many steps with the example's settings and report the validation "
                 "loss (instead of timing steps)");
  app.add_option("--dump", dump_path, "write the windows and initial weights for gpt.py");
  app.add_option("--tensor", tensor,
                 "instead: a step under TensorParallel<T> (2 or 4) on T worker devices of "
                 "--threads / T threads each, against SingleDevice on --threads, in one run")
      ->check(CLI::IsMember({2, 4}));
  app.add_flag("--tied", tied,
               "the network with its output head tied to its embedding (TiedLinear; nanoGPT's "
               "default), for the step and convergence lines");
  CLI11_PARSE(app, argc, argv);
  try {
    LOOM_CHECK(batch > 0 && steps > 0, "gpt_bench: --batch and --steps must be at least 1");
    const auto corpus = data::read_fortunes(corpus_dir);
    const bool converge = train_steps > 0;
    const std::size_t taken = converge ? train_steps : warmup + steps;
    const data::Split split = data::text_split(corpus, gpt_context, 1, taken * batch);
    if (tied) {
      LOOM_CHECK(tensor == 0, "gpt_bench: --tied times one device; not with --tensor");
      run<examples::BabyGptTied>(split, dump_path, batch, steps, warmup, threads, train_steps);
    } else {
      run<BabyGpt>(split, dump_path, batch, steps, warmup, threads, train_steps, tensor);
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
}
