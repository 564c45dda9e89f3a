// The examples' command line, parsed in a translation unit of its own
// (example_cli.cpp): CLI11 is compiled once for every example, not once per
// network type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <loom/core/error.hpp>
#include <loom/data/dataset.hpp>
#include <optional>
#include <string>
#include <vector>

namespace loom::examples {

struct Options {
  int epochs = 10;
  std::size_t batch_size = 64;
  float lr = 0.01f;
  float momentum = 0.9f;
  std::string data_dir = data::default_fashion_mnist_dir;
  std::uint64_t seed = 0;
  std::vector<int> lr_milestones{7};
  float lr_factor = 0.1f;
  int devices = 1;
  bool devices_given = false;  // --devices on the command line (else: every GPU found)
  std::string policy;  // empty: by the device count
  std::string schedule = "1f1b";
  std::size_t micro_batches = 4;
  int replicas = 2;
  int tensor = 1;  // the GPT's tensor degree (TensorParallel), 1: none
  bool tie_weights = false;  // the GPT's output head tied to its embedding (TiedLinear)
  std::size_t train_samples = 0;  // 0: all (short runs take the first ones)
  std::size_t test_samples = 0;
  float weight_decay = 0.0f;
  bool augment = false;   // random crops (padding 2, or 4 on CIFAR-10) and flips
  std::string cifar_dir;  // examples with a CIFAR-10 network: train on CIFAR-10 instead
  std::string optimizer = "sgd";  // or adamw
  std::string lr_schedule = "step";  // MultiStepLR by --lr-milestones, or cosine
  std::size_t warmup_steps = 0;
  std::size_t lr_reference_batch = 0;  // > 0: --lr is for this global batch, scaled linearly
  float clip_norm = 0.0f;
  std::string on_nonfinite = "raise";
  std::size_t accumulation = 1;
  // Sequence examples (set by the example; their flags exist only then):
  // batches bucketed by length, this many per bucket (0: off), and
  // SpecAugment's masks on the training features.
  bool sequences = false;
  std::size_t bucket = 0;
  bool spec_augment = false;
  // Text examples (set by the example; their flags exist only then):
  // --steps draws steps x batch x accumulation training windows (0: the
  // training text's length in contexts), --eval-every evaluates the
  // validation text every so many steps, and the sample printed at the end
  // (--sample-bytes, --temperature, --top-k). Reports give the perplexity.
  bool text = false;
  std::size_t steps = 0;
  std::size_t eval_every = 0;
  std::size_t sample_bytes = 300;
  float temperature = 0.8f;
  std::size_t top_k = 40;
  std::string precision = "fp32";
  std::string checkpoint;  // save here after each epoch (and every --checkpoint-every steps)
  std::size_t checkpoint_every = 0;
  std::string resume;   // load this checkpoint first and go on from where it stopped
  std::string metrics;  // JSON lines of every step and epoch
  // Set by the example, not parsed: what --data holds and its samples are
  // called, and the name of the loss's error rate where it has one.
  std::string data_title = "Fashion-MNIST";
  std::string data_help = "folder with the Fashion-MNIST IDX files (.gz or plain)";
  std::string sample_word = "images";
  std::string error_rate_name = "error rate";
};

// The ranks this process runs without mpirun: --devices, or one per GPU
// found where there are any and --devices was not given (not for --policy
// single, which runs on one device).
int process_ranks(const Options& o);

// What parsing the command line came to: `status` 0 to go on (or, with
// `help`, to end after --help printed the usage); else 2, the exit status
// of a refused command line, after the refusal was printed.
struct CommandLine {
  int status = 0;
  bool help = false;
  double collective_timeout = 0.0;  // when parsed under MPI
  bool collective_timeout_given = false;
};

// Parses argv into `o` (which holds the example's defaults). `cifar`: the
// example offers --cifar; `distributed`: it runs under mpirun;
// `timeout_default`: under MPI, --collective-timeout's default (the
// option exists only then).
CommandLine parse_command_line(int argc, char** argv, const char* title, Options& o, bool cifar,
                               bool distributed, std::optional<double> timeout_default);

// A checkpoint that --resume refuses, in the command line's words: the flag
// whose value differs from the run that wrote it, where there is one.
Error resume_refusal(const ResumeMismatch& refused, const Options& o);

}  // namespace loom::examples
