// GPT-2 small (12 pre-norm transformer blocks of 12 heads, width 768,
// context 1024, a vocabulary of 50257, the head tied to the embedding: 124 M
// parameters) trained on one GPU by the Trainer, as a user runs it:
// SingleDevice, AdamW, PositionCrossEntropy on the device, the tied pair's
// gradients summed on the device, each batch of windows copied from host
// memory. The windows are Debian's fortunes as bytes (ids below 256 of the
// 50257: the time does not depend on which ids), each step a new batch.
// --untied: the head a Linear of its own (163 M parameters).
// benchmarks/pytorch/gpt2.py builds the same network and times it eager and
// under torch.compile.
//
// One JSON line per precision: "benchmark" gpt2_small_<precision>, "batch"
// the windows a step, "metric" tokens_per_s and its "value" (the median
// step's), the median step in ms, the first timed step's loss, and the GPU.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <loom/data/text.hpp>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpu_bench.cuh"

namespace {

using namespace loom;

constexpr std::size_t context = 1024, width = 768, heads = 12, vocab = 50257;
using Block = TransformerBlock<heads>;
template <class Head>
using Gpt2 = Sequential<Input<context>, Embedding<vocab, width>, PositionEmbedding, Block, Block,
                        Block, Block, Block, Block, Block, Block, Block, Block, Block, Block,
                        LayerNorm, Head>;
using Gpt2Small = Gpt2<TiedLinear<vocab>>;
using Gpt2Untied = Gpt2<Linear<vocab>>;

using Clock = std::chrono::steady_clock;

struct StepTimes {
  std::vector<double>* ms;
  std::vector<double>* losses;
  Clock::time_point begin{};
  void on_step_begin(const StepBegin&) { begin = Clock::now(); }
  void on_step(const StepInfo& step) {
    ms->push_back(std::chrono::duration<double, std::milli>(Clock::now() - begin).count());
    losses->push_back(step.loss);
  }
};

template <class Net>
nlohmann::json measure(const data::Split& split, const std::string& precision, std::size_t batch,
                       std::size_t warmup) {
  TrainerOptions options{.seed = 1};
  options.precision = precision == "bf16"   ? Precision::bf16
                      : precision == "fp16" ? Precision::fp16
                                            : Precision::fp32;
  options.allow_tf32 = precision == "tf32";
  Trainer<Net, SingleDevice, AdamW, PositionCrossEntropy> trainer(
      {devices::gpus().front()}, AdamW::Options{.lr = 3e-4f, .weight_decay = 0.1f}, options);
  std::vector<double> ms, losses;
  trainer.fit(split.train, {.epochs = 1, .batch_size = batch, .shuffle = false},
              StepTimes{&ms, &losses});
  LOOM_CHECK(ms.size() > warmup, "gpt2_gpu_bench: ", ms.size(), " steps ran, none timed after ",
             warmup, " warm-up steps");
  std::vector<double> timed(ms.begin() + static_cast<std::ptrdiff_t>(warmup), ms.end());
  std::sort(timed.begin(), timed.end());
  const double median = timed[timed.size() / 2];
  const bool tied = !Net::ties.empty();
  return {{"benchmark", std::string(tied ? "gpt2_small_" : "gpt2_small_untied_") + precision},
          {"library", "loom"},
          {"batch", batch},
          {"context", context},
          {"parameters", Net::unique_parameter_count},
          {"metric", "tokens_per_s"},
          {"value", static_cast<double>(batch * context) / (median / 1e3)},
          {"median_step_ms", median},
          {"steps", timed.size()},
          {"first_timed_loss", losses[warmup]},
          {"gpu", bench::gpu_name()}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string corpus_dir = data::fortunes_dir;
  std::size_t batch = 8, steps = 10, warmup = 3;
  std::vector<std::string> precisions{"bf16"};
  bool untied = false;
  CLI::App app{"GPT-2 small's training step on one GPU (loom's Trainer), JSON lines"};
  app.add_option("--data", corpus_dir, "folder of text files")->capture_default_str();
  app.add_option("--batch", batch, "windows of 1024 bytes a step")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--precision", precisions, "fp32, tf32, bf16 or fp16 (several: one line each)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_flag("--untied", untied, "the head a Linear of its own, not tied to the embedding");
  CLI11_PARSE(app, argc, argv);
  try {
    LOOM_CHECK(batch > 0 && steps > 0, "gpt2_gpu_bench: --batch and --steps must be at least 1");
    LOOM_CHECK(!devices::gpus().empty(), "gpt2_gpu_bench: no GPU found");
    const data::Split split = data::text_split(data::read_fortunes(corpus_dir), context, 1,
                                               (warmup + steps) * batch);
    for (const auto& precision : precisions)
      std::cout << (untied ? measure<Gpt2Untied>(split, precision, batch, warmup)
                           : measure<Gpt2Small>(split, precision, batch, warmup))
                       .dump()
                << std::endl;
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
}
