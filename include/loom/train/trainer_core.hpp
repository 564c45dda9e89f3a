// What every Trainer shares, whatever its network, policy and backend: the
// options, the fit loop over an executor's steps, the position in the fit
// and a loaded checkpoint's resume, the non-finite and fp16 bookkeeping,
// and the processes' agreement. None of it is a template, so it is compiled
// once, however many trainer types a program has (the GpuExecutor
// interface aside, a template over the trainer).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/cpu/loss_sums.hpp"
#include "../core/targets.hpp"
#include "../loss/loss.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../core/linkage.hpp"
#include "../core/precision.hpp"
#include "../data/loader.hpp"
#include "../net/model.hpp"
#include "../optim/loss_scaler.hpp"
#include "../parallel/hybrid.hpp"
#include "../parallel/schedule.hpp"
#include "../parallel/split_engine.hpp"
#include "agreement.hpp"
#include "checkpoint.hpp"

namespace loom {

struct TrainerOptions {
  // Weight initialisation and Dropout's masks (a loaded checkpoint brings its own).
  std::uint64_t seed = 0;
  // On a GPU: allow TF32 tensor-core math (faster, inputs rounded to a
  // 10-bit mantissa).
  bool allow_tf32 = false;
  // ModelSplit: the pipeline schedule and micro-batch count to run instead
  // of the policy's (micro_batches 0: keep the policy's schedule).
  PipelineSchedule schedule{};
  // Hybrid<replicas_from_devices, ...>: the replica count to lay the devices
  // (or processes) out as. 0: the devices over the policy's stage count, or,
  // when its partition carries several (Balanced<2, 3, 4>), one pipeline of
  // them all.
  std::size_t replicas = 0;
  // Compute precision (see core/precision.hpp): bf16 or fp16 with fp32
  // master weights; fp16 scales the loss dynamically (`loss_scaling`),
  // skipping the steps whose gradients overflow. A step that overflows even
  // at the minimum scale is a non-finite step (FitOptions::on_nonfinite).
  // CPU devices emulate both; on GPUs both run on tensor cores
  // (backend/cuda/precision.cuh). The trainer keeps the loss scale on every
  // backend (optim/loss_scaler.hpp).
  Precision precision = Precision::fp32;
  LossScaling loss_scaling{};
};

// What a training step whose loss or gradients went non-finite (NaN or
// infinite) does. Either way no device updates: the weights, optimizer
// state and running statistics stay those of the step before.
enum class NonFinite {
  raise,  // a loom::Error naming the step and the first input, output or gradient that went bad
  skip,   // go on with the next step (Trainer::nonfinite_steps() counts them; StepInfo says why)
};

struct FitOptions {
  int epochs = 1;
  std::size_t batch_size = 64;
  bool shuffle = true;
  std::uint64_t seed = 0;  // data order: epoch e uses the permutation keyed by (seed, e)
  // Batches per optimizer step: the gradients of this many batches are
  // added up (and, with DataParallel, reduced once, on the last of them), so
  // a step sees batch_size * accumulation_steps samples; the loss is their mean.
  std::size_t accumulation_steps = 1;
  data::Augment augment{};  // random crops and flips of the training images, or SpecAugment
  bool drop_last = false;   // skip an epoch's last batch when it is short
  // Batches of similar length, for data with Dataset::frames (speech): 0
  // off, else batches per bucket (e.g. 50). Each epoch's shuffled order is
  // cut into buckets of this many batches' samples, each sorted by frames
  // and cut into batches, and the batches are shuffled; within a batch the
  // samples are ordered so that a split over any replica count gives each
  // about the same frames (data/loader.hpp). Still a function of (seed,
  // epoch) alone: every process and policy draws the same batches, and a
  // resumed fit must have the same bucket.
  std::size_t bucket = 0;
  // Clip each step's gradients to this global norm, over every layer,
  // replica and stage (PyTorch's clip_grad_norm_); 0: never.
  float max_grad_norm = 0.0f;
  // A step whose loss or gradients are not finite.
  NonFinite on_nonfinite = NonFinite::raise;
};

struct EvalResult {
  double loss = 0.0;  // the loss's mean over its denominator (samples; PositionCrossEntropy: positions)
  // Fraction in [0, 1] predicted exactly (CTCLoss: whole sequences;
  // PositionCrossEntropy: counted positions).
  double accuracy = 0.0;
  std::size_t samples = 0;
  double denominator = 0.0;  // what loss and accuracy divide by: samples, or counted positions
  // Where the loss defines one (CTCLoss: label edits over reference labels),
  // a fraction in [0, 1] or above.
  std::optional<double> error_rate{};
};

// A mean over a denominator; 0 when nothing was counted.
inline double mean_over(double sum, double denominator) {
  return denominator > 0.0 ? sum / denominator : 0.0;
}

// errors / references, or none when the loss counts no references.
inline std::optional<double> error_rate_of(double errors, double references) {
  if (references <= 0.0) return std::nullopt;
  return errors / references;
}

struct FitInfo {
  int epochs = 0;
  std::size_t steps_per_epoch = 0;  // optimizer steps
  std::size_t samples_per_epoch = 0;
  std::size_t batch_size = 0;
  const char* policy = "";
  std::vector<Placement> placement;  // Trainer::placement()
};

struct StepInfo {
  int epoch = 0;  // 1-based
  int epochs = 0;
  std::size_t step = 0;  // 1-based, within the epoch
  std::size_t steps = 0;
  double loss = 0.0;        // mean over the epoch so far
  double accuracy = 0.0;    // over the epoch so far
  std::size_t samples = 0;  // seen this epoch
  double seconds = 0.0;     // since the epoch began
  // This optimizer step's own figures.
  double step_loss = 0.0;
  double step_accuracy = 0.0;
  // Over the epoch so far, where the loss defines an error rate (CTCLoss).
  std::optional<double> error_rate{};
  std::size_t step_samples = 0;
  // The update was skipped: fp16's gradients overflowed, or (with
  // NonFinite::skip) the loss or a gradient went non-finite, as `nonfinite` says.
  bool skipped = false;
  std::string nonfinite{};
};

// Before an optimizer step's first batch, for callbacks that set the
// learning rate (callbacks::LrSchedule).
struct StepBegin {
  int epoch = 0;                 // 1-based
  std::size_t step = 0;          // 1-based, within the epoch
  std::size_t fit_step = 0;      // steps of this fit before this one (a resumed fit's included)
  std::size_t total_steps = 0;   // of the whole fit
  std::size_t global_batch = 0;  // samples per optimizer step, over every device
};

struct EpochInfo {
  int epoch = 0;
  int epochs = 0;
  double loss = 0.0;
  double accuracy = 0.0;
  std::size_t samples = 0;
  double seconds = 0.0;
  std::optional<double> error_rate{};  // where the loss defines one (CTCLoss)
};

namespace detail {

// Where a batch stands in its optimizer step (FitOptions::accumulation_steps):
// the step's samples (the loss is their mean), whether the batch adds to the
// step's earlier ones, and whether it ends the step. One per epoch.
class StepGroups {
 public:
  struct Place {
    std::size_t group_samples = 0;
    bool accumulate = false;
    bool last = true;
  };

  // `seen`: samples of the epoch already trained (a resumed epoch), at a
  // step's boundary.
  StepGroups(std::size_t batches_per_step, std::size_t batch_size, std::size_t epoch_samples,
             std::size_t seen = 0)
      : k_(batches_per_step), batch_size_(batch_size), epoch_samples_(epoch_samples), seen_(seen) {}

  bool at_step_start() const { return micro_ == 0; }

  Place next(std::size_t batch) {
    if (micro_ == 0) group_ = std::min(k_ * batch_size_, epoch_samples_ - seen_);
    const Place place{group_, micro_ > 0, micro_ + 1 == k_ || seen_ + batch == epoch_samples_};
    seen_ += batch;
    micro_ = place.last ? 0 : micro_ + 1;
    return place;
  }

 private:
  std::size_t k_, batch_size_, epoch_samples_;
  std::size_t micro_ = 0, group_ = 0, seen_ = 0;
};

// What fit() tells its callbacks, behind one interface so that the fit loop
// is compiled once (Trainer::fit wraps its callbacks in one).
class FitEvents {
 public:
  virtual void fit_begin(const FitInfo& info) = 0;
  virtual void step_begin(const StepBegin& info) = 0;
  virtual void step(const StepInfo& info) = 0;
  virtual void epoch_end(const EpochInfo& info) = 0;
  // Before the processes compare their fits: what the callbacks add to
  // the fingerprint; and after the last epoch.
  virtual void fit_prepare(const FitInfo& info, Fingerprint& fingerprint) = 0;
  virtual void fit_end() = 0;
  // Whether a callback's on_step after optimizer step `steps` (as
  // Trainer::steps() counts) reads or saves the trainer's state.
  virtual bool needs_state_at_step(std::uint64_t steps) = 0;

 protected:
  ~FitEvents() = default;
};

// A fit() about to run, as the loop needs it.
struct FitPlan {
  const FitOptions& options;
  FitInfo info;
  FitIdentity identity;
  std::size_t epoch_samples = 0;  // with drop_last the epoch ends before the data set does
};

// What a backend other than the host's does for a Trainer: the CUDA one
// (gpu/trainer_executor.cuh), which loom.hpp brings when nvcc compiles. It
// makes the grid engine over GPU stages for every policy, whose steps,
// evaluation and checkpoints the trainer runs as it runs the CPU's.
template <class Trainer>
class GpuExecutor {
 public:
  virtual ~GpuExecutor() = default;
  // The grid engine over GPU stages, made once (its stages grow with the
  // batches they are given) from the trainer's model and optimizer state;
  // none until then.
  virtual void plan_split(Trainer& trainer) = 0;
  virtual SplitEngine<typename Trainer::Net>* split() const = 0;
};

// A program whose trainers the host compiler builds runs them on GPUs with
// the CUDA executors its CUDA translation unit registers here
// (gpu::register_trainers, at static initialisation), so that each side is
// compiled by its own compiler; one that nvcc compiles whole finds the
// executor directly (make_gpu_executor).
template <class Trainer>
using GpuExecutorFactory = std::unique_ptr<GpuExecutor<Trainer>> (*)();
template <class Trainer>
inline constinit GpuExecutorFactory<Trainer> gpu_executor_factory = nullptr;

class TrainerCore {
 public:
  // Ends fit() after the optimizer step in progress (from a callback, a
  // signal handler or another thread): a checkpoint saved then resumes at
  // the next batch. Across MPI processes every process must call it at the
  // same step.
  void stop() { stop_.set(true); }

  // The learning rate the trainer was made with; schedules scale it.
  float base_lr() const { return base_lr_; }
  // Optimizer steps taken, over every fit (fp16's skipped ones included).
  std::uint64_t steps() const { return steps_; }
  Precision precision() const { return options_.precision; }
  // fp16: the loss scale now, and the steps skipped for overflowing.
  float loss_scale() const { return scaler_.scale(); }
  std::uint64_t skipped_steps() const { return skipped_steps_; }
  // NonFinite::skip: the steps skipped for a non-finite loss or gradient,
  // over every fit of this trainer (a loaded checkpoint's included).
  std::uint64_t nonfinite_steps() const { return nonfinite_steps_; }
  // Where the current (or last) fit stands.
  const TrainingPosition& position() const { return position_; }
  // Across MPI processes: this process's rank (0 writes checkpoints); else 0.
  std::size_t process_rank() const { return process_rank_; }
  // The MPI processes training together (0 or 1: this one alone).
  std::size_t process_count() const { return process_count_; }
  // The largest of the processes' values: a collective, which every
  // process calls at the same point of its fit (a callback's hook); in one
  // process, `value`. callbacks::StopOnSignal agrees on a signal with it.
  double max_over_processes(double value) {
    if (process_count_ <= 1) return value;
    const double row[1] = {value};
    const std::vector<double> all = gather_over_processes(row);
    return *std::max_element(all.begin(), all.end());
  }
  // The policy's name (Hybrid<replicas_from_devices, ...> with one replica
  // is a ModelSplit).
  virtual const char* policy_name() const = 0;
  // Which device (or MPI process) holds which replica and stage, and its
  // layers; callbacks::Progress prints it when fit() begins.
  virtual std::vector<Placement> placement() const = 0;


 protected:
  TrainerCore(const TrainerOptions& options, float lr)
      : options_(options), scaler_(options.loss_scaling), base_lr_(lr) {}
  TrainerCore(TrainerCore&&) = default;
  TrainerCore& operator=(TrainerCore&&) = default;
  virtual ~TrainerCore() = default;

  // fit(): the fit's checks, the processes' agreement on it (one
  // collective: processes that differ, or one whose checks failed, all
  // raise a loom::Error naming the first difference before anything
  // trains), then the epochs on the executor.
  void fit_with(const data::Dataset& train, const FitOptions& options, FitEvents& events);
  // fit()'s checks of its arguments, made before the processes compare them.
  virtual void check_fit(const data::Dataset& train, const FitOptions& options) = 0;
  // Before the first step (memory planned for `planned_batch` samples).
  virtual void start_fit(const FitPlan& plan, std::size_t planned_batch) = 0;
  // What the executor does for the fit loop (see run_fit).
  // Before an optimizer step's first batch: weights changed through
  // model() reach the devices.
  virtual void before_step() = 0;
  // One batch of an optimizer step over `group_samples` samples. An
  // executor that runs each step at once (the CPU's) returns the step's
  // sums once `last`; one that runs ahead of the host (the GPU's) only
  // enqueues it and returns none: finish_step() reads them later.
  virtual std::optional<cpu::LossSums> run_batch(const data::Batch& batch,
                                                 std::size_t group_samples, bool accumulate,
                                                 bool last, int epoch, std::size_t step,
                                                 const FitOptions& options) = 0;
  // Whether the fit may read a step's results only once the next step's
  // first batch is enqueued, so that the devices never wait for the host.
  virtual bool runs_ahead(const FitOptions& options) const = 0;
  // The sums of the oldest step that run_batch enqueued and no finish_step
  // has read (waiting for it), its non-finite values and fp16 overflow
  // handled as run_batch handles them on the CPU. A step the device halted
  // raises with the executor and the counters (batches_, gpu_unreported_)
  // at the steps read before it; any other error leaves the steps run
  // ahead unreported (save() refuses: the devices' state is not known).
  virtual cpu::LossSums finish_step(int epoch, std::size_t step, const FitOptions& options) = 0;
  // Before an epoch's first batch.
  virtual void epoch_begin() = 0;
  // After an epoch's last step, before its callbacks.
  virtual void epoch_done() = 0;
  // The processes' fingerprint: the trainer's type, devices and optimizer,
  // and for pipelines the schedule that runs.
  virtual void describe_setup(Fingerprint& f) const = 0;
  virtual std::optional<PipelineSchedule> running_schedule() const = 0;
  // Where a non-finite value was first found, in the network's words.
  virtual std::string spot_text(const NonFiniteSpot& spot) const = 0;
  // Trainer::save and load (trainer_checkpoint.hpp), given the typed parts:
  // the executor's weights, running statistics and optimizer state into a
  // checkpoint's image and back, and the file written and read in the
  // network's layout. (Not virtual: a trainer that never saves compiles
  // none of it.)
  using ImageWriter =
      std::function<void(const std::filesystem::path&, const CheckpointImage&)>;
  void save_with(const std::filesystem::path& path,
                 const std::function<void(CheckpointImage&)>& fill, const ImageWriter& write);
  void load_with(const std::filesystem::path& path, bool resume,
                 const std::function<CheckpointImage()>& read_image,
                 const std::function<void(const CheckpointImage&)>& restore);
  // Across the processes (every process must call them); in one process,
  // `value` and `row`.
  virtual double sum_over_processes(double value) = 0;
  // This process's device (across processes, each drives one).
  virtual const Device& device_of_process() const = 0;
  virtual std::vector<double> gather_over_processes(std::span<const double> row) = 0;

  // The fit loop, over executors that run each step at once (the CPU's)
  // and ones that run ahead (the GPU's): the epochs from a loaded
  // checkpoint's position, each step's callbacks and position, stop().
  void run_fit(data::Loader& loader, const FitPlan& plan, FitEvents& events);

  // What every process of a fit must share (the callbacks add theirs).
  void describe_fit(Fingerprint& f, const data::Dataset& train, const FitOptions& options) const;

  // fit() and evaluate(): a data set the network can take.
  // `input`: the network's Input<> dimensions. Input<C, H, W> takes
  // samples of that shape only, Input<Rows, Features> samples whose rows
  // (channels x height) and width are those, and a flat Input<F> any
  // sample of F values.
  // `ids`: the network's first layer reads token ids (an Embedding), so
  // a flat Input<C> is a context of C positions.
  static void check_samples(const data::Dataset& dataset, const char* what,
                            std::span<const std::size_t> input, std::size_t classes,
                            TargetKind target, const char* loss, bool ids = false) {
    std::size_t input_size = 1;
    std::string input_text;
    for (const std::size_t d : input) {
      input_size *= d;
      input_text += (input_text.empty() ? "" : ", ") + std::to_string(d);
    }
    LOOM_CHECK(dataset.count > 0, what, ": dataset '", dataset.name, "' is empty");
    const bool context = ids && input.size() == 1;
    LOOM_CHECK(!context || dataset.sample_size() <= input_size, what, ": dataset '",
               dataset.name, "' has windows of ", dataset.sample_size(),
               " token ids, longer than the network's context of ", input_size, " (Input<",
               input_size, ">: the most positions its embeddings and attention take); cut the "
               "windows to ", input_size, " (data::text_split's context) or build the network "
               "with Input<", dataset.sample_size(), ">");
    LOOM_CHECK(!context || dataset.sample_size() == input_size, what, ": dataset '",
               dataset.name, "' has windows of ", dataset.sample_size(),
               " token ids, shorter than the network's context of ", input_size, " (Input<",
               input_size, ">); make the windows ", input_size,
               " long (data::text_split's context) or build the network with Input<",
               dataset.sample_size(), ">");
    LOOM_CHECK(dataset.sample_size() == input_size, what, ": dataset '", dataset.name,
               "' has samples of ", dataset.channels, "x", dataset.height, "x", dataset.width,
               " = ", dataset.sample_size(), " values but the network's Input holds ",
               input_size);
    const bool same_shape =
        input.size() == 3   ? input[0] == dataset.channels && input[1] == dataset.height &&
                                  input[2] == dataset.width
        : input.size() == 2 ? input[0] == dataset.channels * dataset.height &&
                                  input[1] == dataset.width
                            : true;
    LOOM_CHECK(same_shape, what, ": dataset '", dataset.name, "' has samples of ",
               dataset.channels, "x", dataset.height, "x", dataset.width,
               " but the network's Input is <", input_text, ">: the same ", input_size,
               " values in another shape. Give Input<", dataset.channels, ", ", dataset.height,
               ", ", dataset.width, ">, or a flat Input<", input_size,
               "> to take any sample of ", input_size, " values");
    LOOM_CHECK(dataset.classes <= classes, what, ": dataset '", dataset.name, "' has ",
               dataset.classes, " classes but the network outputs ", classes, " scores");
    const TargetKind has = dataset.target_kind();
    LOOM_CHECK(has == target, what, ": dataset '", dataset.name, "' has ",
               target_kind_name(has), " but the trainer's loss, ", loss, ", trains against ",
               target_kind_name(target));
    try {
      data::check_targets(dataset);
    } catch (const Error& e) {
      // "loom: <what>: <its message>", the message's place kept.
      const std::string text = e.what();
      const std::string_view prefix = "loom: ";
      throw Error(std::string(prefix) + what + ": " +
                  (text.starts_with(prefix) ? text.substr(prefix.size()) : text));
    }
  }

  // fit()'s options that no trainer could run.
  static void check_fit_options(const FitOptions& options) {
    LOOM_CHECK(options.epochs >= 1, "fit: epochs must be >= 1, got ", options.epochs);
    LOOM_CHECK(options.batch_size >= 1, "fit: batch size must be >= 1");
    LOOM_CHECK(options.accumulation_steps >= 1, "fit: accumulation_steps must be >= 1");
    LOOM_CHECK(options.max_grad_norm >= 0.0f && std::isfinite(options.max_grad_norm),
               "fit: max_grad_norm must be a finite number >= 0 (0: no clipping), got ",
               options.max_grad_norm);
  }
  // Whether any process reports `failed`.
  bool any_process_failed(bool failed) { return sum_over_processes(failed ? 1.0 : 0.0) > 0.0; }

  static std::size_t steps_per_epoch(std::size_t samples, const FitOptions& options) {
    const std::size_t batches =
        data::batches_per_epoch(samples, options.batch_size, options.drop_last);
    return (batches + options.accumulation_steps - 1) / options.accumulation_steps;
  }

  // Every process's (phase, fingerprint, failure) compared across the
  // processes. The process whose failure it is raises its own error; the
  // others learn how they differ (the caller raises). In one process: its
  // own failure only.
  detail::Disagreement compare_processes(detail::AgreementPhase phase,
                                         const Fingerprint& fingerprint,
                                         std::exception_ptr failure);

  // What callbacks learn before the step that follows `done` steps of `epoch`.
  static StepBegin step_begin(int epoch, std::size_t done, const FitInfo& info,
                              const FitOptions& options) {
    return {.epoch = epoch,
            .step = done + 1,
            .fit_step = static_cast<std::size_t>(epoch - 1) * info.steps_per_epoch + done,
            .total_steps = info.steps_per_epoch * static_cast<std::size_t>(options.epochs),
            .global_batch = options.batch_size * options.accumulation_steps};
  }

  // The position a loaded checkpoint left, if the fit about to run goes on
  // from it: it must draw the same batches.
  // Checked before anything is taken: a fit refused here can be retried.
  std::optional<TrainingPosition> resume_position(const FitIdentity& identity,
                                                  std::size_t batches_per_epoch);

  // After a step that every device skipped when its loss or gradients
  // were not finite (`spot`: where first, when a device looked;
  // `scale_note`: the words for fp16's overflow at its minimum scale):
  // raises, or (NonFinite::skip) counts it and says why in nonfinite_.
  // False for a finite step.
  bool handle_nonfinite(double loss, const NonFiniteSpot& spot, int epoch, std::size_t step,
                        NonFinite on_nonfinite, const std::string& scale_note = {});

  static std::string min_scale_note(float scale) {
    return ", even at fp16's minimum loss scale " + detail::number_text(scale) +
           " (LossScaling::min_scale)";
  }

  // fp16: the scale follows the steps' overflows. An overflow at the
  // minimum scale is no overflow a smaller scale could avoid: the step's
  // gradients are non-finite, and it raises or (NonFinite::skip) is skipped
  // as such, the scale kept. (`spot`: the first non-finite gradient, when a
  // device looked.)
  void note_overflow(const cpu::LossSums& sums, const NonFiniteSpot& spot, int epoch,
                     std::size_t step, NonFinite on_nonfinite) {
    if (options_.precision != Precision::fp16) return;
    if (sums.overflowed && scaler_.at_min_scale()) {
      handle_nonfinite(sums.loss, spot, epoch, step, on_nonfinite, min_scale_note(scaler_.scale()));
      return;
    }
    scaler_.update(sums.overflowed);
    skipped_steps_ += sums.overflowed ? 1 : 0;
  }

  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  TrainerOptions options_;
  std::size_t process_count_ = 0, process_rank_ = 0;  // across MPI processes
  std::uint64_t batches_ = 0;  // training batches run: Dropout's step
  std::uint64_t steps_ = 0;    // optimizer steps taken
  LossScaler scaler_;          // fp16's
  std::uint64_t skipped_steps_ = 0;  // fp16: steps whose gradients overflowed
  std::uint64_t nonfinite_steps_ = 0;  // NonFinite::skip: steps skipped for a non-finite value
  std::string nonfinite_;  // the last optimizer step's, when it was skipped as non-finite
  float base_lr_;          // the learning rate given: schedules scale it
  // stop() was called: fit() returns after this step. (Atomic, yet the
  // trainer stays movable.)
  struct StopFlag {
    std::atomic<bool> value = false;
    StopFlag() = default;
    StopFlag(StopFlag&& other) noexcept : value(other.get()) {}
    StopFlag& operator=(StopFlag&& other) noexcept {
      set(other.get());
      return *this;
    }
    bool get() const { return value.load(std::memory_order_relaxed); }
    void set(bool v) { value.store(v, std::memory_order_relaxed); }
  } stop_;

  // Across MPI processes: each one's device by rank, once a fit gathered them.
  std::vector<std::string> process_devices_;
  TrainingPosition position_;
  // What the loss's mean divides by (the Trainer's loss sets it): a
  // per-sample loss's step reports divide by the step's samples, as they
  // always have (the GPU executor's sums carry no denominator).
  Denominator loss_denominator_ = Denominator::samples;
  std::optional<FitIdentity> fit_;  // the last fit's, for a checkpoint
  // A loaded checkpoint's position, which the next fit() goes on from.
  std::optional<TrainingPosition> resume_;
  std::optional<FitIdentity> resume_fit_;
  // Training batches run (by an executor that runs ahead: enqueued) whose
  // optimizer step is not reported yet: the devices are past position_
  // while there are any.
  std::size_t gpu_unreported_ = 0;
  bool fitting_ = false;  // run_fit is running (its callbacks too)
};

#if LOOM_IMPLEMENT

// SpecAugment's settings as one fingerprint value ("off" without).
inline std::string spec_text(const std::optional<data::SpecAugmentOptions>& spec) {
  if (!spec) return "off";
  return std::to_string(spec->frequency_masks) + "x" + std::to_string(spec->max_frequency_width) +
         " bands, " + std::to_string(spec->time_masks) + "x" +
         std::to_string(spec->max_time_width) + " frames, fill " + std::to_string(spec->fill);
}

LOOM_DECL void TrainerCore::describe_fit(Fingerprint& f, const data::Dataset& train,
                                         const FitOptions& options) const {
  describe_setup(f);
  f.add("trainer.seed", options_.seed)
      .add("trainer.precision", precision_name(options_.precision))
      .add("trainer.allow_tf32", options_.allow_tf32)
      .add("trainer.steps", steps_);
  if (options_.precision == Precision::fp16) {
    const auto& l = options_.loss_scaling;
    f.add("loss_scaling.initial_scale", l.initial_scale)
        .add("loss_scaling.growth_factor", l.growth_factor)
        .add("loss_scaling.backoff_factor", l.backoff_factor)
        .add("loss_scaling.growth_interval", l.growth_interval)
        .add("loss_scaling.min_scale", l.min_scale)
        .add("loss_scaling.max_scale", l.max_scale);
  }
  if (const auto schedule = running_schedule())
    f.add("schedule", pipeline_kind_name(schedule->kind))
        .add("micro_batches", schedule->micro_batches);
  f.add("resume", resume_ ? "after batch " + std::to_string(resume_->batches) + " of epoch " +
                                std::to_string(resume_->epoch)
                          : std::string("none"))
      .add("fit.epochs", options.epochs)
      .add("fit.batch_size", options.batch_size)
      .add("fit.accumulation_steps", options.accumulation_steps)
      .add("fit.shuffle", options.shuffle)
      .add("fit.seed", options.seed)
      .add("fit.drop_last", options.drop_last)
      .add("fit.bucket", options.bucket)
      .add("fit.augment.crop_padding", options.augment.crop_padding)
      .add("fit.augment.horizontal_flip", options.augment.horizontal_flip)
      .add("fit.augment.spec", spec_text(options.augment.spec))
      .add("fit.max_grad_norm", options.max_grad_norm)
      .add("fit.on_nonfinite", options.on_nonfinite == NonFinite::raise ? "raise" : "skip")
      .add_data("data", train);
}

LOOM_DECL detail::Disagreement TrainerCore::compare_processes(detail::AgreementPhase phase,
                                                              const Fingerprint& fingerprint,
                                                              std::exception_ptr failure) {
  if (process_count_ <= 1) {
    if (failure) std::rethrow_exception(failure);
    return {};
  }
  std::string failure_text;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& error) {
      failure_text = error.what();
    } catch (...) {
      failure_text = "an exception that is not a std::exception";
    }
  }
  auto found = detail::compare_across_ranks(
      phase, fingerprint, failure ? &failure_text : nullptr,
      [this](std::span<const double> row) { return gather_over_processes(row); });
  if (failure) std::rethrow_exception(failure);
  return found;
}

LOOM_DECL bool TrainerCore::handle_nonfinite(double loss, const NonFiniteSpot& spot, int epoch,
                                             std::size_t step, NonFinite on_nonfinite,
                                             const std::string& scale_note) {
  if (std::isfinite(loss) && !spot && scale_note.empty()) return false;
  const std::string what = (std::isfinite(loss) ? std::string("the gradients became non-finite")
                                                : "the training loss became " + loss_text(loss)) +
                           " at epoch " + std::to_string(epoch) + ", step " + std::to_string(step) +
                           (std::isfinite(loss) ? " under a finite loss" : "") + scale_note +
                           (spot ? ": " + spot_text(spot) : std::string());
  if (on_nonfinite == NonFinite::raise)
    LOOM_FAIL(what,
              "; the weights are kept from the step before. Lower the learning rate or "
              "check the input data (FitOptions::on_nonfinite = NonFinite::skip skips such "
              "steps)");
  nonfinite_steps_ += 1;
  nonfinite_ = what;
  return true;
}

LOOM_DECL void TrainerCore::fit_with(const data::Dataset& train, const FitOptions& options,
                                     FitEvents& events) {
  std::exception_ptr failure;
  Fingerprint fingerprint;
  try {
    check_fit(train, options);
    LOOM_CHECK(options.bucket == 0 || !train.frames.empty(), "fit: FitOptions::bucket is ",
               options.bucket, " but dataset '", train.name,
               "' has no sample lengths (Dataset::frames) to bucket its batches by; set "
               "bucket 0, or give each sample its frames");
    describe_fit(fingerprint, train, options);
    const FitInfo preview{.epochs = options.epochs,
                          .steps_per_epoch = steps_per_epoch(train.count, options),
                          .samples_per_epoch = train.count,
                          .batch_size = options.batch_size,
                          .policy = policy_name(),
                          .placement = {}};
    events.fit_prepare(preview, fingerprint);
  } catch (...) {
    failure = std::current_exception();
  }
  if (const auto differ = compare_processes(detail::AgreementPhase::fit, fingerprint, failure);
      differ.kind != detail::Disagreement::Kind::none)
    throw Error(detail::disagreement_text(differ, detail::AgreementPhase::fit, process_rank_));
  // Each process's device, for the placement callbacks print (a process
  // knows only its own): a collective, as the comparison before it.
  if (process_count_ > 1 && process_devices_.empty()) {
    const Device& mine = device_of_process();
    const double row[2] = {mine.kind == Device::Kind::cuda ? 1.0 : 0.0,
                           static_cast<double>(mine.index)};
    const std::vector<double> all = gather_over_processes(row);
    for (std::size_t p = 0; p + 1 < all.size(); p += 2)
      process_devices_.push_back(
          Device{all[p] != 0.0 ? Device::Kind::cuda : Device::Kind::cpu,
                 static_cast<int>(all[p + 1])}
              .name());
  }
  data::Loader loader(
      train,
      {.batch_size = options.batch_size,
       .shuffle = options.shuffle,
       .seed = options.seed,
       .drop_last = options.drop_last,
       .augment = options.augment,
       .bucket = options.bucket});
  const std::size_t k = options.accumulation_steps;
  const detail::FitPlan plan{
      .options = options,
      .info = {options.epochs, (loader.batches_per_epoch() + k - 1) / k, train.count,
               options.batch_size, policy_name(), placement()},
      .identity = {.samples = train.count,
                   .batch_size = options.batch_size,
                   .accumulation_steps = k,
                   .seed = options.seed,
                   .shuffle = options.shuffle,
                   .drop_last = options.drop_last,
                   .crop_padding = options.augment.crop_padding,
                   .horizontal_flip = options.augment.horizontal_flip,
                   .bucket = options.bucket},
      .epoch_samples =
          options.drop_last ? loader.batches_per_epoch() * options.batch_size : train.count};
  // A batch larger than the data set is the data set: memory is planned
  // for what a step takes, not for what was asked.
  const std::size_t planned_batch = std::min(options.batch_size, train.count);
  stop_.set(false);
  start_fit(plan, planned_batch);
  run_fit(loader, plan, events);
  events.fit_end();
}

LOOM_DECL void TrainerCore::run_fit(data::Loader& loader, const FitPlan& plan, FitEvents& events) {
  const FitOptions& options = plan.options;
  const FitInfo& info = plan.info;
  // A loaded checkpoint's position: this fit goes on from there.
  const auto resumed = resume_position(plan.identity, loader.batches_per_epoch());
  // A fit that failed may have left steps unreported; this one goes on
  // from the devices' state.
  gpu_unreported_ = 0;
  // An executor that runs ahead has a step's results read once the next
  // step's first batch is enqueued; a step whose callbacks need the
  // trainer's state after it (needs_state_at_step: callbacks::Checkpoint's
  // saves) is reported before the next one is enqueued instead.
  const bool ahead = runs_ahead(options);
  struct Fitting {
    bool& flag;
    explicit Fitting(bool& f) : flag(f) { flag = true; }
    ~Fitting() { flag = false; }
  } fitting(fitting_);
  events.fit_begin(info);

  const int first_epoch = resumed ? resumed->epoch + (resumed->ended ? 1 : 0) : 1;
  for (int epoch = first_epoch; epoch <= options.epochs && !stop_.get(); ++epoch) {
    // An epoch stopped part-way goes on with its next batch and its sums.
    const bool part = resumed && epoch == resumed->epoch;
    position_ = part ? *resumed : TrainingPosition{.epoch = epoch};
    loader.start_epoch(static_cast<std::size_t>(epoch - 1), position_.batches);
    epoch_begin();
    const auto start = std::chrono::steady_clock::now() -
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(position_.seconds));
    StepInfo step{.epoch = epoch, .epochs = options.epochs, .steps = info.steps_per_epoch};
    step.step = position_.steps;
    step.samples = position_.samples;
    // The epoch's skipped non-finite steps are not in its loss and accuracy:
    // their denominators are not in position_.denominator.
    // A step counts once it is reported: the position and Dropout's
    // counter never stand in the middle of one.
    struct Ran {
      std::size_t batches = 0, samples = 0;
    };
    const auto report = [&](const Ran& ran, std::optional<cpu::LossSums> sums) {
      if (!sums) sums = finish_step(epoch, step.step + 1, options);
      gpu_unreported_ -= ran.batches;
      position_.batches += ran.batches;
      steps_ += 1;
      const double denominator = loss_denominator_ == Denominator::samples
                                     ? static_cast<double>(ran.samples)
                                     : sums->denominator;
      // A step with no counted position (the engine skipped its update).
      step.skipped = sums->overflowed || !nonfinite_.empty() || denominator == 0.0;
      step.nonfinite = nonfinite_;
      step.step_samples = ran.samples;
      step.samples += ran.samples;
      if (nonfinite_.empty()) {
        position_.loss_sum += sums->loss;
        position_.denominator += denominator;
        position_.correct += sums->correct;
        position_.errors += sums->errors;
        position_.references += sums->references;
      }
      step.step_loss = mean_over(sums->loss, denominator);
      step.step_accuracy = mean_over(static_cast<double>(sums->correct), denominator);
      step.step += 1;
      step.loss = mean_over(position_.loss_sum, position_.denominator);
      step.accuracy = mean_over(static_cast<double>(position_.correct), position_.denominator);
      step.error_rate = error_rate_of(position_.errors, position_.references);
      step.seconds = seconds_since(start);
      position_.steps = step.step;
      position_.samples = step.samples;
      position_.seconds = step.seconds;
      events.step(step);
    };
    detail::StepGroups groups(options.accumulation_steps, options.batch_size, plan.epoch_samples,
                              position_.samples);
    Ran gathering;                // the step whose batches are being run
    std::optional<Ran> pending;  // ahead: the step before, run and not reported
    // Dropout's counter at the step's start: a step that fails leaves it
    // there, as it leaves the position.
    std::uint64_t step_first_batch = batches_;
    data::Batch batch{};
    while (loader.next(batch)) {
      if (groups.at_step_start()) {
        if (pending && events.needs_state_at_step(steps_ + 1))
          report(*std::exchange(pending, std::nullopt), std::nullopt);
        // stop() takes effect at a step's first batch: a step still being
        // reported completes.
        if (stop_.get()) break;
        // A callback changed the weights through model(): the stages or
        // replicas take them now.
        before_step();
      }
      const auto place = groups.next(batch.size);
      const std::size_t number = step.step + 1 + (pending ? 1 : 0);
      if (!place.accumulate) {
        step_first_batch = batches_;
        events.step_begin(step_begin(epoch, number - 1, info, options));
      }
      std::optional<cpu::LossSums> sums;
      try {
        sums = run_batch(batch, place.group_samples, place.accumulate, place.last, epoch, number,
                         options);
      } catch (...) {
        // The failed step's batches updated nothing; a step run ahead of
        // it stays unreported.
        gpu_unreported_ -= gathering.batches;
        batches_ = step_first_batch;
        throw;
      }
      gpu_unreported_ += 1;
      gathering.batches += 1;
      gathering.samples += batch.size;
      if (pending) report(*std::exchange(pending, std::nullopt), std::nullopt);
      if (!place.last) continue;
      if (sums || !ahead)
        report(std::exchange(gathering, {}), sums);
      else
        pending = std::exchange(gathering, {});
    }
    if (pending) report(*pending, std::nullopt);
    if (stop_.get() && position_.batches < loader.batches_per_epoch()) break;
    // Before the callbacks, like the GPU's copy; across processes model()
    // cannot gather (it is not collective) and returns these.
    epoch_done();
    position_.ended = true;
    [[maybe_unused]] const EpochInfo done{
        epoch,        options.epochs,
        mean_over(position_.loss_sum, position_.denominator),
        mean_over(static_cast<double>(position_.correct), position_.denominator),
        position_.samples, seconds_since(start),
        error_rate_of(position_.errors, position_.references)};
    events.epoch_end(done);
  }
}

#endif  // LOOM_IMPLEMENT

}  // namespace detail
}  // namespace loom

// save_with, load_with and resume_position (which run_fit calls).
#include "trainer_checkpoint.hpp"
