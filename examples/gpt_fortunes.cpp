// A GPT trained on real text: nanoGPT's "baby GPT" (4 pre-norm blocks of
// 4-head causal self-attention and a GELU MLP, width 128, context 64) over
// the bytes of Debian's fortunes, predicting each next byte. Prints the
// validation loss and perplexity (nats per byte, and their exp) as it
// trains (--eval-every N steps, and at each epoch's end), then text the
// trained model writes after a prompt from the validation text
// (--sample-bytes, --temperature, --top-k).
// The LeNet example's command line, --policy single|data|split|hybrid and
// mpirun included, and tensor parallelism: --policy tensor splits each
// block's heads and MLP and the vocabulary over --tensor 2 or 4 devices
// (or processes), and --tensor T with data, split or hybrid lays the rest
// out as replicas or stages (mpirun -np 4 ... --policy data --tensor 2:
// data 2 x tensor 2). --steps N takes N batches of windows drawn from the
// training text; --tie-weights ties the output head's weight to the
// embedding's (under --policy tensor the head then runs whole on every
// rank). Where GPUs are found it trains on them, every policy and tensor
// degree included (gpt_gpu.cu registers its trainers' CUDA side).
#include <loom/data/text.hpp>

#include "example_main.hpp"
#include "gpt_network.hpp"

using namespace loom;

namespace {

using examples::BabyGpt;

data::Split load_fortunes(const examples::Options& o, std::ostream& out) {
  const auto corpus = data::read_fortunes(o.data_dir);
  out << o.data_dir << ": " << corpus.text.size() << " bytes of text in " << corpus.files.size()
      << " files\n";
  return data::text_split(corpus, examples::gpt_context, o.seed,
                          o.steps * o.batch_size * o.accumulation);
}

}  // namespace

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.data_dir = data::fortunes_dir;
  defaults.data_title = "Debian's fortunes";
  defaults.data_help = "folder of text files (Debian's fortunes package: its fortune files)";
  defaults.sample_word = "windows";
  defaults.text = true;
  defaults.epochs = 1;
  defaults.steps = 2000;
  defaults.eval_every = 250;
  defaults.batch_size = 32;
  defaults.optimizer = "adamw";
  defaults.lr = 1e-3f;
  defaults.weight_decay = 0.1f;
  defaults.lr_schedule = "cosine";
  defaults.warmup_steps = 100;
  defaults.clip_norm = 1.0f;
  return examples::example_main<BabyGpt, void, PositionCrossEntropy, examples::BabyGptTied>(
      argc, argv, "a baby GPT (next byte)", defaults, load_fortunes);
}
