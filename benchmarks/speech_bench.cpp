// The speech example's training step on the CPU, JSON lines: its network
// (examples/speech_network.hpp: Conv1d, BatchNorm over time, two BiGRU
// layers, a Linear per frame), CTCLoss and AdamW, over real utterances of a
// digits corpus (scripts/make-digits-corpus) in batches of similar lengths
// (the first (warmup + steps) x batch utterances sorted by frames, cut into
// batches), the median step after the warm-up. --dump FILE writes those
// batches' features, lengths and targets for benchmarks/pytorch/speech.py,
// which times the same network in PyTorch on them
// (benchmarks/speech_vs_pytorch runs both).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <loom/data/audio.hpp>
#include <loom/loom.hpp>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "../examples/speech_network.hpp"

using namespace loom;
using examples::DigitReader;

namespace {

// The utterances `order` names, in that order, as a data set.
data::Dataset reorder(const data::Dataset& set, const std::vector<std::size_t>& order) {
  data::Dataset out = set;
  out.count = order.size();
  const std::size_t sample = set.sample_size();
  out.images.resize(order.size() * sample);
  out.targets.resize(order.size() * set.max_target);
  out.target_lengths.resize(order.size());
  out.frames.resize(order.size());
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::size_t i = order[k];
    std::copy_n(set.images.begin() + static_cast<std::ptrdiff_t>(i * sample), sample,
                out.images.begin() + static_cast<std::ptrdiff_t>(k * sample));
    std::copy_n(set.targets.begin() + static_cast<std::ptrdiff_t>(i * set.max_target),
                set.max_target,
                out.targets.begin() + static_cast<std::ptrdiff_t>(k * set.max_target));
    out.target_lengths[k] = set.target_lengths[i];
    out.frames[k] = set.frames[i];
  }
  return out;
}

// count, frames, mels, max_target (int64 each), then per utterance its
// features (frames x mels float32), its length and target length (int32)
// and its target (max_target int32).
void dump(const data::Dataset& set, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  LOOM_CHECK(out.good(), "speech_bench: cannot write --dump '", path, "'");
  const std::int64_t header[4] = {static_cast<std::int64_t>(set.count),
                                  static_cast<std::int64_t>(set.height),
                                  static_cast<std::int64_t>(set.width),
                                  static_cast<std::int64_t>(set.max_target)};
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  const std::size_t sample = set.sample_size();
  for (std::size_t i = 0; i < set.count; ++i) {
    out.write(reinterpret_cast<const char*>(set.images.data() + i * sample),
              static_cast<std::streamsize>(sample * sizeof(float)));
    const std::int32_t lengths[2] = {set.frames[i], set.target_lengths[i]};
    out.write(reinterpret_cast<const char*>(lengths), sizeof lengths);
    out.write(reinterpret_cast<const char*>(set.targets.data() + i * set.max_target),
              static_cast<std::streamsize>(set.max_target * sizeof(std::int32_t)));
  }
  LOOM_CHECK(out.good(), "speech_bench: writing --dump '", path, "' failed");
}

// Each step's wall time, from its first batch to its end.
struct StepTimes {
  void on_step_begin(const StepBegin&) { begin = std::chrono::steady_clock::now(); }
  void on_step(const StepInfo&) {
    ms->push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
            .count());
  }
  std::vector<double>* ms;
  std::chrono::steady_clock::time_point begin{};
};

}  // namespace

int main(int argc, char** argv) {
  std::string corpus, dump_path;
  std::size_t batch = 32, steps = 10, warmup = 2, threads = 1;
  CLI::App app{"loom's speech-digits training step (CTC) on the CPU, JSON lines"};
  app.add_option("--data", corpus, "digits corpus folder (train.tsv)")->required();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--threads", threads)->capture_default_str();
  app.add_option("--dump", dump_path, "write the batches for benchmarks/pytorch/speech.py");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto speech = data::read_tsv_corpus(corpus + "/train.tsv",
                                              {.max_frames = examples::speech_frames});
    const auto all = data::speech_dataset(speech, examples::speech_frames,
                                          examples::speech_classes);
    const std::size_t count = (warmup + steps) * batch;
    LOOM_CHECK(all.count >= count, "speech_bench: ", corpus, " has ", all.count,
               " utterances; ", count, " needed for ", warmup + steps, " steps of ", batch);
    std::vector<std::size_t> order(count);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return all.frames[a] < all.frames[b]; });
    const data::Dataset batches = reorder(all, order);
    if (!dump_path.empty()) dump(batches, dump_path);
    auto devices = devices::cpu(1);
    devices.front().threads = static_cast<int>(threads);
    Trainer<DigitReader, SingleDevice, AdamW, CTCLoss> trainer(devices, {.lr = 0.002f});
    std::vector<double> ms;
    trainer.fit(batches, {.epochs = 1, .batch_size = batch, .shuffle = false},
                StepTimes{.ms = &ms});
    std::vector<double> timed(ms.begin() + static_cast<std::ptrdiff_t>(warmup), ms.end());
    std::sort(timed.begin(), timed.end());
    const double median = timed[timed.size() / 2];
    double frames = 0;
    for (const auto f : batches.frames) frames += f;
    std::cout << nlohmann::json{{"benchmark", "speech_step"},
                                {"library", "loom"},
                                {"network", "DigitReader"},
                                {"parameters", DigitReader::parameter_count},
                                {"batch", batch},
                                {"threads", threads},
                                {"steps", steps},
                                {"median_step_ms", median},
                                {"mean_frames", frames / static_cast<double>(batches.count)}}
                     .dump()
              << '\n';
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
}
