// The examples' command line (see example_cli.hpp).
#include "example_cli.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <loom/core/device.hpp>
#include <string_view>

namespace loom::examples {
namespace {

// A path option's value that starts with '-' is a forgotten value that
// swallowed the next flag (--checkpoint --augment); a file of such a name
// is still reachable as ./--augment.
CLI::Validator path_value() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (value.empty()) return "an empty path";
        if (value.front() != '-') return {};
        return "'" + value + "' looks like a flag, not a path: is this option's value "
               "missing? (a path that starts with '-' is written ./" + value + ")";
      },
      "PATH");
}

// A number in [low, high] (or (low, high] when low is open), with a message
// that prints both bounds as numbers ("1e-08", not "0.000000") and says
// when the value is not a number at all.
CLI::Validator number_between(double low, double high, bool low_open = false) {
  const auto text = [](double x) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%g", x);
    return std::string(buffer);
  };
  const std::string range =
      std::string(low_open ? "above " : "from ") + text(low) + (low_open ? " up to " : " to ") +
      text(high);
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(value.c_str(), &end);
        if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(x))
          return "'" + value + "' is not a number; give one " + range;
        if (x < low || (low_open && x == low) || x > high)
          return value + " is out of range; give a number " + range;
        return {};
      },
      "NUMBER " + range);
}

// Options that would have no effect with the others given: refused, so
// that nothing typed is silently ignored.
void check_combinations(const CLI::App& app, const Options& o, bool distributed) {
  const auto given = [&](const char* flag) { return app.count(flag) > 0; };
  const auto refuse = [](const char* flag, const std::string& why) {
    throw CLI::ValidationError(flag, why);
  };
  if (given("--checkpoint-every") && !given("--checkpoint"))
    refuse("--checkpoint-every", "needs --checkpoint (the file it saves to)");
  const bool pipelined = o.policy == "split" || o.policy == "hybrid";
  for (const char* flag : {"--schedule", "--micro-batches"})
    if (given(flag) && !pipelined)
      refuse(flag, "applies to --policy split and hybrid only (this run's policy is " +
                       (!o.policy.empty()                     ? o.policy
                        : distributed || process_ranks(o) > 1 ? "data"
                                                              : "single") +
                       ")");
  if (given("--replicas") && o.policy != "hybrid")
    refuse("--replicas", "applies to --policy hybrid only");
  // --tensor is the GPT example's alone (o.text): elsewhere it is no option at all.
  if (o.text && given("--tensor") && o.tensor > 1 && o.policy == "single")
    refuse("--tensor", "splits layers over several devices; --policy single runs on one");
  if (given("--momentum") && o.optimizer == "adamw")
    refuse("--momentum", "is SGD's; --optimizer adamw has no momentum (its moments are built in)");
  for (const char* flag : {"--lr-milestones", "--lr-factor"})
    if (given(flag) && o.lr_schedule == "cosine")
      refuse(flag, "applies to --lr-schedule step only; cosine follows its own curve");
  if (given("--data") && !o.cifar_dir.empty())
    refuse("--data", "is the Fashion-MNIST folder; with --cifar the data come from there");
}

}  // namespace

int process_ranks(const Options& o) {
  const std::size_t gpus = devices::gpus().size();
  return gpus > 0 && !o.devices_given && o.policy != "single" ? static_cast<int>(gpus) : o.devices;
}

CommandLine parse_command_line(int argc, char** argv, const char* title, Options& o, bool cifar,
                               bool distributed, std::optional<double> timeout_default) {
  CLI::App app{std::string("Train ") + title + " on " + o.data_title + " with loom"};
  app.add_option("--epochs", o.epochs, "passes over the training set")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "samples per step (the global batch)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (the base the schedule scales)")
      ->check(number_between(1e-8, 100.0))
      ->capture_default_str();
  app.add_option("--lr-milestones", o.lr_milestones, "epochs after which the learning rate drops")
      ->capture_default_str();
  app.add_option("--lr-factor", o.lr_factor, "learning-rate multiplier at each milestone")
      ->check(number_between(1e-6, 1.0))
      ->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")
      ->check(number_between(0.0, 0.999))
      ->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "weight decay (SGD: L2; AdamW: decoupled)")
      ->check(number_between(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--optimizer", o.optimizer,
                 "sgd (with --momentum) or adamw (--weight-decay is then AdamW's decoupled decay)")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--lr-schedule", o.lr_schedule,
                 "step (x --lr-factor after each of --lr-milestones) or cosine (over the whole run)")
      ->check(CLI::IsMember({"step", "cosine"}))
      ->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps,
                 "ramp the learning rate up linearly from a tenth over this many steps")
      ->capture_default_str();
  app.add_option("--lr-reference-batch", o.lr_reference_batch,
                 "--lr is for this global batch: scale it linearly with the real one (0: off)")
      ->capture_default_str();
  app.add_option("--clip-norm", o.clip_norm,
                 "clip the gradients to this global norm (0: off)")
      ->check(number_between(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--on-nonfinite", o.on_nonfinite,
                 "a step whose loss or gradients go NaN or infinite: raise (stop with an error "
                 "naming the step and layer) or skip it (CPU devices)")
      ->check(CLI::IsMember({"raise", "skip"}))
      ->capture_default_str();
  if (o.sequences) {
    app.add_option("--bucket", o.bucket,
                   "batches per bucket of similar lengths (0: no bucketing)")
        ->capture_default_str();
    app.add_flag("--spec-augment", o.spec_augment,
                 "SpecAugment's masks on the training features: 2 bands of up to 15 mels and 2 "
                 "spans of up to 40 frames, drawn per (seed, epoch, utterance)");
  }
  if (o.text) {
    app.add_option("--steps", o.steps,
                   "optimizer steps an epoch takes: that many batches of windows drawn from the "
                   "training text (0: as many windows as the text holds contexts)")
        ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30))
        ->capture_default_str();
    app.add_option("--eval-every", o.eval_every,
                   "evaluate the validation text every this many steps (0: at each epoch's end)")
        ->capture_default_str();
    app.add_option("--sample-bytes", o.sample_bytes,
                   "bytes of text the trained model writes at the end (0: none)")
        ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20))
        ->capture_default_str();
    app.add_option("--temperature", o.temperature, "the sample's softmax temperature")
        ->check(number_between(0.0, 100.0, true))
        ->capture_default_str();
    app.add_option("--top-k", o.top_k,
                   "the sample draws from the k likeliest bytes (0: from all of them)")
        ->capture_default_str();
  }
  app.add_option("--accumulate", o.accumulation,
                 "batches per optimizer step (gradient accumulation)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--precision", o.precision,
                 "fp32, bf16 or fp16 (fp32 master weights; fp16 with dynamic loss scaling); "
                 "on the CPU bf16 and fp16 are emulated by rounding")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--checkpoint", o.checkpoint,
                 "save a checkpoint (safetensors) here after every epoch and at the end")
      ->check(path_value());
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "also save it every N optimizer steps")
      ->capture_default_str();
  app.add_option("--resume", o.resume,
                 "load this checkpoint and go on from where it stopped (same data options)")
      ->check(path_value());
  app.add_option("--metrics", o.metrics,
                 "write every step's and epoch's figures here as JSON lines "
                 "(draw them: python3 scripts/plot_metrics.py FILE)")
      ->check(path_value());
  app.add_flag("--augment", o.augment,
               "random crops (zero padding 2, or 4 on CIFAR-10) and horizontal flips of the "
               "training images, drawn from --seed");
  if (cifar)
    app.add_option("--cifar", o.cifar_dir,
                   "train on CIFAR-10 instead: the folder of its binary version "
                   "(cifar-10-batches-bin)")
        ->check(path_value());
  app.add_option("--data", o.data_dir, o.data_help)
      ->check(path_value())
      ->capture_default_str();
  const bool images = o.sample_word == "images";
  app.add_option("--train-samples", o.train_samples,
                 "train on the first N training " + o.sample_word + " only (0: all" +
                     (images ? " 60000)" : ")"))
      ->capture_default_str();
  app.add_option("--test-samples", o.test_samples,
                 "evaluate on the first N test " + o.sample_word + " only (0: all" +
                     (images ? " 10000)" : ")"))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed for weights and data order")->capture_default_str();
  app.add_option("--devices", o.devices,
                 "ranks in this process for --policy data, split, hybrid or tensor: N CPU "
                 "worker devices (default 1: one device with every core), or N ranks spread "
                 "over the GPUs (default: one per GPU found); under mpirun each process's (1: "
                 "the process is one rank; N: N CPU ranks on threads of their own)")
      ->check(CLI::Range(1, 1024));
  if (o.text) {
    app.add_option("--policy", o.policy,
                   "single, data (DataParallel), split (ModelSplit, a pipeline of --devices "
                   "balanced stages), hybrid (--replicas pipelines sharing --devices) or tensor "
                   "(each block's heads, MLP and the vocabulary split over --tensor devices, "
                   "default all); data, split and hybrid split over --tensor too; default: single "
                   "for one device, data for more")
        ->check(CLI::IsMember({"single", "data", "split", "hybrid", "tensor"}));
    app.add_option("--tensor", o.tensor,
                   "tensor degree (TensorParallel): the devices (or processes) that split each "
                   "layer, 1, 2 or 4; the others form data replicas or pipeline stages")
        ->check(CLI::IsMember({1, 2, 4}))
        ->capture_default_str();
    app.add_flag("--tie-weights", o.tie_weights,
                 "the output head's weight is the token embedding's (weight tying, GPT-2's "
                 "and nanoGPT's), one tensor trained from both");
  } else {
    app.add_option("--policy", o.policy,
                   "single, data (DataParallel), split (ModelSplit, a pipeline of --devices "
                   "balanced stages) or hybrid (--replicas pipelines sharing --devices); default: "
                   "single for one device, data for more")
        ->check(CLI::IsMember({"single", "data", "split", "hybrid"}));
  }
  app.add_option("--replicas", o.replicas, "pipelines of --policy hybrid")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--schedule", o.schedule, "pipeline schedule of --policy split or hybrid")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches,
                 "micro-batches per step (of each pipeline) of --policy split or hybrid")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  // Under MPI: --collective-timeout, which defaults to the environment's.
  double collective_timeout = timeout_default.value_or(0.0);
  if (timeout_default)
    app.add_option("--collective-timeout", collective_timeout,
                   "under mpirun: seconds a rank waits for the others in a collective before it "
                   "raises and the job is aborted (a rank died or hangs); default: "
                   "LOOM_COLLECTIVE_TIMEOUT, else 600")
        ->check(number_between(0.001, 1e8));

  CommandLine result;
  try {
    app.parse(argc, argv);
    o.devices_given = app.count("--devices") > 0;
    check_combinations(app, o, distributed);
  } catch (const CLI::ParseError& error) {
    result.help = error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success);
    // app.exit prints the usage or the refusal; its status is CLI11's own
    // (105, 109, ...), so a refusal exits with 2 instead, as Unix tools do,
    // and stays apart from a run-time error's 1.
    app.exit(error);
    result.status = result.help ? 0 : 2;
  }
  result.collective_timeout = collective_timeout;
  result.collective_timeout_given = timeout_default && app.count("--collective-timeout") > 0;
  return result;
}

Error resume_refusal(const ResumeMismatch& refused, const Options& o) {
  struct Flag {
    const char* setting;
    const char* flag;
  };
  static constexpr Flag flags[] = {{"samples", "--train-samples"},
                                   {"batch_size", "--batch-size"},
                                   {"accumulation_steps", "--accumulate"},
                                   {"seed", "--seed"},
                                   {"augment.crop_padding", "--augment"},
                                   {"augment.horizontal_flip", "--augment"},
                                   {"momentum", "--momentum"},
                                   {"weight_decay", "--weight-decay"}};
  std::string text = "loom: --resume " + o.resume + ": ";
  const auto* flag =
      std::ranges::find_if(flags, [&](const Flag& f) { return refused.setting == f.setting; });
  if (flag == std::end(flags)) {
    text += "the checkpoint was written with " + refused.setting + " " + refused.was +
            " and this run has " + refused.now +
            ", which no flag of this example sets; it "
            "was written by another program";
  } else if (std::string_view(flag->flag) == "--augment") {
    const bool was = refused.was != "0" && refused.was != "false";
    text += std::string("the checkpoint was written by a run ") + (was ? "with" : "without") +
            " --augment, and this run is " + (was ? "without" : "with") + " it; resume " +
            (was ? "with" : "without") + " --augment";
  } else {
    const bool images = std::string_view(flag->flag) == "--train-samples";
    text += std::string("the checkpoint was written by a run with ") + flag->flag + " " +
            refused.was + (images ? " (training images)" : "") + ", and this run has " +
            refused.now + "; resume with " + flag->flag + " " + refused.was;
  }
  return Error(text +
               " (a resumed run takes the data, batch and optimizer flags of the run "
               "that wrote the checkpoint; --epochs and --lr may differ)");
}

}  // namespace loom::examples
