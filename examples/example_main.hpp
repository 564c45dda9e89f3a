// What the examples share: the command line, the choice of policy and
// devices, and training with progress and the final test accuracy. Each
// example names its network and its defaults and calls example_main.
//
// Each example has a CUDA side (<example>_gpu.cu): where GPUs are found
// its ranks run on them, --devices ranks spread over the GPUs round-robin
// (every GPU found without --devices), else on --devices CPU worker devices.
//
//   --policy single   one device: the first GPU where there is one, else
//                     the CPU
//   --policy data     DataParallel<> over the ranks, or over the processes
//                     of mpirun (one device each, or --devices worker
//                     devices each: the ranks are threads of several
//                     processes)
//   --policy split    a pipeline of S = --devices balanced stages (2 to 4)
//                     over the ranks, or the S ranks of mpirun's processes
//                     x --devices (CPU), with --schedule gpipe|1f1b and
//                     --micro-batches M
//   --policy hybrid   R = --replicas pipelines of S = --devices / R stages
//                     (2 to 4) over the ranks, or over mpirun's processes
//                     x --devices (CPU)
//   --policy tensor   (the GPT) TensorParallel<T, DataParallel<>>: each
//                     layer that splits over --tensor T ranks or
//                     processes (default all), the rest data replicas;
//                     --tensor T with data, split or hybrid splits their
//                     ranks' layers the same way (TensorParallel<T, ...>)
// Split and hybrid are one trainer type, PipelinePolicy (example_trainers.hpp): its
// Balanced<2, 3, 4> carries the three cuts, and R and S are run-time values.
// Without --policy: single for one device, data for more, data under mpirun.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <loom/loom.hpp>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "example_cli.hpp"
#include "example_trainers.hpp"

namespace loom::examples {

// The learning rate the command line asks for, before every step: --lr
// times a warm-up ramp (--warmup-steps, from a tenth), times the cosine or
// the milestones' factors, times global batch / --lr-reference-batch.
struct ExampleSchedule {
  const Options* o;
  std::ostream* out;

  double factor(const StepBegin& step) const {
    const std::size_t warmup = o->warmup_steps;
    double f = o->lr_schedule == "cosine"
                   ? schedules::Warmup<schedules::Cosine>{warmup, 0.1, {}}(step.fit_step,
                                                                           step.total_steps)
                   : schedules::Warmup<>{warmup, 0.1, {}}(step.fit_step, step.total_steps) *
                         milestones().lr_in(step.epoch, 1.0f);
    if (o->lr_reference_batch > 0)
      f *= static_cast<double>(step.global_batch) / static_cast<double>(o->lr_reference_batch);
    return f;
  }
  callbacks::MultiStepLR milestones() const {
    return {.milestones = o->lr_milestones, .factor = o->lr_factor, .out = out};
  }

  void on_fit_prepare(const FitInfo&, Fingerprint& fingerprint) const {
    fingerprint.add("--lr-schedule", o->lr_schedule)
        .add("--warmup-steps", o->warmup_steps)
        .add("--lr-reference-batch", o->lr_reference_batch);
    if (o->lr_schedule != "cosine")
      fingerprint.add("--lr-milestones", o->lr_milestones).add("--lr-factor", o->lr_factor);
  }

  template <class T>
  void on_step_begin(const StepBegin& step, T& trainer) {
    trainer.optimizer().set_lr(static_cast<float>(trainer.base_lr() * factor(step)));
  }
  template <class T>
  void on_epoch_end(const EpochInfo& epoch, T& trainer) {
    if (o->lr_schedule != "cosine") milestones().on_epoch_end(epoch, trainer);
  }
};

// A callback the command line may leave out (--checkpoint, --metrics).
// One that takes part in the processes' fingerprint says when it is absent.
template <class C>
struct Maybe {
  std::optional<C> c;
  const char* name = "";
  template <class T>
  void on_fit_prepare(const FitInfo& info, Fingerprint& fingerprint, T& trainer) {
    if constexpr (requires { c->on_fit_prepare(info, fingerprint, trainer); }) {
      if (c)
        c->on_fit_prepare(info, fingerprint, trainer);
      else
        fingerprint.add(name, "none");
    }
  }
  template <class T>
  void on_fit_begin(const FitInfo& info, T& trainer) {
    if constexpr (requires { c->on_fit_begin(info, trainer); }) {
      if (c) c->on_fit_begin(info, trainer);
    } else if constexpr (requires { c->on_fit_begin(info); }) {
      if (c) c->on_fit_begin(info);
    }
  }
  template <class T>
  void on_step(const StepInfo& info, T& trainer) {
    if (c) c->on_step(info, trainer);
  }
  // A Checkpoint's saves: a GPU reads the step before the next one runs.
  bool needs_state_at_step(std::uint64_t steps) const {
    if constexpr (requires { c->needs_state_at_step(steps); })
      return c && c->needs_state_at_step(steps);
    else
      return false;
  }
  template <class T>
  void on_epoch_end(const EpochInfo& info, T& trainer) {
    if (c) c->on_epoch_end(info, trainer);
  }
  template <class T>
  void on_fit_end(T& trainer) {
    if constexpr (requires { c->on_fit_end(trainer); })
      if (c) c->on_fit_end(trainer);
  }
};

inline Precision precision_of(const std::string& name) {
  return name == "bf16" ? Precision::bf16 : name == "fp16" ? Precision::fp16 : Precision::fp32;
}

// What train() does alike for every trainer type, written once (the example
// builds five): its first lines, its options, its last lines.

// What trains, on what and how; `policy` as the example names it (a
// pipeline with its grid, schedule and cut).
inline void describe_run(std::ostream& out, const char* title, const Options& o,
                         const data::Split& data, std::size_t parameters,
                         const std::string& policy, const std::vector<Device>& devices,
                         const comm::Comm& processes) {
  const bool cifar = data.train.channels == 3;
  out << "loom " << title << " on " << (cifar ? "CIFAR-10" : o.data_title) << ": " << parameters
      << " parameters, " << data.train.count << " training and " << data.test.count << " test "
      << o.sample_word << ", " << policy;
  if (processes)
    out << " over " << processes.size() << " processes, process " << processes.rank();
  out << " on";
  for (const auto& device : devices) {
    out << ' ' << device.name();
    if (device.kind == Device::Kind::cpu) out << " (" << device.threads << " threads)";
  }
  out << "; " << o.optimizer << ", " << o.precision << '\n';
  const bool on_cpu = std::ranges::any_of(
      devices, [](const Device& device) { return device.kind == Device::Kind::cpu; });
  if (const auto note = cpu::blas_kernels_note(); on_cpu && !note.empty())
    out << "note: " << note << '\n';
}

// `pipelined`: --schedule and --micro-batches count.
inline TrainerOptions trainer_options(const Options& o, bool pipelined) {
  TrainerOptions options{.seed = o.seed, .precision = precision_of(o.precision)};
  if (pipelined) {
    options.schedule = {o.schedule == "gpipe" ? PipelineKind::gpipe : PipelineKind::one_f_one_b,
                        o.micro_batches};
    options.replicas = o.policy == "hybrid" ? static_cast<std::size_t>(std::max(1, o.replicas)) : 1;
  }
  return options;
}

inline AnyOptimizer::Options optimizer_options(const Options& o) {
  if (o.optimizer == "adamw") return AdamW::Options{.lr = o.lr, .weight_decay = o.weight_decay};
  return SGD::Options{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay};
}

inline FitOptions fit_options(const Options& o, bool cifar) {
  data::Augment augment;
  if (o.augment) augment = {.crop_padding = cifar ? 4u : 2u, .horizontal_flip = true};
  if (o.spec_augment) augment.spec = data::SpecAugmentOptions{};
  return {.epochs = o.epochs,
          .batch_size = o.batch_size,
          .seed = o.seed,
          .accumulation_steps = o.accumulation,
          .augment = augment,
          .bucket = o.bucket,
          .max_grad_norm = o.clip_norm,
          .on_nonfinite = o.on_nonfinite == "skip" ? NonFinite::skip : NonFinite::raise};
}

// The steps a fit skipped (fp16's overflows, non-finite steps), then the
// final test accuracy.
inline void report_run(std::ostream& out, const Options& o, const EvalResult& last,
                       Precision precision, std::uint64_t overflows, float loss_scale,
                       std::uint64_t nonfinite, std::chrono::steady_clock::time_point started) {
  if (precision == Precision::fp16)
    out << "fp16: " << overflows << " step(s) skipped for overflow, loss scale " << loss_scale
        << '\n';
  if (nonfinite > 0) out << nonfinite << " step(s) skipped for a non-finite loss or gradient\n";
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  char line[200];
  if (o.text)
    std::snprintf(line, sizeof line,
                  "final validation loss: %.4f (perplexity %.2f), next-byte accuracy %.2f%% after "
                  "%d epoch(s), %.1f s\n",
                  last.loss, std::exp(last.loss), 100.0 * last.accuracy, o.epochs, seconds);
  else
    std::snprintf(line, sizeof line,
                  "final test accuracy: %.2f%% (loss %.4f) after %d epoch(s), %.1f s\n",
                  100.0 * last.accuracy, last.loss, o.epochs, seconds);
  out << line;
  if (last.error_rate) {
    std::snprintf(line, sizeof line, "final test %s: %.2f%%\n", o.error_rate_name.c_str(),
                  100.0 * *last.error_rate);
    out << line;
  }
}

// A network that reads token ids and ends in logits per position (a GPT):
// the trained model can write text.
template <class Net>
concept TextModel = requires { type_at_t<0, typename Net::executed>::takes_ids; } &&
                    Net::output_shape::rank == 2;

// --sample-bytes bytes written by the trained model after the prompt, the
// first window of `prompts`: each the last position's logits over
// --temperature, drawn from the --top-k likeliest bytes by a counter-based
// draw of (--seed, byte), the window moving on by that byte.
template <class Net>
  requires TextModel<Net>
void write_sample(const Model<Net, float>& trained, const Options& o,
                  const data::Dataset& prompts, std::ostream& out) {
  constexpr std::size_t context = Net::input_shape::size, vocab = Net::output_shape::dims[1];
  Model<Net, float> model(0, 1);
  std::ranges::copy(trained.parameters(), model.parameters().begin());
  std::ranges::copy(trained.state(), model.state().begin());
  std::vector<float> window(prompts.images.begin(),
                            prompts.images.begin() + static_cast<std::ptrdiff_t>(context));
  std::string prompt, text;
  for (const float id : window) prompt += static_cast<char>(static_cast<unsigned char>(id));
  std::vector<std::pair<double, std::size_t>> ranked(vocab);
  for (std::size_t b = 0; b < o.sample_bytes; ++b) {
    const float* logits = model.forward(window.data(), 1) + (context - 1) * vocab;
    for (std::size_t v = 0; v < vocab; ++v)
      ranked[v] = {static_cast<double>(logits[v]) / o.temperature, v};
    const std::size_t k = o.top_k == 0 ? vocab : std::min(o.top_k, vocab);
    std::partial_sort(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(k),
                      ranked.end(), std::greater<>());
    double total = 0.0;
    for (std::size_t v = 0; v < k; ++v) total += std::exp(ranked[v].first - ranked[0].first);
    double draw = uniform01(o.seed, 0x5A3B1E, b) * total;
    std::size_t chosen = ranked[k - 1].second;
    for (std::size_t v = 0; v < k; ++v) {
      draw -= std::exp(ranked[v].first - ranked[0].first);
      if (draw < 0.0) {
        chosen = ranked[v].second;
        break;
      }
    }
    text += static_cast<char>(static_cast<unsigned char>(chosen));
    window.erase(window.begin());
    window.push_back(static_cast<float>(chosen));
  }
  out << "sample (temperature " << o.temperature << ", top-k " << o.top_k << ") after the prompt \""
      << prompt << "\":\n" << text << '\n';
}

// How the program was started (the command that resumes it), and the
// handler that turns a signal into a stop at a step's end.
struct Launch {
  std::vector<std::string> args;  // argv, MPI's own arguments taken out
  int processes = 1;              // under mpirun: its -np
  callbacks::StopOnSignal* stop = nullptr;
};

// The command line again, with --resume `checkpoint` in place of any
// --resume it had; quoted where the shell would split or expand it.
inline std::string resume_command(const Launch& launch, const std::string& checkpoint) {
  const auto quoted = [](const std::string& arg) {
    if (!arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                              "0123456789-_./=:,+@%") == std::string::npos)
      return arg;
    std::string text = "'";
    for (const char c : arg) text += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return text + "'";
  };
  std::string command = launch.processes > 1 ? "mpirun -np " + std::to_string(launch.processes) : "";
  for (std::size_t k = 0; k < launch.args.size(); ++k) {
    if (launch.args[k] == "--resume") {
      ++k;
      continue;
    }
    if (launch.args[k].rfind("--resume=", 0) == 0) continue;
    command += (command.empty() ? "" : " ") + quoted(launch.args[k]);
  }
  return command + " --resume " + quoted(checkpoint);
}

// A signal stopped the fit: where, what was saved, how to go on.
template <class T>
void report_stop(std::ostream& out, const Options& o, const T& trainer,
                 const callbacks::StopOnSignal& stop, const Launch& launch) {
  const TrainingPosition& at = trainer.position();
  out << "stopped by " << signal_name(stop.stopped_by());
  if (trainer.steps() == 0 && at.epoch == 0)
    out << " before the first step\n";
  else
    out << " after step " << trainer.steps() << " (epoch " << at.epoch << ", step " << at.steps
        << ")\n";
  if (o.checkpoint.empty())
    out << "nothing was saved: --checkpoint FILE saves the run when a signal stops it\n";
  else
    out << "resume with: " << resume_command(launch, o.checkpoint) << '\n';
  out.flush();
}

// Whether Policy's ranks run pipelines of stages (--schedule and
// --micro-batches count): ModelSplit and Hybrid, or TensorParallel over them.
template <class Policy>
inline constexpr bool runs_pipelines = is_model_split<Policy> || is_hybrid<Policy>;
template <std::size_t T, class Inner>
inline constexpr bool runs_pipelines<TensorParallel<T, Inner>> = runs_pipelines<Inner>;

// Trains Net with `Policy` on `devices`; only `out` hears about it (rank 0's
// console under mpirun, a silent stream on the other ranks). Returns the
// program's exit status: 0, or 128 + the signal that stopped the fit.
template <class Net, class Policy, class Loss>
int train(const char* title, const Options& o, const data::Split& data,
          std::vector<Device> devices, comm::Comm processes, std::ostream& out,
          const Launch& launch) {
  static_assert(ExamplePolicies::contains<Policy> || TensorPolicies::contains<Policy>,
                "example_trainers.hpp names the examples' trainers: their CUDA side registers "
                "executors for those alone");
  const auto started = std::chrono::steady_clock::now();
  const TrainerOptions trainer = trainer_options(o, runs_pipelines<Policy>);
  std::ostringstream policy;
  if constexpr (is_pipelined<Policy>) {
    const auto grid = pipeline_grid<Policy>(
        processes ? static_cast<std::size_t>(processes.size()) * devices.size() : devices.size(),
        trainer.replicas);
    const auto bounds = cut_bounds<Net, typename Policy::partition>(grid.stages);
    policy << grid.policy << " (";
    if (grid.tensor > 1)
      policy << Mesh{grid.replicas, grid.stages, grid.tensor}.describe();
    else if (grid.replicas > 1)
      policy << grid.replicas << " replicas x " << grid.stages << " stages";
    if constexpr (runs_pipelines<Policy>) {
      if (grid.tensor > 1 || grid.replicas > 1) policy << "; ";
      policy << pipeline_kind_name(trainer.schedule.kind) << ", " << o.micro_batches
             << " micro-batches; stages start at layers";
      for (std::size_t k = 0; k < grid.stages; ++k) policy << ' ' << bounds[k] + 1;
    }
    policy << ')';
  } else {
    policy << Policy::name;
  }
  describe_run(out, title, o, data, Net::unique_parameter_count, policy.str(), devices, processes);

  ExampleTrainer<Net, Policy, Loss> t(devices, optimizer_options(o), trainer, processes);
  try {
    if (!o.resume.empty()) {
      t.load(o.resume);
      out << "resuming " << o.resume << " after step " << t.steps() << " (epoch "
          << t.position().epoch << ")\n";
      if (!t.resharded().empty()) out << t.resharded() << '\n';
    }
  } catch (const ResumeMismatch& refused) {
    throw resume_refusal(refused, o);
  }
  // A checkpoint at or past --epochs leaves nothing to train: said, with
  // the checkpoint's own test figures.
  if (const TrainingPosition& at = t.position();
      !o.resume.empty() && (at.ended ? at.epoch >= o.epochs : at.epoch > o.epochs)) {
    if (at.ended)
      out << "the checkpoint already finished epoch " << at.epoch << " of " << o.epochs
          << "; pass --epochs " << at.epoch + 1 << " to train on\n";
    else
      out << "the checkpoint stopped in epoch " << at.epoch << ", past --epochs " << o.epochs
          << "; pass --epochs " << at.epoch << " to finish that epoch\n";
    const EvalResult checkpoint = t.evaluate(data.test);
    char line[120];
    std::snprintf(line, sizeof line, "the checkpoint's test accuracy: %.2f%% (loss %.4f)\n",
                  100.0 * checkpoint.accuracy, checkpoint.loss);
    out << line;
    return 0;
  }
  callbacks::Evaluate evaluate(data.test, &out);
  evaluate.every_steps = o.eval_every;
  evaluate.perplexity = o.text;
  Maybe<callbacks::Checkpoint> checkpoint{.c = {}, .name = "checkpoint"};
  if (!o.checkpoint.empty())
    checkpoint.c.emplace(callbacks::Checkpoint::Options{
        .path = o.checkpoint, .every_steps = o.checkpoint_every, .out = &out});
  Maybe<callbacks::Metrics> metrics;
  if (!o.metrics.empty() && (!processes || processes.rank() == 0))
    metrics.c.emplace(callbacks::Metrics::Options{
        .path = o.metrics, .append = !o.resume.empty(), .evaluate = &evaluate});
  try {
    // The signal's callback last: a signal during the epoch's evaluation
    // stops the fit before the next step, and the checkpoint saves (at
    // the fit's end) the state the processes stopped at.
    t.fit(data.train, fit_options(o, data.train.channels == 3), ExampleSchedule{&o, &out},
          callbacks::Progress({.out = &out}), evaluate, checkpoint, metrics, *launch.stop);
  } catch (const ResumeMismatch& refused) {
    throw resume_refusal(refused, o);
  }
  if (launch.stop->stopped_by() != 0) {
    report_stop(out, o, t, *launch.stop, launch);
    return launch.stop->exit_status();
  }
  // A resumed run that had already finished trained nothing: measure it now.
  if (evaluate.history.empty()) evaluate.last = t.evaluate(data.test);
  report_run(out, o, evaluate.last, t.precision(), t.skipped_steps(), t.loss_scale(),
             t.nonfinite_steps(), started);
  if constexpr (TextModel<Net>)
    if (o.sample_bytes > 0) write_sample(t.model(), o, data.test, out);
  return 0;
}

// ModelSplit over `stages` devices or processes.
template <class Net, class Loss>
int train_split(const char* title, const Options& o, const data::Split& data, int stages,
                std::vector<Device> devices, comm::Comm processes, std::ostream& out,
                const Launch& launch) {
  LOOM_CHECK(stages >= 2 && stages <= 4, "--policy split takes 2 to 4 stages (--devices, or "
             "mpirun -np x --devices), not ", stages);
  return train<Net, PipelinePolicy, Loss>(title, o, data, std::move(devices),
                                          std::move(processes), out, launch);
}

// Hybrid: --replicas pipelines over `ranks` devices or processes.
template <class Net, class Loss>
int train_hybrid(const char* title, const Options& o, const data::Split& data, int ranks,
                 std::vector<Device> devices, comm::Comm processes, std::ostream& out,
                 const Launch& launch) {
  const int r = std::max(1, o.replicas), s = ranks / r;
  LOOM_CHECK(r * s == ranks && s >= 2 && s <= 4, "--policy hybrid lays ", ranks,
             " devices (--devices, or mpirun -np x --devices) out as --replicas ", o.replicas,
             " x stages; this example builds pipelines of 2 to 4 stages: give --replicas R and "
             "R x 2, R x 3 or R x 4 devices");
  return train<Net, PipelinePolicy, Loss>(title, o, data, std::move(devices),
                                          std::move(processes), out, launch);
}

// TensorParallel<T, Inner> for the GPT: --tensor T (2 or 4) over Inner's
// grid (data replicas, or --policy split and hybrid's pipelines).
template <class Net, class Inner, class Loss>
int train_tensor(const char* title, const Options& o, const data::Split& data, int ranks,
                 std::vector<Device> devices, comm::Comm processes, std::ostream& out,
                 const Launch& launch) {
  const int t = o.tensor > 1 ? o.tensor : ranks;
  LOOM_CHECK(t == 2 || t == 4, "--tensor takes 2 or 4 (this example's split network types), not ",
             t);
  LOOM_CHECK(ranks % t == 0, "--tensor ", t, " over ", ranks,
             " devices (--devices, or mpirun -np x --devices): give a multiple of ", t);
  if constexpr (TextModel<Net>) {
    if (t == 2)
      return train<Net, TensorParallel<2, Inner>, Loss>(title, o, data, std::move(devices),
                                                       std::move(processes), out, launch);
    return train<Net, TensorParallel<4, Inner>, Loss>(title, o, data, std::move(devices),
                                                     std::move(processes), out, launch);
  } else {
    throw Error("--tensor and --policy tensor split a GPT's layers; this example's network has "
                "none to split");
  }
}

// Trains Net under the policy --policy names, over the processes of mpirun
// (`world`, each rank on `rank_devices`) or over this process's devices.
template <class Net, class Loss>
int run_policy(const char* title, const Options& o, const data::Split& data,
               const comm::Comm& world, const std::vector<Device>& rank_devices,
               const Launch& launch, std::ostream& out) {
  if (world) {
    LOOM_CHECK(o.policy != "single", "--policy single under mpirun: start one process, or "
               "choose data or split");
    // --devices N: this process's share of the node's cores as N worker
    // devices, each a rank of the mesh on a thread of its own.
    std::vector<Device> devices = rank_devices;
    if (o.devices > 1) {
      LOOM_CHECK(rank_devices.front().kind == Device::Kind::cpu, "--devices ", o.devices,
                 " with mpirun on GPUs: each process drives one GPU; start more processes "
                 "instead");
      devices.clear();
      for (int k = 0; k < o.devices; ++k)
        devices.push_back(Device{Device::Kind::cpu, k,
                                 std::max(1, rank_devices.front().threads / o.devices)});
    }
    const int ranks = world.size() * o.devices;
    if (o.policy == "tensor" || (o.tensor > 1 && o.policy != "split" && o.policy != "hybrid"))
      return train_tensor<Net, DataParallel<>, Loss>(title, o, data, ranks, devices, world, out,
                                                     launch);
    if (o.tensor > 1)
      return train_tensor<Net, PipelinePolicy, Loss>(title, o, data, ranks, devices, world, out,
                                                     launch);
    if (o.policy == "split")
      return train_split<Net, Loss>(title, o, data, ranks, devices, world, out, launch);
    if (o.policy == "hybrid")
      return train_hybrid<Net, Loss>(title, o, data, ranks, devices, world, out, launch);
    return train<Net, DataParallel<>, Loss>(title, o, data, devices, world, out, launch);
  }
  // The ranks, each on a device of its own: CPU worker devices, or spread
  // over the GPUs round-robin (several on one GPU run on streams of their
  // own).
  const auto gpus = devices::gpus();
  const int count = process_ranks(o);
  std::vector<Device> ranks = devices::cpu(static_cast<std::size_t>(count));
  if (!gpus.empty())
    for (std::size_t k = 0; k < ranks.size(); ++k) ranks[k] = gpus[k % gpus.size()];
  const std::string policy = !o.policy.empty() ? o.policy : count == 1 ? "single" : "data";
  if (policy == "tensor" || (o.tensor > 1 && policy == "data"))
    return train_tensor<Net, DataParallel<>, Loss>(title, o, data, count, ranks, {}, out, launch);
  if (o.tensor > 1)
    return train_tensor<Net, PipelinePolicy, Loss>(title, o, data, count, ranks, {}, out, launch);
  if (policy == "split")
    return train_split<Net, Loss>(title, o, data, count, ranks, {}, out, launch);
  if (policy == "hybrid")
    return train_hybrid<Net, Loss>(title, o, data, count, ranks, {}, out, launch);
  if (policy == "single") {
    LOOM_CHECK(count == 1, "--policy single runs on one device, not --devices ", count);
    return train<Net, SingleDevice, Loss>(title, o, data, {ranks.front()}, {}, out, launch);
  }
  return train<Net, DataParallel<>, Loss>(title, o, data, ranks, {}, out, launch);
}

// CifarNet: the network --cifar DIR trains on CIFAR-10 (void: no such option).
// `load`: the example's data from the parsed options (none: Fashion-MNIST
// from --data), trained against Loss.
using DataLoad = data::Split (*)(const Options&, std::ostream& out);
// TiedNet: the network --tie-weights trains (void: no such option).
template <class Net, class CifarNet = void, class Loss = SoftmaxCrossEntropy,
          class TiedNet = void>
int example_main(int argc, char** argv, const char* title, Options o, DataLoad load = nullptr) {
#if defined(LOOM_WITH_MPI)
  // First: MPI may take its own arguments out of argv. Without mpirun this
  // is one rank of one.
  std::unique_ptr<dist::Environment> mpi;
  try {
    mpi = std::make_unique<dist::Environment>(argc, argv);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  const bool distributed = mpi->size() > 1;
  const bool talks = mpi->rank() == 0;
#else
  const bool talks = true;
#endif
  // A command line refused on one process ends every process at once: they
  // all compare their parse's outcome first (under mpirun a rank that left
  // alone would leave the others waiting in their first collective).
#if defined(LOOM_WITH_MPI)
  const auto parsed =
      parse_command_line(argc, argv, title, o, !std::is_void_v<CifarNet>, distributed,
                         mpi->collective_timeout().count());
#else
  const auto parsed =
      parse_command_line(argc, argv, title, o, !std::is_void_v<CifarNet>, false, std::nullopt);
#endif
  const int parse_status = parsed.status;
  const bool asked_help = parsed.help;
#if defined(LOOM_WITH_MPI)
  if (distributed) {
    comm::Comm world(mpi->world());
    const std::array<double, 2> mine{parse_status != 0 ? 1.0 : 0.0, asked_help ? 1.0 : 0.0};
    const auto rows = comm::gather_rows(world, mine);
    std::size_t refused = 0, helped = 0, first_refused = 0;
    for (std::size_t r = 0; r < rows.size() / 2; ++r) {
      if (rows[2 * r] != 0.0 && refused++ == 0) first_refused = r;
      helped += rows[2 * r + 1] != 0.0 ? 1 : 0;
    }
    if (refused > 0) {
      if (parse_status == 0 && talks)
        std::cerr << "loom: process " << first_refused << " refused its command line (its "
                  << "message above says why); every process stops\n";
      return parse_status != 0 ? parse_status : 2;
    }
    if (helped > 0) return 0;
  }
#endif
  if (parse_status != 0 || asked_help) return parse_status;
#if defined(LOOM_WITH_MPI)
  mpi->set_collective_timeout(comm::Timeout(parsed.collective_timeout));
  if (!distributed && parsed.collective_timeout_given)
    std::cerr << "note: --collective-timeout has no effect in a single process (no mpirun)\n";
#endif

  std::ostream quiet(nullptr);
  std::ostream& out = talks ? std::cout : quiet;
  try {
    // Before the data are read: a signal from here on stops the run at a
    // step's end (or before the first), saving --checkpoint.
    callbacks::StopOnSignal stop({.out = &out});
    Launch launch{.args = std::vector<std::string>(argv, argv + argc), .processes = 1,
                  .stop = &stop};
    const auto limit = [&](data::Split data) {
      if (o.train_samples > 0) data.train = data::head(data.train, o.train_samples);
      if (o.test_samples > 0) data.test = data::head(data.test, o.test_samples);
      if (o.batch_size > data.train.count)
        out << "note: --batch-size " << o.batch_size << " is more than the " << data.train.count
            << " training " << o.sample_word << ": each step takes all " << data.train.count
            << " (memory is planned for that)\n";
      return data;
    };
#if defined(LOOM_WITH_MPI)
    const comm::Comm world = distributed ? comm::Comm(mpi->world()) : comm::Comm{};
    const std::vector<Device> rank_devices = distributed ? mpi->devices() : std::vector<Device>{};
    launch.processes = mpi->size();
#else
    const comm::Comm world;
    const std::vector<Device> rank_devices;
#endif
    if constexpr (!std::is_void_v<CifarNet>) {
      if (!o.cifar_dir.empty())
        return run_policy<CifarNet, Loss>(title, o, limit(data::cifar10(o.cifar_dir)), world,
                                          rank_devices, launch, out);
    }
    const data::Split split =
        limit(load != nullptr ? load(o, out) : data::fashion_mnist(o.data_dir));
    if constexpr (!std::is_void_v<TiedNet>)
      if (o.tie_weights)
        return run_policy<TiedNet, Loss>(title, o, split, world, rank_devices, launch, out);
    return run_policy<Net, Loss>(title, o, split, world, rank_devices, launch, out);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
#if defined(LOOM_WITH_MPI)
    // The other ranks may be waiting in a collective for this one, and
    // MPI_Finalize would wait for them: the program ends the whole job.
    if (distributed) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    return 1;
  }
}

}  // namespace loom::examples
