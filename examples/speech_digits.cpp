// Speech recognition, the seed's third use case: connected digits ("one oh
// seven") read from 16 kHz WAV files, 80 log-mel bands every 10 ms, by a
// Conv1d front end (halving the frames), two bidirectional GRU layers and a
// Linear per frame into CTC. The data: a TSV of `path<TAB>transcript` per
// split (train.tsv, test.tsv) in --data, such as scripts/make-digits-corpus
// writes from espeak-ng, whose test voices and variants never occur in
// training. Prints the digit error rate (edits of the greedy decoding over
// the reference digits) and the sequence accuracy on the held-out voices.
// The LeNet example's command line, --policy single|data|split|hybrid and
// mpirun included; on GPUs where there are any (speech_gpu.cu registers its
// trainers' CUDA side; CTC's loss runs on the host from the last stage's
// output).
#include <cstdlib>
#include <filesystem>
#include <loom/data/audio.hpp>
#include <string>

#include "example_main.hpp"
#include "speech_network.hpp"

using namespace loom;

namespace {

using examples::DigitReader;
constexpr std::size_t max_frames = examples::speech_frames, classes = examples::speech_classes;

std::string default_corpus() {
  const char* cache = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::filesystem::path base =
      cache != nullptr && *cache != '\0' ? cache : std::string(home != nullptr ? home : ".") + "/.cache";
  return (base / "loom" / "digits").string();
}

data::Split load_digits(const examples::Options& o, std::ostream& out) {
  namespace fs = std::filesystem;
  const fs::path dir = o.data_dir;
  const fs::path train = dir / "train.tsv", test = dir / "test.tsv";
  LOOM_CHECK(fs::exists(train) && fs::exists(test), "no digits corpus in '", dir.string(),
             "' (train.tsv and test.tsv): make one with scripts/make-digits-corpus --out ",
             dir.string(), ", or pass --data DIR holding a corpus in that layout");
  data::CorpusOptions options{.max_frames = max_frames};
  data::CorpusCacheReport report;
  const auto read = [&](const fs::path& tsv) {
    auto corpus = data::read_tsv_corpus(tsv.string(), options, &report);
    out << tsv.string() << ": " << corpus.utterances.size() << " utterances"
        << (report.hit ? " (features from the cache)" : "") << '\n';
    return data::speech_dataset(corpus, max_frames, classes);
  };
  return {read(train), read(test)};
}

}  // namespace

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.data_dir = default_corpus();
  defaults.data_title = "connected digits";
  defaults.data_help = "folder with train.tsv and test.tsv (path<TAB>transcript) of 16 kHz mono WAVs";
  defaults.sample_word = "utterances";
  defaults.error_rate_name = "digit error rate";
  defaults.batch_size = 32;
  defaults.epochs = 8;
  defaults.optimizer = "adamw";
  defaults.lr = 0.002f;
  defaults.lr_schedule = "cosine";
  defaults.clip_norm = 5.0f;
  defaults.sequences = true;
  defaults.bucket = 20;  // batches of similar lengths: the GRU layers stop at a batch's longest
  return examples::example_main<DigitReader, void, CTCLoss>(argc, argv, "speech digits (CTC)",
                                                             defaults, load_digits);
}
