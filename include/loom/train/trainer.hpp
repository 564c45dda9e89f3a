// Trainer<Net, Policy, Optimizer>: fits a network to a dataset. The policy
// says how the network is spread over devices; the optimizer how weights move.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <optional>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/cpu/threads.hpp"
#include "../comm/communicator.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/data.hpp"
#include "../loss/softmax_cross_entropy.hpp"
#include "../net/model.hpp"
#include "../optim/adam.hpp"
#include "../optim/any_optimizer.hpp"
#include "../optim/clip.hpp"
#include "../optim/loss_scaler.hpp"
#include "../optim/sgd.hpp"
#include "../parallel/data_parallel.hpp"
#include "../parallel/hybrid.hpp"
#include "../parallel/model_split.hpp"
#include "../parallel/single_device.hpp"
#include "agreement.hpp"
#include "checkpoint.hpp"

#if defined(__CUDACC__)
#include "../gpu/model.cuh"
#include "../gpu/pipeline.cuh"
#include "../backend/cuda/staging.hpp"
#endif

namespace loom {

struct TrainerOptions {
  // Weight initialisation and Dropout's masks (a loaded checkpoint brings its own).
  std::uint64_t seed = 0;
  // On a GPU: capture each training step as a CUDA graph and replay it (off
  // launches every kernel directly, for debuggers and profilers), and allow
  // TF32 tensor-core math (faster, inputs rounded to a 10-bit mantissa).
  bool cuda_graphs = true;
  bool allow_tf32 = false;
  // ModelSplit: the pipeline schedule and micro-batch count to run instead
  // of the policy's (micro_batches 0: keep the policy's schedule).
  PipelineSchedule schedule{};
  // Compute precision (see core/precision.hpp): bf16 or fp16 with fp32
  // master weights; fp16 scales the loss dynamically (`loss_scaling`),
  // skipping the steps whose gradients overflow. A step that overflows even
  // at the minimum scale is a non-finite step (FitOptions::on_nonfinite).
  // CPU devices emulate both; on GPUs both run on tensor cores
  // (backend/cuda/precision.cuh), the loss scale kept on the device under
  // SingleDevice and DataParallel (loss_scaling.cuh) and by the trainer, as
  // on CPU devices, under ModelSplit and Hybrid, whose host reads every
  // step's end.
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
  data::Augment augment{};  // random crops and flips of the training images
  bool drop_last = false;   // skip an epoch's last batch when it is short
  // Clip each step's gradients to this global norm, over every layer,
  // replica and stage (PyTorch's clip_grad_norm_); 0: never.
  float max_grad_norm = 0.0f;
  // A step whose loss or gradients are not finite.
  NonFinite on_nonfinite = NonFinite::raise;
};

struct EvalResult {
  double loss = 0.0;      // mean cross-entropy
  double accuracy = 0.0;  // fraction in [0, 1]
  std::size_t samples = 0;
};

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

}  // namespace detail

template <class Net_, class Policy_ = SingleDevice, class Optimizer_ = SGD>
class Trainer {
 public:
  using Net = Net_;
  using Policy = Policy_;
  using Optimizer = Optimizer_;
  using Loss = SoftmaxCrossEntropy;
  static constexpr std::size_t classes = Net::output_shape::size;

  static_assert(
      Net::output_shape::rank == 1,
      "Trainer: the network must end in a flat vector of class scores (end with Linear<classes>)");

  // `processes`: for DataParallel or ModelSplit across MPI processes, the
  // world communicator (dist::Environment::world()); this process then
  // trains one replica, or one stage (its rank's), on its one device.
  Trainer(std::vector<Device> devices, typename Optimizer::Options options = {},
          TrainerOptions trainer_options = {}, comm::Comm processes = {})
      : devices_(std::move(devices)),
        options_(trainer_options),
        model_(trainer_options.seed),
        optimizer_(options, Net::parameter_count),
        scaler_(trainer_options.loss_scaling),
        base_lr_(options.lr) {
    if constexpr (Policy::devices_needed == 0)
      LOOM_CHECK(!devices_.empty(), Policy::name,
                 " needs at least one device; pass devices::all() or devices::cpu(n)");
    else if (!processes)  // across processes each has its own (checked by the engine)
      LOOM_CHECK(devices_.size() == Policy::devices_needed, Policy::name, " runs on ",
                 Policy::devices_needed, " device(s)", grid_text(), " but ", devices_.size(),
                 " were given; pass that many (e.g. devices::cpu(", Policy::devices_needed, "))");
    LOOM_CHECK(!devices_.empty(), Policy::name, " was given no device");
    LOOM_CHECK(!processes || is_data_parallel<Policy> || is_pipelined<Policy>, Policy::name,
               " does not run across processes; use DataParallel<>, ModelSplit<...> or "
               "Hybrid<...> with a communicator");
    if (processes) {
      process_count_ = static_cast<std::size_t>(processes.size());
      process_rank_ = static_cast<std::size_t>(processes.rank());
    }
    for (const auto& device : devices_) {
      LOOM_CHECK(device.kind == devices_.front().kind, "devices ", devices_.front().name(), " and ",
                 device.name(), " are of different kinds; give one kind");
#if !defined(__CUDACC__)
      LOOM_CHECK(device.kind == Device::Kind::cpu, "device ", device.name(),
                 " needs the CUDA backend: compile with nvcc to use GPUs");
#endif
    }
    if constexpr (is_data_parallel<Policy>) {
      if (devices_.front().kind == Device::Kind::cpu)
        engine_ = std::make_unique<Engine>(devices_, std::move(processes), trainer_options.seed,
                                           options);
      else
        processes_ = std::move(processes);
    }
    if constexpr (is_pipelined<Policy>) {
      grid_ = pipeline_grid<Policy>(
          processes ? static_cast<std::size_t>(processes.size()) : devices_.size());
      // On GPUs the stages are made by the first fit() or evaluate(), for its batch size.
      if (devices_.front().kind == Device::Kind::cpu)
        pipeline_ = std::make_unique<Pipeline>(devices_, std::move(processes), model_, options,
                                               grid_, trainer_options.schedule);
      else
        LOOM_CHECK(!processes, policy_name(), " across processes runs on CPU devices so far; on "
                   "GPUs give one process all the stages' GPUs (a GPU may hold several stages)");
    }
  }

  // The policy's name (Hybrid<replicas_from_devices, ...> with one replica
  // is a ModelSplit).
  const char* policy_name() const {
    if constexpr (is_pipelined<Policy>)
      return grid_.policy;
    else
      return Policy::name;
  }

  // Which device (or MPI process) holds which replica and stage, and its
  // layers; callbacks::Progress prints it when fit() begins.
  std::vector<Placement> placement() const {
    return loom::placement<Net, Policy>(devices_, process_count_, process_rank_);
  }

  // Across MPI processes fit() first compares, in one collective, what
  // every process must share (Fingerprint: the network, policy, optimizer
  // and its options, precision, the fit's options, the data, and what the
  // callbacks add in on_fit_prepare): processes that differ, or one whose
  // checks failed, all raise a loom::Error naming the first difference
  // before anything trains.
  template <class... Callbacks>
  void fit(const data::Dataset& train, FitOptions options, Callbacks&&... callbacks) {
    std::exception_ptr failure;
    Fingerprint fingerprint;
    try {
      check_fit(train, options);
      describe_fit(fingerprint, train, options);
      const FitInfo preview{.epochs = options.epochs,
                            .steps_per_epoch = steps_per_epoch(train.count, options),
                            .samples_per_epoch = train.count,
                            .batch_size = options.batch_size,
                            .policy = policy_name(),
                            .placement = {}};
      (call_fit_prepare(callbacks, preview, fingerprint), ...);
    } catch (...) {
      failure = std::current_exception();
    }
    if (const auto differ = compare_processes(detail::AgreementPhase::fit, fingerprint, failure);
        differ.kind != detail::Disagreement::Kind::none)
      throw Error(detail::disagreement_text(differ, detail::AgreementPhase::fit, process_rank_));
    data::Loader loader(
        train,
        {.batch_size = options.batch_size,
         .shuffle = options.shuffle,
         .seed = options.seed,
         .drop_last = options.drop_last,
         .augment = options.augment});
    const std::size_t k = options.accumulation_steps;
    const FitInfo info{options.epochs,      (loader.batches_per_epoch() + k - 1) / k,
                       train.count,         options.batch_size,
                       policy_name(),       placement()};
    const FitIdentity identity{.samples = train.count,
                               .batch_size = options.batch_size,
                               .accumulation_steps = k,
                               .seed = options.seed,
                               .shuffle = options.shuffle,
                               .drop_last = options.drop_last,
                               .crop_padding = options.augment.crop_padding,
                               .horizontal_flip = options.augment.horizontal_flip};
    // With drop_last the epoch ends before the data set does.
    const std::size_t epoch_samples =
        options.drop_last ? loader.batches_per_epoch() * options.batch_size : train.count;
    // A batch larger than the data set is the data set: memory is planned
    // for what a step takes, not for what was asked.
    const std::size_t planned_batch = std::min(options.batch_size, train.count);
    stop_.set(false);
#if defined(__CUDACC__)
    if constexpr (is_pipelined<Policy>) {
      if (on_gpu()) gpu_split(planned_batch);
    } else if (on_gpu()) {
      fit_gpu(loader, options, info, identity, epoch_samples, callbacks...);
      (call_fit_end(callbacks), ...);
      return;
    }
#endif
    cpu::set_threads(devices_.front().threads);
    if constexpr (is_data_parallel<Policy>) {
      engine_->reserve(planned_batch);
      scatter_if_changed();
    } else if constexpr (is_pipelined<Policy>) {
      scatter_if_changed();
    }
    else
      model_.reserve(planned_batch);
    // A loaded checkpoint's position: this fit goes on from there.
    const auto resumed = resume_position(identity, loader.batches_per_epoch());
    (call_fit_begin(callbacks, info), ...);

    const int first_epoch = resumed ? resumed->epoch + (resumed->ended ? 1 : 0) : 1;
    for (int epoch = first_epoch; epoch <= options.epochs && !stop_.get(); ++epoch) {
      // An epoch stopped part-way goes on with its next batch and its sums.
      const bool part = resumed && epoch == resumed->epoch;
      position_ = part ? *resumed : TrainingPosition{.epoch = epoch};
      loader.start_epoch(static_cast<std::size_t>(epoch - 1), position_.batches);
      const auto start = std::chrono::steady_clock::now() -
                         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(position_.seconds));
      StepInfo step{.epoch = epoch, .epochs = options.epochs, .steps = info.steps_per_epoch};
      step.step = position_.steps;
      step.samples = position_.samples;
      // Samples of the epoch's skipped non-finite steps: not in its loss and
      // accuracy. (Counted from this fit's start: a resumed epoch's earlier
      // skips are not known.)
      std::size_t skipped_samples = 0;
      detail::StepGroups groups(k, options.batch_size, epoch_samples, position_.samples);
      data::Batch batch{};
      // A step counts once all its batches are in: the position and
      // Dropout's counter never stand in the middle of one (an error in a
      // step leaves them at its start).
      std::size_t step_batches = 0;
      std::uint64_t step_first_batch = batches_;
      while (loader.next(batch)) {
        const auto place = groups.next(batch.size);
        if (!place.accumulate) {
          step_first_batch = batches_;
          // A callback changed the weights through model(): the stages or
          // replicas take them now.
          scatter_if_changed();
        }
        if (!place.accumulate)
          (call_step_begin(callbacks, step_begin(epoch, step.step, info, options)), ...);
        cpu::LossSums sums;
        try {
          sums = micro_step(batch, place.group_samples, place.accumulate, place.last, epoch,
                            step.step + 1, options);
        } catch (...) {
          batches_ = step_first_batch;
          throw;
        }
        step.samples += batch.size;
        step_batches += 1;
        if (!place.last) continue;
        position_.batches += std::exchange(step_batches, 0);
        steps_ += 1;
        step.skipped = sums.overflowed || !nonfinite_.empty();
        step.nonfinite = nonfinite_;
        step.step_samples = step.samples - position_.samples;
        if (nonfinite_.empty()) {
          position_.loss_sum += sums.loss;
          position_.correct += sums.correct;
        } else {
          skipped_samples += step.step_samples;
        }
        step.step_loss = sums.loss / static_cast<double>(step.step_samples);
        step.step_accuracy =
            static_cast<double>(sums.correct) / static_cast<double>(step.step_samples);
        step.step += 1;
        const auto counted =
            static_cast<double>(std::max<std::size_t>(1, step.samples - skipped_samples));
        step.loss = position_.loss_sum / counted;
        step.accuracy = static_cast<double>(position_.correct) / counted;
        step.seconds = seconds_since(start);
        position_.steps = step.step;
        position_.samples = step.samples;
        position_.seconds = step.seconds;
        (call_step(callbacks, step), ...);
        if (stop_.get()) break;
      }
      if (stop_.get() && position_.batches < loader.batches_per_epoch()) break;
      // Before the callbacks, like the GPU's copy; across processes model()
      // cannot gather (it is not collective) and returns these.
      if constexpr (is_pipelined<Policy>)
        with_split([&](auto& engine) { engine.gather(model_); });
      position_.ended = true;
      const std::size_t counted = position_.samples - std::min(skipped_samples, position_.samples);
      [[maybe_unused]] const EpochInfo done{
          epoch,        options.epochs,
          counted > 0 ? position_.loss_sum / static_cast<double>(counted) : 0.0,
          counted > 0 ? static_cast<double>(position_.correct) / static_cast<double>(counted)
                      : 0.0,
          position_.samples, seconds_since(start)};
      (call_epoch_end(callbacks, done), ...);
    }
    (call_fit_end(callbacks), ...);
  }

  // Ends fit() after the optimizer step in progress (from a callback, a
  // signal handler or another thread): a checkpoint saved then resumes at
  // the next batch. Across MPI processes every process must call it at the
  // same step.
  void stop() { stop_.set(true); }

  // batch_size 0: the training batch size when fit() has run (the arena
  // already holds it), else 256.
  // On a GPU, a batch size above the one fit() planned for is evaluated in
  // pieces of that size (the sums are the same).
  EvalResult evaluate(const data::Dataset& dataset, std::size_t batch_size = 0) {
    check_dataset(dataset, "evaluate");
    double loss_sum = 0.0;
    std::size_t correct = 0;
#if defined(__CUDACC__)
    if (on_gpu() && !is_pipelined<Policy>) {
      const auto sums = evaluate_gpu(dataset, batch_size);
      loss_sum = sums.loss;
      correct = sums.correct;
    }
#endif
    if (!on_gpu() || is_pipelined<Policy>) {
      if constexpr (is_data_parallel<Policy>) {
        scatter_if_changed();
        const auto sums =
            engine_->evaluate(dataset, batch_size == 0 ? 256 : batch_size, options_.precision);
        loss_sum = sums.loss;
        correct = sums.correct;
      } else if constexpr (is_pipelined<Policy>) {
        // On GPUs: in pieces of at most the batch the stages were planned for.
#if defined(__CUDACC__)
        if (on_gpu() && !gpu_pipeline_) gpu_split(batch_size == 0 ? 256 : batch_size);
#endif
        scatter_if_changed();
        const auto sums = with_split([&](auto& engine) {
          return engine.evaluate(dataset, batch_size == 0 ? 256 : batch_size, options_.precision);
        });
        loss_sum = sums.loss;
        correct = sums.correct;
      } else {
        if (batch_size == 0) batch_size = model_.capacity() > 0 ? model_.capacity() : 256;
        cpu::set_threads(devices_.front().threads);
        model_.set_precision(options_.precision);
        const auto sums = detail::evaluate_samples(model_, dataset, 0, dataset.count, batch_size);
        loss_sum = sums.loss;
        correct = sums.correct;
      }
    }
    EvalResult result;
    result.samples = dataset.count;
    result.loss = loss_sum / static_cast<double>(dataset.count);
    result.accuracy = static_cast<double>(correct) / static_cast<double>(dataset.count);
    return result;
  }

  // On a GPU the device holds the weights: this copies them here first, and
  // the next fit() or evaluate() copies them back, so changes made through
  // the reference count. The const overload returns them as of the end of
  // the last fit(). (The GPU keeps its own optimizer state: optimizer()'s
  // buffers are the CPU's, and take the GPU's when save() writes them.)
  //
  // ModelSplit: the stages' weights gathered into one Model (a copy, like
  // the GPU's); across processes, as of the end of the last epoch.
  // DataParallel on CPUs: replica 0's Model; the other replicas take its
  // weights and running statistics at the next fit() or evaluate() (within
  // one process; across processes it is read-only, like ModelSplit's).
  Model<Net, float>& model() {
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu()) {
        host_changed_ = true;  // the other replicas take replica 0's weights next
        return engine_->model();
      }
    if constexpr (is_pipelined<Policy>) {
      // Across processes nothing is gathered: the copy is read-only there
      // (a change would overwrite the stages with old weights). Gathered
      // once: a second call must not overwrite the first one's changes.
      if (split_ready())
        with_split([&](auto& engine) {
          if (engine.all_local() && !host_changed_) {
            engine.gather(model_);
            host_changed_ = true;
          }
        });
      else
        host_changed_ = true;
      return model_;
    }
#if defined(__CUDACC__)
    if (!gpus_.empty()) {
      gpus_.front().use();
      gpus_.front().model->copy_parameters_to(model_);
      host_changed_ = true;
    }
#endif
    return model_;
  }
  const Model<Net, float>& model() const {
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu()) return engine_->model();
    return model_;
  }

  // ModelSplit's engine on CPU devices (its stages' reports, its schedule).
  auto& model_split()
    requires is_pipelined<Policy>
  {
    LOOM_CHECK(pipeline_ != nullptr, "Trainer::model_split(): the engine is the CPU devices'; "
               "on GPUs the stages are DeviceStages");
    return *pipeline_;
  }

  // DataParallel's engine on CPU devices (the replicas and their communicators).
  auto& data_parallel()
    requires is_data_parallel<Policy>
  {
    LOOM_CHECK(engine_ != nullptr, "Trainer::data_parallel(): the engine is the CPU devices'; on "
               "GPUs the replicas are DeviceModels");
    return *engine_;
  }
  const std::vector<Device>& devices() const { return devices_; }
  // The optimizer's options and learning rate (schedules set it here). Its
  // state (momentum, moments, step count) is the one device's; under
  // DataParallel each replica keeps its own, under ModelSplit each stage
  // (a checkpoint gathers them).
  typename Optimizer::template State<float>& optimizer() { return optimizer_; }
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
  // Each local device's time in the last optimizer step (a data-parallel
  // replica or pipeline stage: its own jobs; wait for others included);
  // empty on GPUs, whose steps run asynchronously.
  std::vector<double> device_step_seconds() const {
    if (on_gpu()) return {};
    if constexpr (is_data_parallel<Policy>)
      return engine_->step_seconds();
    else if constexpr (is_pipelined<Policy>)
      return pipeline_->step_seconds();
    else
      return {step_seconds_};
  }

  // Writes a checkpoint (safetensors; atomically: a crash mid-write keeps
  // the file that was there): weights, running statistics, optimizer state
  // and the position in the fit, in the whole network's layout, so it loads
  // under any policy and device count. Across MPI processes every process
  // calls it (the stages' parts are gathered) and rank 0 writes.
  void save(const std::filesystem::path& path) {
    LOOM_CHECK(gpu_unreported_ == 0, "Trainer::save: called while the GPU runs a step that "
               "fit() has not reported (the GPU runs a step ahead of the callbacks, and a fit "
               "that failed may leave one behind); save from callbacks::Checkpoint, at an "
               "epoch's end, from a step callback whose needs_state_at_step(steps) is true for "
               "that step, or after a fit that ended");
    pull_from_gpu();
    detail::CheckpointImage image;
    Model<Net, float>* model = &model_;
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu()) model = &engine_->model();
    // A pipeline on GPUs made by no fit yet: model_ and optimizer_ hold all.
    bool gather = false;
    if constexpr (is_pipelined<Policy>) {
      scatter_if_changed();  // weights edited through model() count
      gather = split_ready();
      if (gather) with_split([&](auto& engine) { engine.gather(model_); });
    }
    image.parameters.assign(model->parameters().begin(), model->parameters().end());
    image.state.assign(model->state().begin(), model->state().end());
    const auto& optimizer = local_optimizer();
    for (std::size_t b = 0; b < optimizer.buffer_count(); ++b) {
      image.buffer_names.emplace_back(optimizer.buffer_name(b));
      if constexpr (is_pipelined<Policy>) {
        if (gather) {
          image.buffers.emplace_back(Net::parameter_count, 0.0f);
          with_split([&](auto& e) { e.gather_optimizer(b, image.buffers.back().data()); });
          continue;
        }
      }
      image.buffers.emplace_back(optimizer.buffer(b).begin(), optimizer.buffer(b).end());
    }
    image.optimizer = detail::optimizer_name<Optimizer>(optimizer_);
    image.optimizer_steps = optimizer.steps();
    if constexpr (is_pipelined<Policy>) {
      if (gather) {
        image.optimizer_steps = with_split([](auto& e) { return e.optimizer_steps(); });
        // optimizer() shows the stages' state, as it shows a GPU's after save().
        for (std::size_t b = 0; b < image.buffers.size(); ++b)
          std::ranges::copy(image.buffers[b], optimizer_.buffer(b).begin());
        optimizer_.set_steps(image.optimizer_steps);
      }
    }
    for (const auto& [name, value] : optimizer_.options().hyperparameters())
      image.optimizer_options.emplace_back(name, value);
    image.lr = optimizer_.options().lr;
    image.base_lr = base_lr_;
    image.steps = steps_;
    image.seed = options_.seed;
    image.batches = batches_;
    image.precision = std::string(precision_name(options_.precision));
    image.loss_scale = scaler_.scale();
    image.good_steps = scaler_.good_steps();
    image.skipped_steps = skipped_steps_;
    image.nonfinite_steps = nonfinite_steps_;
    image.position = position_;
    image.fit = fit_;
    image.network = detail::type_label<Net>();
    image.policy = policy_name();
    // Rank 0 writes; every process learns whether it could.
    std::string failure;
    if (process_rank_ == 0) {
      try {
        detail::write_checkpoint<Net>(path, image);
      } catch (const std::exception& error) {  // out of memory too: the others must hear
        failure = error.what();
      }
    }
    if (any_process_failed(!failure.empty())) {
      if (!failure.empty()) throw Error(failure);
      LOOM_FAIL("Trainer::save: process 0 could not write checkpoint '", path.string(),
                "' (its error says why)");
    }
  }

  // Reads a checkpoint written by save() under any policy or device count.
  // Names, shapes and types are checked first: a loom::Error names the first
  // mismatch, and leaves the trainer as it was. With `resume` the next fit()
  // goes on from the checkpoint's position (with the same optimizer options
  // but lr, data and batch options; a different set-up is an error naming
  // it); without, it starts a fit of its own, with its own options, from the
  // checkpoint's weights and optimizer state.
  void load(const std::filesystem::path& path, bool resume = true) {
    std::vector<std::string> names;
    for (std::size_t b = 0; b < optimizer_.buffer_count(); ++b)
      names.emplace_back(optimizer_.buffer_name(b));
    const auto options = optimizer_.options().hyperparameters();
    // Across processes every one reads the file; all go on only if all
    // could, and read the same: a stale copy on one node would split them.
    detail::CheckpointImage image;
    std::exception_ptr failure;
    Fingerprint read;
    try {
      image = detail::read_checkpoint<Net>(path, detail::optimizer_name<Optimizer>(optimizer_),
                                           names, options);
      if (resume) detail::check_resumed_options(image, options, path.string());
      read.add("checkpoint contents", detail::fingerprint(image)).add("load.resume", resume);
    } catch (...) {
      failure = std::current_exception();
    }
    const auto differ = compare_processes(detail::AgreementPhase::load, read, failure);
    using Kind = detail::Disagreement::Kind;
    LOOM_CHECK(differ.kind != Kind::failed, "Trainer::load: another process could not read "
               "checkpoint '", path.string(), "' (process ", differ.rank, ": ", differ.failure,
               "); every process needs the file");
    LOOM_CHECK(differ.kind != Kind::field || differ.name != "checkpoint contents",
               "Trainer::load: checkpoint '", path.string(), "' is not the same file on every "
               "process (its weights or position differ); give every process the same checkpoint");
    if (differ.kind != Kind::none)
      throw Error(detail::disagreement_text(differ, detail::AgreementPhase::load, process_rank_));
    const auto put = [&](Model<Net, float>& model, auto& optimizer) {
      std::ranges::copy(image.parameters, model.parameters().begin());
      std::ranges::copy(image.state, model.state().begin());
      for (std::size_t b = 0; b < image.buffers.size(); ++b)
        std::ranges::copy(image.buffers[b], optimizer.buffer(b).begin());
      optimizer.set_steps(image.optimizer_steps);
      optimizer.set_lr(resume ? image.lr : base_lr_);
    };
    put(model_, optimizer_);
    // Before push_to_gpu, which hands fp16's scale to the GPUs.
    scaler_.restore(image.loss_scale, image.good_steps);
    skipped_steps_ = image.skipped_steps;
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu())
        for (std::size_t r = 0; r < engine_->local_replicas(); ++r)
          put(engine_->replica_model(r), engine_->replica_optimizer(r));
    push_to_gpu();
    // A pipeline on GPUs made by a later fit starts from model_ and optimizer_.
    if constexpr (is_pipelined<Policy>) {
      if (split_ready()) {
        with_split([&](auto& engine) {
          engine.scatter(model_);
          for (std::size_t b = 0; b < image.buffers.size(); ++b)
            engine.scatter_optimizer(b, image.buffers[b].data());
          engine.set_optimizer_steps(image.optimizer_steps);
        });
        host_changed_ = false;
      }
    }
    if (resume) {
      base_lr_ = image.base_lr;
      fit_ = image.fit;
      position_ = image.position;
    } else {
      position_ = {};  // a new fit's, not the checkpoint's
    }
    steps_ = image.steps;
    options_.seed = image.seed;  // Dropout's masks go on as they would have
    batches_ = image.batches;
    nonfinite_steps_ = image.nonfinite_steps;
    resume_ = resume && image.position.epoch > 0 ? std::optional(image.position) : std::nullopt;
    resume_fit_ = resume ? image.fit : std::nullopt;
  }

 private:
  // The optimizer state this process updates (a replica's or stage's
  // under the parallel policies; the trainer's own holds the options).
  const typename Optimizer::template State<float>& local_optimizer() {
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu()) return engine_->replica_optimizer(0);
    return optimizer_;
  }

  // On GPUs (SingleDevice, DataParallel): the device's weights, running
  // statistics and optimizer state into model_ and optimizer_, for a
  // checkpoint (weights changed through model() since are kept: the host
  // holds the newer ones); and back after a checkpoint was loaded.
  void pull_from_gpu() {
#if defined(__CUDACC__)
    if constexpr (!is_pipelined<Policy>) {
      if (gpus_.empty()) return;
      auto& first = gpus_.front();
      first.use();
      if (!host_changed_) first.model->copy_parameters_to(model_);
      pull_optimizer(*first.model);
    }
#endif
  }
  // Weights changed through model() during a fit on GPUs: onto the
  // replicas before the next step (the CPU's scatter_if_changed).
  void push_host_edits() {
#if defined(__CUDACC__)
    if (!host_changed_ || gpus_.empty()) return;
    for (auto& replica : gpus_) {
      replica.use();
      replica.model->copy_parameters_from(model_);
    }
    host_changed_ = false;
#endif
  }
  void push_to_gpu() {
#if defined(__CUDACC__)
    if constexpr (!is_pipelined<Policy>) {
      if (gpus_.empty()) return;
      host_changed_ = true;
      push_host_edits();
      for (auto& replica : gpus_) {
        replica.use();
        push_optimizer(*replica.model);
        push_scaler(*replica.model);
      }
    }
#endif
  }

  // The sum of `value` over the MPI processes (every process must call
  // it); in one process, `value`.
  double sum_over_processes(double value) {
    if (process_count_ <= 1) return value;
    if constexpr (is_data_parallel<Policy>) {
      if (on_gpu()) {
        processes_.all_reduce(std::span<double>(&value, 1), comm::ReduceOp::sum);
        return value;
      }
      return engine_->sum_over_ranks(value);
    }
    else if constexpr (is_pipelined<Policy>)
      return pipeline_->sum_over_ranks(value);
    else
      return value;
  }
  // Whether any process reports `failed`.
  bool any_process_failed(bool failed) { return sum_over_processes(failed ? 1.0 : 0.0) > 0.0; }


  // fit()'s checks of its arguments, made before the processes compare them.
  void check_fit(const data::Dataset& train, const FitOptions& options) {
    check_dataset(train, "fit");
    LOOM_CHECK(options.epochs >= 1, "fit: epochs must be >= 1, got ", options.epochs);
    LOOM_CHECK(options.batch_size >= 1, "fit: batch size must be >= 1");
    LOOM_CHECK(options.accumulation_steps >= 1, "fit: accumulation_steps must be >= 1");
    LOOM_CHECK(options.max_grad_norm >= 0.0f && std::isfinite(options.max_grad_norm),
               "fit: max_grad_norm must be a finite number >= 0 (0: no clipping), got ",
               options.max_grad_norm);
    if constexpr (is_data_parallel<Policy> && Net::syncs) {
      // Found now rather than when the epoch's last batch comes.
      const std::size_t last = train.count % options.batch_size;
      const auto replicas = static_cast<std::size_t>(engine_->world());
      LOOM_CHECK(options.drop_last || last == 0 || last >= replicas, "fit: the last batch of an "
                 "epoch of '", train.name, "' has ", last, " sample(s) for ", replicas,
                 " replicas, and SyncBatchNorm needs a sample on each; set "
                 "FitOptions::drop_last or a batch size that leaves at least ", replicas);
    }
  }

  static std::size_t steps_per_epoch(std::size_t samples, const FitOptions& options) {
    const std::size_t batches =
        data::batches_per_epoch(samples, options.batch_size, options.drop_last);
    return (batches + options.accumulation_steps - 1) / options.accumulation_steps;
  }

  // What every process of a fit must share (the callbacks add theirs).
  void describe_fit(Fingerprint& f, const data::Dataset& train, const FitOptions& options) const {
    f.add("network", detail::type_label<Net>())
        .add("policy", detail::type_label<Policy>())
        .add("device kind", devices_.front().kind == Device::Kind::cpu ? "cpu" : "cuda")
        .add("devices per process", devices_.size())
        .add("optimizer", detail::optimizer_name<Optimizer>(optimizer_))
        .add("optimizer.lr", base_lr_);
    for (const auto& [name, value] : optimizer_.options().hyperparameters())
      f.add(std::string("optimizer.") + name, value);
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
    if constexpr (is_pipelined<Policy>) {
      // The one that runs (micro_batches 0: the policy's).
      const auto& schedule =
          options_.schedule.micro_batches == 0 ? grid_.schedule : options_.schedule;
      f.add("schedule", pipeline_kind_name(schedule.kind))
          .add("micro_batches", schedule.micro_batches);
    }
    f.add("resume", resume_ ? "after batch " + std::to_string(resume_->batches) + " of epoch " +
                                  std::to_string(resume_->epoch)
                            : std::string("none"))
        .add("fit.epochs", options.epochs)
        .add("fit.batch_size", options.batch_size)
        .add("fit.accumulation_steps", options.accumulation_steps)
        .add("fit.shuffle", options.shuffle)
        .add("fit.seed", options.seed)
        .add("fit.drop_last", options.drop_last)
        .add("fit.augment.crop_padding", options.augment.crop_padding)
        .add("fit.augment.horizontal_flip", options.augment.horizontal_flip)
        .add("fit.max_grad_norm", options.max_grad_norm)
        .add("fit.on_nonfinite", options.on_nonfinite == NonFinite::raise ? "raise" : "skip")
        .add_data("data", train);
  }

  // Every process's (phase, fingerprint, failure) compared across the
  // processes. The process whose failure it is raises its own error; the
  // others learn how they differ (the caller raises). In one process: its
  // own failure only.
  detail::Disagreement compare_processes(detail::AgreementPhase phase,
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

  // Every process's `row`, process r's as row r (a collective).
  std::vector<double> gather_over_processes(std::span<const double> row) {
    if constexpr (is_data_parallel<Policy>) {
      if (on_gpu()) return comm::gather_rows(processes_, row);
      return engine_->gather_rows(row);
    } else if constexpr (is_pipelined<Policy>) {
      return pipeline_->gather_rows(row);
    } else {
      return {row.begin(), row.end()};
    }
  }

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
                                                  std::size_t batches_per_epoch) {
    if (!resume_ || !resume_fit_) {
      resume_.reset();
      resume_fit_.reset();
      fit_ = identity;
      // A new fit's position from its start: a save before its first epoch
      // (a stop() in on_fit_begin) must not pair the last fit's position
      // with this fit's options.
      position_ = {};
      return std::nullopt;
    }
    const auto& saved = resume_fit_;
    const auto differs = [](const char* setting, const char* what, auto was, auto now) {
      if (was == now) return;
      std::ostringstream text;
      text << "loom: fit: the loaded checkpoint stopped in a fit with " << what << " " << was
           << ", but this fit has " << now << "; resume with the same data and FitOptions, "
           << "or load(path, false) to start a new fit from the checkpoint's weights";
      throw ResumeMismatch(text.str(), setting, (std::ostringstream() << was).str(),
                           (std::ostringstream() << now).str());
    };
    differs("samples", "training samples", saved->samples, identity.samples);
    differs("batch_size", "batch size", saved->batch_size, identity.batch_size);
    differs("accumulation_steps", "accumulation_steps", saved->accumulation_steps,
            identity.accumulation_steps);
    differs("seed", "seed", saved->seed, identity.seed);
    differs("shuffle", "shuffle", saved->shuffle, identity.shuffle);
    differs("drop_last", "drop_last", saved->drop_last, identity.drop_last);
    differs("augment.crop_padding", "augment.crop_padding", saved->crop_padding,
            identity.crop_padding);
    differs("augment.horizontal_flip", "augment.horizontal_flip", saved->horizontal_flip,
            identity.horizontal_flip);
    LOOM_CHECK(resume_->batches <= batches_per_epoch && resume_->epoch >= 1, "fit: the loaded "
               "checkpoint stopped after batch ", resume_->batches, " of epoch ", resume_->epoch,
               ", but its fit's epochs have ", batches_per_epoch, " batches; it is corrupt");
    fit_ = identity;
    resume_fit_.reset();
    return std::exchange(resume_, std::nullopt);
  }

  bool on_gpu() const { return devices_.front().kind == Device::Kind::cuda; }

#if defined(__CUDACC__)
  // One DeviceModel (and its stager) per GPU: the SingleDevice's, or
  // DataParallel's replicas, each an NcclComm rank.
  struct GpuReplica {
    Device device;
    std::unique_ptr<loom::gpu::DeviceModel<Net>> model;
    std::unique_ptr<loom::gpu::BatchStager> stager;
    int rank = 0;
    void use() const { LOOM_CUDA_CHECK(cudaSetDevice(device.index)); }
  };

  int gpu_world() const { return nccl_.empty() ? 1 : nccl_.front().size(); }

  // The host's optimizer state (a fresh one's zeros, or a checkpoint's)
  // onto a DeviceModel, or the device's back here (for a checkpoint).
  void push_optimizer(loom::gpu::DeviceModel<Net>& model) {
    for (std::size_t b = 0; b < optimizer_.buffer_count(); ++b)
      model.copy_optimizer_from(b, optimizer_.buffer(b));
    model.set_optimizer_steps(optimizer_.steps());
  }
  // fp16: the host's loss scale (a fresh one's, or a checkpoint's) onto a
  // DeviceModel, which keeps it from then on; report() brings it back here.
  void push_scaler(loom::gpu::DeviceModel<Net>& model) {
    if (options_.precision == Precision::fp16)
      model.set_loss_scale({.scale = scaler_.scale(),
                            .good_steps = scaler_.good_steps(),
                            .skipped_steps = skipped_steps_});
  }
  void pull_optimizer(loom::gpu::DeviceModel<Net>& model) {
    for (std::size_t b = 0; b < optimizer_.buffer_count(); ++b)
      model.copy_optimizer_to(b, optimizer_.buffer(b));
    optimizer_.set_steps(model.optimizer_steps());
  }

  // DataParallel: this process's NCCL rank, made once (after checking that
  // every process runs the same program).
  void ensure_nccl() {
    if constexpr (is_data_parallel<Policy>) {
      if (nccl_.empty()) {
        // One thread drives this process's replicas, and NCCL's calls for
        // several GPUs from one thread must be grouped, which a captured
        // step's cannot be: one GPU per process.
        LOOM_CHECK(devices_.size() == 1, Policy::name, " over ", devices_.size(),
                   " GPUs of one process is not supported yet; start one process per GPU "
                   "(mpirun -np ", devices_.size(), ") and give each its own, "
                   "dist::Environment::devices()");
        if (processes_) {
          LOOM_CHECK(devices_.size() == 1, Policy::name, " over ", processes_.size(),
                     " processes takes one GPU per process, but this one was given ",
                     devices_.size());
          detail::check_same_program<Net, Policy, Optimizer>(processes_);
          nccl_.push_back(comm::NcclComm::create(processes_, devices_.front().index));
        } else {
          std::vector<int> ordinals;
          for (const auto& d : devices_) ordinals.push_back(d.index);
          nccl_ = comm::NcclComm::create_local(ordinals);
        }
      }
    }
  }

  // The replicas, planned for global batches up to `batch` (made again,
  // weights and momentum carried over, when a larger one comes).
  std::vector<GpuReplica>& gpu_replicas(std::size_t batch, bool accumulation = false) {
    ensure_nccl();
    const std::size_t share =
        batch_share(batch, static_cast<std::size_t>(gpu_world()), 0).count;
    if (gpus_.empty() || gpus_.front().model->max_batch() < share ||
        (accumulation && !gpus_.front().model->options().gradient_accumulation)) {
      const bool keep_accumulation =
          accumulation || (!gpus_.empty() && gpus_.front().model->options().gradient_accumulation);
      std::vector<GpuReplica> made;
      for (std::size_t r = 0; r < devices_.size(); ++r) {
        GpuReplica replica{devices_[r], nullptr, nullptr, nccl_.empty() ? 0 : nccl_[r].rank()};
        replica.use();
        // Never smaller than before (turning accumulation on keeps the size).
        const std::size_t planned = std::max<std::size_t>(
            {share, std::size_t{1}, gpus_.empty() ? 0 : gpus_.front().model->max_batch()});
        replica.model = std::make_unique<loom::gpu::DeviceModel<Net>>(
            model_, planned, loom::gpu::device_optimizer(optimizer_.options()),
            loom::gpu::DeviceModelOptions{
                .graphs = options_.cuda_graphs,
                .allow_tf32 = options_.allow_tf32,
                .precision = options_.precision,
                .loss_scaling = options_.loss_scaling,
                .data_parallel = nccl_.empty() ? nullptr : &nccl_[r],
                .bucket_bytes = bucket_bytes(),
                .gradient_accumulation = keep_accumulation});
        if (!gpus_.empty()) {
          replica.model->copy_state_from(*gpus_[r].model);
        } else {
          push_optimizer(*replica.model);
          push_scaler(*replica.model);
        }
        replica.stager = std::make_unique<loom::gpu::BatchStager>(
            replica.model->max_batch(), Net::input_shape::size, replica.model->input_slots());
        made.push_back(std::move(replica));
      }
      gpus_ = std::move(made);
    }
    if (host_changed_) {
      for (auto& replica : gpus_) {
        replica.use();
        replica.model->copy_parameters_from(model_);
      }
      host_changed_ = false;
    }
    return gpus_;
  }

  // Stages each replica's share of the host batch into its model's next
  // input slot and enqueues a step on it; returns the slot (the same on all).
  // A training batch belongs to an optimizer step over group_n samples (see
  // FitOptions::accumulation_steps).
  int enqueue_gpu_step(const float* images, const std::int32_t* labels, std::size_t n,
                       bool train, std::size_t group_n = 0, bool accumulate = false,
                       bool last = true) {
    int slot = 0;
    const std::size_t sample = Net::input_shape::size;
    // Dropout's step, as micro_step counts it on CPUs.
    const std::uint64_t batch_number = train ? batches_++ : 0;
    for (auto& replica : gpus_) {
      replica.use();
      const auto share = batch_share(n, static_cast<std::size_t>(gpu_world()),
                                     static_cast<std::size_t>(replica.rank));
      auto& model = *replica.model;
      const auto staged = replica.stager->stage(images + share.first * sample,
                                                labels + share.first, share.count);
      replica.stager->ready(staged, model.stream());
      if (train) {
        model.set_pass({.seed = options_.seed, .step = batch_number, .first_sample = share.first});
        model.train_micro_step(staged.slot, share.count, n, group_n == 0 ? n : group_n,
                               accumulate, last);
      } else {
        model.evaluate_step(staged.slot, share.count, n);
      }
      replica.stager->consumed(staged, model.stream());
      slot = staged.slot;
    }
    return slot;
  }

  // Every replica's totals after its last step on `slot`; the sums are
  // global (all ranks hold the same), a bad label's details are its rank's.
  loom::gpu::LossTotals wait_gpu_totals(int slot) {
    loom::gpu::LossTotals first{};
    for (std::size_t r = 0; r < gpus_.size(); ++r) {
      gpus_[r].use();
      const auto totals = gpus_[r].model->wait_totals(slot);
      if (r == 0) first = totals;
      if (totals.halted == loom::gpu::halt_bad_label && totals.bad_row != ~0ull) {
        first.bad_label = totals.bad_label;
        first.bad_row = totals.bad_row;
      }
    }
    return first;
  }

  // The loss of an optimizer step is read on the host late: its totals are
  // waited for once the next batch is enqueued, so the GPU never waits for
  // the host. A step whose callbacks need the trainer's state after it
  // (needs_state_at_step: callbacks::Checkpoint's saves) is reported before
  // the next one is enqueued instead. The position follows the reported
  // steps, and a loaded checkpoint's fit goes on from its position.
  template <class... Callbacks>
  void fit_gpu(data::Loader& loader, const FitOptions& options, const FitInfo& info,
               const FitIdentity& identity, std::size_t epoch_samples,
               Callbacks&... callbacks) {
    const std::size_t k = options.accumulation_steps;
    auto& replicas = gpu_replicas(std::min(options.batch_size, info.samples_per_epoch), k > 1);
    const bool fp16 = options_.precision == Precision::fp16;
    const bool skip_nonfinite = options.on_nonfinite == NonFinite::skip;
    // Adam's update depends on its step number, which a step skipped for
    // an fp16 overflow or a non-finite value does not take, and only the
    // device knows whether it did: then each step is reported before the
    // next is enqueued.
    const bool report_each_step =
        (fp16 || skip_nonfinite) &&
        std::string_view(detail::optimizer_name<Optimizer>(optimizer_)) != SGD::name;
    for (auto& replica : replicas) {
      replica.use();
      replica.model->set_max_grad_norm(options.max_grad_norm);
      replica.model->set_skip_nonfinite(skip_nonfinite);
    }
    const auto resumed = resume_position(identity, loader.batches_per_epoch());
    // A fit that failed may have left steps unreported; this one goes on
    // from the device's state.
    gpu_unreported_ = 0;
    // What the reported steps leave. A step the device halted (a non-finite
    // loss, a bad label) skipped its update and every later one: the
    // counters go back to them (Dropout's, Adam's step count), as the CPU
    // leaves them at the step's start, and the device is at the position.
    std::uint64_t reported_batches = batches_;
    std::uint64_t reported_updates = replicas.front().model->optimizer_steps();
    const auto rewind = [&] {
      gpu_unreported_ = 0;
      batches_ = reported_batches;
      for (auto& replica : replicas) replica.model->set_optimizer_steps(reported_updates);
    };
    (call_fit_begin(callbacks, info), ...);
    const int first_epoch = resumed ? resumed->epoch + (resumed->ended ? 1 : 0) : 1;
    for (int epoch = first_epoch; epoch <= options.epochs && !stop_.get(); ++epoch) {
      const bool part = resumed && epoch == resumed->epoch;
      position_ = part ? *resumed : TrainingPosition{.epoch = epoch};
      // The device's totals count from here (a resumed epoch's sums come first).
      const TrainingPosition base = position_;
      loader.start_epoch(static_cast<std::size_t>(epoch - 1), position_.batches);
      const auto start = std::chrono::steady_clock::now() -
                         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(position_.seconds));
      StepInfo step{.epoch = epoch, .epochs = options.epochs, .steps = info.steps_per_epoch};
      step.step = position_.steps;
      step.samples = position_.samples;
      for (auto& replica : replicas) {
        replica.use();
        replica.model->reset_totals();
      }
      // Steps skipped as non-finite: their sums (the device's totals hold
      // their finite batches') leave the epoch's loss and accuracy, as on
      // the CPU; their samples stay in the count.
      double dropped_loss = 0.0;
      std::size_t dropped_correct = 0, dropped_samples = 0;
      // While its callbacks run, the batches enqueued after it are
      // unreported: save() refuses then (the device is past the position).
      const auto report = [&](int slot, std::size_t batches) {
        const auto totals = wait_gpu_totals(slot);
        // fp16: the scale as the device left it after this step.
        loom::gpu::LossScaleState scaling{.scale = scaler_.scale()};
        if (fp16) scaling = replicas.front().model->loss_scale(slot);
        nonfinite_.clear();
        try {
          check_totals(totals, epoch, step.step + 1, scaling.scale);
          if (totals.skipped != loom::gpu::skipped_none) {
            const bool loss_bad = totals.skipped == loom::gpu::skipped_loss;
            handle_nonfinite(loss_bad ? totals.nonfinite_loss : 0.0, {}, epoch, step.step + 1,
                             options.on_nonfinite,
                             fp16 && !loss_bad ? min_scale_note(scaling.scale) : std::string(),
                             true);
          }
        } catch (...) {
          rewind();
          throw;
        }
        if (fp16) {
          scaler_.restore(scaling.scale, scaling.good_steps);
          skipped_steps_ = scaling.skipped_steps;
        }
        const bool nonfinite = !nonfinite_.empty();
        step.skipped = scaling.overflowed != 0 || nonfinite;
        step.nonfinite = nonfinite_;
        // The update was counted when enqueued; the device skipped it
        // (the CPU's optimizer never takes a skipped step).
        if (step.skipped)
          for (auto& replica : replicas)
            replica.model->set_optimizer_steps(replica.model->optimizer_steps() - 1);
        gpu_unreported_ -= batches;
        reported_batches += batches;
        reported_updates += step.skipped ? 0 : 1;
        steps_ += 1;
        step.step += 1;
        const std::size_t samples = base.samples + static_cast<std::size_t>(totals.samples);
        double loss_sum = base.loss_sum + totals.loss - dropped_loss;
        std::size_t correct =
            base.correct + static_cast<std::size_t>(totals.correct) - dropped_correct;
        step.step_samples = samples - step.samples;
        const auto step_n = static_cast<double>(std::max<std::size_t>(1, step.step_samples));
        step.step_loss = totals.skipped == loom::gpu::skipped_loss
                             ? totals.nonfinite_loss / step_n
                             : (loss_sum - position_.loss_sum) / step_n;
        step.step_accuracy = static_cast<double>(correct - position_.correct) / step_n;
        if (nonfinite) {
          dropped_loss += loss_sum - position_.loss_sum;
          dropped_correct += correct - position_.correct;
          dropped_samples += step.step_samples;
          loss_sum = position_.loss_sum;
          correct = position_.correct;
        }
        step.samples = samples;
        const auto counted =
            static_cast<double>(std::max<std::size_t>(1, samples - dropped_samples));
        step.loss = loss_sum / counted;
        step.accuracy = static_cast<double>(correct) / counted;
        step.seconds = seconds_since(start);
        position_.batches += batches;
        position_.steps = step.step;
        position_.samples = samples;
        position_.loss_sum = loss_sum;
        position_.correct = correct;
        position_.seconds = step.seconds;
        (call_step(callbacks, step), ...);
      };
      // The optimizer step whose totals are still to be read, by its slot:
      // read once the next batch is enqueued (on the other slot), before a
      // later one could reuse this slot.
      int pending = -1;
      std::size_t pending_batches = 0, step_batches = 0;
      detail::StepGroups groups(k, options.batch_size, epoch_samples, position_.samples);
      data::Batch batch{};
      // stop() takes effect at a step's first batch: the step before it,
      // still being reported, completes.
      while (loader.next(batch)) {
        if (pending >= 0 && groups.at_step_start() &&
            (report_each_step || (needs_state_at_step(callbacks, steps_ + 1) || ...)))
          report(std::exchange(pending, -1), pending_batches);
        if (stop_.get() && groups.at_step_start()) break;
        // A callback changed the weights through model(): the GPUs take them now.
        if (groups.at_step_start()) push_host_edits();
        const auto place = groups.next(batch.size);
        if (!place.accumulate)
          (call_step_begin(callbacks,
                           step_begin(epoch, step.step + (pending >= 0 ? 1 : 0), info, options)),
           ...);
        for (auto& replica : replicas) {
          replica.use();
          replica.model->set_lr(optimizer_.options().lr);
        }
        const int slot = enqueue_gpu_step(batch.images, batch.labels, batch.size, true,
                                          place.group_samples, place.accumulate, place.last);
        step_batches += 1;
        gpu_unreported_ += 1;
        if (pending >= 0) report(std::exchange(pending, -1), pending_batches);
        if (place.last) {
          pending = slot;
          pending_batches = std::exchange(step_batches, 0);
        }
      }
      if (pending >= 0) report(pending, pending_batches);
      if (stop_.get() && position_.batches < loader.batches_per_epoch()) break;
      // Before the callbacks: Evaluate and a user's on_epoch_end see this epoch's weights.
      push_host_edits();
      replicas.front().use();
      replicas.front().model->copy_parameters_to(model_);
      position_.ended = true;
      [[maybe_unused]] const EpochInfo done{epoch,         options.epochs, step.loss,
                                            step.accuracy, step.samples,   seconds_since(start)};
      (call_epoch_end(callbacks, done), ...);
    }
  }

  static constexpr std::size_t bucket_bytes() {
    if constexpr (is_data_parallel<Policy>)
      return Policy::bucket_bytes;
    else
      return default_bucket_bytes;
  }

  // With DataParallel this is collective: every rank must call it.
  cpu::LossSums evaluate_gpu(const data::Dataset& dataset, std::size_t batch_size) {
    // Existing replicas are kept (a fit may be running: this can be a
    // callback's call); larger requests are evaluated in pieces of their size.
    ensure_nccl();
    const auto world = static_cast<std::size_t>(gpu_world());
    auto& replicas =
        gpu_replicas(gpus_.empty() ? (batch_size == 0 ? 256 : batch_size) * world
                                   : gpus_.front().model->max_batch() * world);
    const std::size_t most = replicas.front().model->max_batch();
    const std::size_t piece = batch_size == 0 ? most : std::min(batch_size, most);
    const std::size_t sample = dataset.sample_size();
    for (auto& replica : replicas) {
      replica.use();
      replica.model->reset_totals();
    }
    // Every rank takes the same number of steps (they are collective); a
    // rank whose share has run out takes empty ones.
    const std::size_t steps = (batch_share(dataset.count, world, 0).count + piece - 1) / piece;
    int last = 0;
    const auto step_of = [&](std::size_t rank, std::size_t j) {
      const auto share = batch_share(dataset.count, world, rank);
      const std::size_t done = std::min(share.count, j * piece);
      return std::pair{share.first + done, std::min(piece, share.count - done)};
    };
    for (std::size_t j = 0; j < steps; ++j) {
      std::size_t global = 0;  // over every rank, this process's or not
      for (std::size_t r = 0; r < world; ++r) global += step_of(r, j).second;
      for (auto& replica : replicas) {
        replica.use();
        const auto [first, n] = step_of(static_cast<std::size_t>(replica.rank), j);
        const auto staged = replica.stager->stage(dataset.images.data() + first * sample,
                                                  dataset.labels.data() + first, n);
        replica.stager->ready(staged, replica.model->stream());
        replica.model->evaluate_step(staged.slot, n, global);
        replica.stager->consumed(staged, replica.model->stream());
        last = staged.slot;
      }
    }
    const auto totals = wait_gpu_totals(last);
    if (totals.halted == loom::gpu::halt_bad_label)
      LOOM_FAIL("evaluate: dataset '", dataset.name, "': label ", totals.bad_label,
                " of a sample is outside the network's ", classes, " classes");
    return {totals.loss, static_cast<std::size_t>(totals.correct)};
  }

  // loss_scale: fp16's, which the device leaves as it was at a halt.
  // Raises the CPU's words (handle_nonfinite), without the first
  // non-finite output or gradient, which the device does not look for.
  void check_totals(const loom::gpu::LossTotals& totals, int epoch, std::size_t step,
                    float loss_scale) {
    if (totals.halted == loom::gpu::halt_gradient_overflow)
      handle_nonfinite(0.0, {}, epoch, step, NonFinite::raise, min_scale_note(loss_scale));
    if (totals.halted == loom::gpu::halt_nonfinite_gradients)
      handle_nonfinite(0.0, {}, epoch, step, NonFinite::raise, {}, true);
    if (totals.halted == loom::gpu::halt_nonfinite_loss)
      handle_nonfinite(totals.halt_loss, {}, epoch, step, NonFinite::raise);
    if (totals.halted == loom::gpu::halt_bad_label && totals.bad_row == ~0ull)
      LOOM_FAIL("a label in step ", step, " of epoch ", epoch, " is outside the network's ",
                classes, " classes (in another rank's share of the batch)");
    if (totals.halted == loom::gpu::halt_bad_label)
      LOOM_FAIL("label ", totals.bad_label, " of sample ", totals.bad_row,
                gpu_world() > 1 ? " of this rank's share" : "", " in step ", step, " of epoch ",
                epoch, " is outside the network's ", classes, " classes");
  }
#endif

  // One batch of an optimizer step on the CPU (see FitOptions::accumulation_steps):
  // returns the step's loss and correct-count sums once `last`.
  cpu::LossSums micro_step(const data::Batch& batch, std::size_t group_samples, bool accumulate,
                           bool last, int epoch, std::size_t step, const FitOptions& fit) {
    const float max_grad_norm = fit.max_grad_norm;
    nonfinite_.clear();
    cpu::LossSums sums;
    const Pass pass{.training = true, .seed = options_.seed, .step = batches_++};
    const StepSettings settings{
        .lr = optimizer_.options().lr,
        .max_grad_norm = max_grad_norm,
        .precision = options_.precision,
        .loss_scale = options_.precision == Precision::fp16 ? scaler_.scale() : 1.0f,
        .at_min_scale = options_.precision == Precision::fp16 && scaler_.at_min_scale()};
    if constexpr (is_data_parallel<Policy> || is_pipelined<Policy>) {
      const auto run = [&](auto& engine) {
        return engine.micro_step(batch.images, batch.labels, batch.size, group_samples,
                                 accumulate, last, settings, pass);
      };
      if constexpr (is_data_parallel<Policy>)
        sums = run(*engine_);
      else
        sums = with_split(run);
      if (!last) return {};
      NonFiniteSpot spot;
      const auto fault_of = [](auto& engine) {
        if constexpr (requires { engine.fault(); })
          return engine.fault();
        else
          return NonFiniteSpot{};
      };
      // GPU stages say so when their gradients were not finite and the
      // host found no spot to name.
      bool gradients_bad = false;
      if constexpr (is_data_parallel<Policy>) {
        spot = fault_of(*engine_);
      } else {
        spot = with_split(fault_of);
        with_split([&](auto& engine) {
          if constexpr (requires { engine.gradients_nonfinite(); })
            gradients_bad = engine.gradients_nonfinite();
        });
      }
      // The replicas or stages skipped their update. An fp16 overflow's
      // spot (at the minimum scale) is the scale's to report.
      if (sums.overflowed ||
          !handle_nonfinite(sums.loss, spot, epoch, step, fit.on_nonfinite, {}, gradients_bad))
        note_overflow(sums, spot, epoch, step, fit.on_nonfinite);
    } else {
      const auto began = std::chrono::steady_clock::now();
      if (!accumulate) {
        pending_ = {};
        spot_ = {};
        step_seconds_ = 0.0;
        model_.keep_state();  // before the forward updates the running statistics
      }
      model_.set_precision(settings.precision);
      const float* logits = model_.forward(batch.images, batch.size, 0, pass);
      const auto batch_sums =
          Loss::evaluate<float>(logits, batch.labels, batch.size, classes, group_samples,
                                model_.output_gradient(), settings.loss_scale);
      // Looked for now, while this batch's outputs are alive.
      if (!std::isfinite(batch_sums.loss) && !spot_) spot_ = model_.find_nonfinite_output(0);
      pending_.loss += batch_sums.loss;
      pending_.correct += batch_sums.correct;
      model_.backward(accumulate);
      step_seconds_ += seconds_since(began);
      if (!last) return {};
      const auto update_began = std::chrono::steady_clock::now();
      sums = pending_;
      // Checked before the update, so the weights (and running statistics)
      // stay those of the last good step. fp16's gradients are checked when
      // unscaled: non-finite there is an overflow, which backs the scale off.
      const bool fp16 = settings.precision == Precision::fp16;
      if (!std::isfinite(sums.loss) || (!fp16 && !model_.gradients_finite())) {
        if (!spot_) spot_ = model_.find_nonfinite_output(0);
        if (!spot_) spot_ = model_.find_nonfinite_gradient();
        model_.restore_state();
        step_seconds_ += seconds_since(update_began);
        handle_nonfinite(sums.loss, spot_, epoch, step, fit.on_nonfinite);
        return sums;
      }
      sums.overflowed = fp16 && !unscale_gradients(model_.gradients(), settings.loss_scale);
      if (sums.overflowed) {
        if (scaler_.at_min_scale()) spot_ = model_.find_nonfinite_gradient();
        model_.restore_state();
      } else {
        if (max_grad_norm > 0.0f) clip_gradients<Net>(model_.gradients(), max_grad_norm);
        optimizer_.step(model_.parameters(), model_.gradients());
      }
      step_seconds_ += seconds_since(update_began);
      note_overflow(sums, spot_, epoch, step, fit.on_nonfinite);
    }
    return sums;
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

  // model() handed out the weights: the stages take them back, or the
  // other replicas take replica 0's. (Across processes model() is
  // read-only: the other processes could not know to take part.)
  void scatter_if_changed() {
    if constexpr (is_pipelined<Policy>)
      if (split_ready() && std::exchange(host_changed_, false))
        with_split([&](auto& engine) { engine.scatter(model_); });
    if constexpr (is_data_parallel<Policy>)
      if (!on_gpu() && std::exchange(host_changed_, false) && engine_->all_local())
        engine_->share_first_replica();
  }

  // ModelSplit: f(its engine): the GPUs' or the CPU devices'.
  template <class F>
  decltype(auto) with_split(F&& f) {
#if defined(__CUDACC__)
    if (on_gpu()) return f(*gpu_pipeline_);
#endif
    return f(*pipeline_);
  }
  bool split_ready() const {
#if defined(__CUDACC__)
    if (on_gpu()) return gpu_pipeline_ != nullptr;
#endif
    return pipeline_ != nullptr;
  }

#if defined(__CUDACC__)
  // ModelSplit or Hybrid on GPUs: stages planned for global batches up to `batch`
  // (made again, weights and momentum carried over, when a larger one comes).
  void gpu_split(std::size_t batch) {
    if constexpr (is_pipelined<Policy>) {
      if (gpu_pipeline_ && gpu_pipeline_->max_batch() >= batch) return;
      // The old stages hand over weights and optimizer state; weights
      // changed through model() since follow (scatter_if_changed). The
      // first stages start from model_ and optimizer_ (a fresh optimizer's
      // zeros, or a loaded checkpoint's state).
      const bool first = !gpu_pipeline_;
      if (first) host_changed_ = false;
      auto made = std::make_unique<GpuPipeline>(
          devices_, model_, loom::gpu::device_optimizer(optimizer_.options()), grid_,
          options_.schedule, options_.precision, options_.allow_tf32,
          std::max(batch, gpu_pipeline_ ? gpu_pipeline_->max_batch() : std::size_t{1}),
          gpu_pipeline_.get());
      if (first) {
        for (std::size_t b = 0; b < optimizer_.buffer_count(); ++b)
          made->scatter_optimizer(b, optimizer_.buffer(b).data());
        made->set_optimizer_steps(optimizer_.steps());
      }
      gpu_pipeline_ = std::move(made);
    }
  }
#endif

  // After a step that every device skipped when its loss or gradients
  // were not finite (`spot`: where first, when a device looked;
  // `scale_note`: the words for fp16's overflow at its minimum scale;
  // `gradients_bad`: a GPU found them non-finite without a spot):
  // raises, or (NonFinite::skip) counts it and says why in nonfinite_.
  // False for a finite step.
  bool handle_nonfinite(double loss, const NonFiniteSpot& spot, int epoch, std::size_t step,
                        NonFinite on_nonfinite, const std::string& scale_note = {},
                        bool gradients_bad = false) {
    if (std::isfinite(loss) && !spot && scale_note.empty() && !gradients_bad) return false;
    const std::string what =
        (std::isfinite(loss) ? std::string("the gradients became non-finite")
                             : "the training loss became " + loss_text(loss)) +
        " at epoch " + std::to_string(epoch) + ", step " + std::to_string(step) +
        (std::isfinite(loss) ? " under a finite loss" : "") + scale_note +
        (spot ? ": " + detail::spot_text<Net>(spot) : std::string());
    if (on_nonfinite == NonFinite::raise)
      LOOM_FAIL(what, "; the weights are kept from the step before. Lower the learning rate or "
                "check the input data (FitOptions::on_nonfinite = NonFinite::skip skips such "
                "steps)");
    nonfinite_steps_ += 1;
    nonfinite_ = what;
    return true;
  }

  static std::string min_scale_note(float scale) {
    return ", even at fp16's minimum loss scale " + detail::number_text(scale) +
           " (LossScaling::min_scale)";
  }

  void check_dataset(const data::Dataset& dataset, const char* what) const {
    LOOM_CHECK(dataset.count > 0, what, ": dataset '", dataset.name, "' is empty");
    LOOM_CHECK(dataset.sample_size() == Net::input_shape::size, what, ": dataset '", dataset.name,
               "' has samples of ", dataset.channels, "x", dataset.height, "x", dataset.width,
               " = ", dataset.sample_size(), " values but the network's Input holds ",
               Net::input_shape::size);
    LOOM_CHECK(dataset.classes <= classes, what, ": dataset '", dataset.name, "' has ",
               dataset.classes, " classes but the network outputs ", classes, " scores");
    LOOM_CHECK(dataset.images.size() == dataset.count * dataset.sample_size() &&
                   dataset.labels.size() == dataset.count,
               what, ": dataset '", dataset.name, "' holds ", dataset.images.size(),
               " image values and ", dataset.labels.size(), " labels for ", dataset.count,
               " samples");
  }

  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // " (R replicas x S stages)" for the policies laid out as a grid.
  static std::string grid_text() {
    if constexpr (is_hybrid<Policy>)
      if (Policy::replicas > 0)
        return " (" + std::to_string(Policy::replicas) + " replicas x " +
               std::to_string(Policy::stages) + " stages)";
    return "";
  }

  template <class C>
  void call_fit_prepare(C& callback, const FitInfo& info, Fingerprint& fingerprint) {
    if constexpr (requires { callback.on_fit_prepare(info, fingerprint, *this); })
      callback.on_fit_prepare(info, fingerprint, *this);
    else if constexpr (requires { callback.on_fit_prepare(info, fingerprint); })
      callback.on_fit_prepare(info, fingerprint);
  }
  template <class C>
  void call_fit_begin(C& callback, const FitInfo& info) {
    if constexpr (requires { callback.on_fit_begin(info, *this); })
      callback.on_fit_begin(info, *this);
    else if constexpr (requires { callback.on_fit_begin(info); })
      callback.on_fit_begin(info);
  }
  template <class C>
  void call_step_begin(C& callback, const StepBegin& info) {
    if constexpr (requires { callback.on_step_begin(info, *this); })
      callback.on_step_begin(info, *this);
    else if constexpr (requires { callback.on_step_begin(info); })
      callback.on_step_begin(info);
  }
  template <class C>
  void call_step(C& callback, const StepInfo& info) {
    if constexpr (requires { callback.on_step(info, *this); })
      callback.on_step(info, *this);
    else if constexpr (requires { callback.on_step(info); })
      callback.on_step(info);
  }
  // Whether the callback's on_step after optimizer step `steps` (as
  // steps() counts) reads or saves the trainer's state: a GPU must then not
  // have begun the next step.
  template <class C>
  static bool needs_state_at_step(const C& callback, std::uint64_t steps) {
    if constexpr (requires { callback.needs_state_at_step(steps); })
      return callback.needs_state_at_step(steps);
    else
      return false;
  }
  template <class C>
  void call_fit_end(C& callback) {
    if constexpr (requires { callback.on_fit_end(*this); })
      callback.on_fit_end(*this);
    else if constexpr (requires { callback.on_fit_end(); })
      callback.on_fit_end();
  }
  template <class C>
  void call_epoch_end(C& callback, const EpochInfo& info) {
    if constexpr (requires { callback.on_epoch_end(info, *this); })
      callback.on_epoch_end(info, *this);
    else if constexpr (requires { callback.on_epoch_end(info); })
      callback.on_epoch_end(info);
  }

  struct NoEngine {};
  using Engine = std::conditional_t<is_data_parallel<Policy>,
                                    detail::DataParallelEngine<Net, Policy, Optimizer>, NoEngine>;
  // The pipelined policies' engines are types over the network and the
  // stage cut: ModelSplit and every Hybrid over one cut share them.
  struct NoPipeline {};
  static auto pipeline_types() {
    if constexpr (is_pipelined<Policy>) {
      using Partition = typename Policy::partition;
#if defined(__CUDACC__)
      return std::pair<detail::PipelineEngine<Net, Partition, Optimizer>*,
                       gpu::PipelineEngine<Net, Partition>*>{};
#else
      return std::pair<detail::PipelineEngine<Net, Partition, Optimizer>*, NoPipeline*>{};
#endif
    } else {
      return std::pair<NoPipeline*, NoPipeline*>{};
    }
  }
  using Pipeline = std::remove_pointer_t<decltype(pipeline_types().first)>;
#if defined(__CUDACC__)
  using GpuPipeline = std::remove_pointer_t<decltype(pipeline_types().second)>;
#endif

  std::vector<Device> devices_;
  TrainerOptions options_;
  Model<Net, float> model_;  // the single device's (DataParallel's replicas are the engine's)
  typename Optimizer::template State<float> optimizer_;
  cpu::LossSums pending_;  // the optimizer step's batches so far
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Pipeline> pipeline_;
  PipelineGrid grid_;  // pipelined policies: replicas, buckets, the policy's schedule
  comm::Comm processes_;  // DataParallel on GPUs across processes (bootstraps NCCL)
  std::size_t process_count_ = 0, process_rank_ = 0;  // across MPI processes
  bool host_changed_ = false;  // model() handed out the weights since the device(s) last had them
  // Training batches on the GPU(s) whose optimizer step is not reported yet
  // (fit_gpu): the device is past position_ while there are any.
  std::size_t gpu_unreported_ = 0;
  std::uint64_t batches_ = 0;  // training batches run: Dropout's step
  std::uint64_t steps_ = 0;    // optimizer steps taken
  double step_seconds_ = 0.0;  // one device: the last optimizer step's
  LossScaler scaler_;          // fp16's
  std::uint64_t skipped_steps_ = 0;  // fp16: steps whose gradients overflowed
  std::uint64_t nonfinite_steps_ = 0;  // NonFinite::skip: steps skipped for a non-finite value
  NonFiniteSpot spot_;     // one device: the step's first non-finite value so far
  std::string nonfinite_;  // the last optimizer step's, when it was skipped as non-finite
  float base_lr_;              // the learning rate given: schedules scale it
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
  TrainingPosition position_;
  std::optional<FitIdentity> fit_;  // the last fit's, for a checkpoint
  // A loaded checkpoint's position, which the next fit() goes on from.
  std::optional<TrainingPosition> resume_;
  std::optional<FitIdentity> resume_fit_;
#if defined(__CUDACC__)
  std::vector<comm::NcclComm> nccl_;  // DataParallel on GPUs: one rank per replica
  std::vector<GpuReplica> gpus_;      // after nccl_: destroyed first
  std::unique_ptr<GpuPipeline> gpu_pipeline_;  // ModelSplit or Hybrid on GPUs
#endif
};

}  // namespace loom
