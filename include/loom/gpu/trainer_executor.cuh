// The CUDA executor of a Trainer: what the trainer asks of GPUs
// (detail::GpuExecutor), on DeviceModels (SingleDevice, DataParallel: one
// per GPU, each an NCCL rank, stepped a step ahead of the host) and on the
// grid engine over GPU stages (ModelSplit, Hybrid: gpu/stage.cuh, the
// CPU's PipelineEngine with gpu::DeviceStages). loom.hpp includes it when nvcc
// compiles; a Trainer finds it by make_gpu_executor, so that train/ never
// names CUDA and the host compiler never sees this file.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/cuda/staging.hpp"
#include "../comm/nccl_comm.hpp"
#include "../train/trainer.hpp"
#include "model.cuh"
#include "stage.cuh"

namespace loom {
namespace gpu {

template <class Trainer>
class TrainerExecutor final : public ::loom::detail::GpuExecutor<Trainer> {
 public:
  TrainerExecutor() = default;

 private:
  using Net = typename Trainer::Net;
  using Policy = typename Trainer::Policy;
  using Optimizer = typename Trainer::Optimizer;
  static constexpr std::size_t classes = Trainer::classes;

  struct NoPipeline : ::loom::detail::SplitEngine<Net> {};
  static auto pipeline_type() {
    if constexpr (is_pipelined<Policy>)
      return static_cast<::loom::detail::PipelineEngine<Net, typename Policy::partition, Optimizer,
                                                        typename Trainer::Loss, DeviceStages>*>(
          nullptr);
    else
      return static_cast<NoPipeline*>(nullptr);
  }
  using Pipeline = std::remove_pointer_t<decltype(pipeline_type())>;

  // Not while the host holds edits the GPUs have not taken: they are newer.
  void weights_to_host(Trainer& t) override {
    if (gpus_.empty() || t.host_changed_) return;
    gpus_.front().use();
    gpus_.front().model->copy_parameters_to(t.model_);
    t.host_changed_ = true;
  }
  ::loom::detail::SplitEngine<Net>* split() const override { return pipeline_.get(); }

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
  void push_optimizer(Trainer& t, loom::gpu::DeviceModel<Net>& model) {
    for (std::size_t b = 0; b < t.optimizer_.buffer_count(); ++b)
      model.copy_optimizer_from(b, t.optimizer_.buffer(b));
    model.set_optimizer_steps(t.optimizer_.steps());
  }
  // fp16: the host's loss scale (a fresh one's, or a checkpoint's) onto a
  // DeviceModel, which keeps it from then on; report() brings it back here.
  void push_scaler(Trainer& t, loom::gpu::DeviceModel<Net>& model) {
    if (t.options_.precision == Precision::fp16)
      model.set_loss_scale({.scale = t.scaler_.scale(),
                            .good_steps = t.scaler_.good_steps(),
                            .skipped_steps = t.skipped_steps_});
  }
  void pull_optimizer(Trainer& t, loom::gpu::DeviceModel<Net>& model) {
    for (std::size_t b = 0; b < t.optimizer_.buffer_count(); ++b)
      model.copy_optimizer_to(b, t.optimizer_.buffer(b));
    t.optimizer_.set_steps(model.optimizer_steps());
  }

  // DataParallel: this process's NCCL rank, made once (after checking that
  // every process runs the same program).
  void ensure_nccl(Trainer& t) {
    if constexpr (is_data_parallel<Policy>) {
      if (nccl_.empty()) {
        // One thread drives this process's replicas, and NCCL's calls for
        // several GPUs from one thread must be grouped, which a captured
        // step's cannot be: one GPU per process.
        LOOM_CHECK(t.devices_.size() == 1, Policy::name, " over ", t.devices_.size(),
                   " GPUs of one process is not supported yet; start one process per GPU "
                   "(mpirun -np ", t.devices_.size(), ") and give each its own, "
                   "dist::Environment::devices()");
        if (t.processes_) {
          LOOM_CHECK(t.devices_.size() == 1, Policy::name, " over ", t.processes_.size(),
                     " processes takes one GPU per process, but this one was given ",
                     t.devices_.size());
          ::loom::detail::check_same_program<Net, Policy, Optimizer>(t.processes_);
          nccl_.push_back(comm::NcclComm::create(t.processes_, t.devices_.front().index));
        } else {
          std::vector<int> ordinals;
          for (const auto& d : t.devices_) ordinals.push_back(d.index);
          nccl_ = comm::NcclComm::create_local(ordinals);
        }
      }
    }
  }

  // The replicas, planned for global batches up to `batch` (made again,
  // weights and momentum carried over, when a larger one comes).
  std::vector<GpuReplica>& gpu_replicas(Trainer& t, std::size_t batch, bool accumulation = false) {
    ensure_nccl(t);
    const std::size_t share =
        batch_share(batch, static_cast<std::size_t>(gpu_world()), 0).count;
    if (gpus_.empty() || gpus_.front().model->max_batch() < share ||
        (accumulation && !gpus_.front().model->options().gradient_accumulation)) {
      const bool keep_accumulation =
          accumulation || (!gpus_.empty() && gpus_.front().model->options().gradient_accumulation);
      std::vector<GpuReplica> made;
      for (std::size_t r = 0; r < t.devices_.size(); ++r) {
        GpuReplica replica{t.devices_[r], nullptr, nullptr, nccl_.empty() ? 0 : nccl_[r].rank()};
        replica.use();
        // Never smaller than before (turning accumulation on keeps the size).
        const std::size_t planned = std::max<std::size_t>(
            {share, std::size_t{1}, gpus_.empty() ? 0 : gpus_.front().model->max_batch()});
        replica.model = std::make_unique<loom::gpu::DeviceModel<Net>>(
            t.model_, planned, loom::gpu::device_optimizer(t.optimizer_.options()),
            loom::gpu::DeviceModelOptions{
                .graphs = t.options_.cuda_graphs,
                .allow_tf32 = t.options_.allow_tf32,
                .precision = t.options_.precision,
                .loss_scaling = t.options_.loss_scaling,
                .data_parallel = nccl_.empty() ? nullptr : &nccl_[r],
                .bucket_bytes = bucket_bytes(),
                .gradient_accumulation = keep_accumulation});
        if (!gpus_.empty()) {
          replica.model->copy_state_from(*gpus_[r].model);
        } else {
          push_optimizer(t, *replica.model);
          push_scaler(t, *replica.model);
        }
        replica.stager = std::make_unique<loom::gpu::BatchStager>(
            replica.model->max_batch(), Net::input_shape::size, replica.model->input_slots());
        made.push_back(std::move(replica));
      }
      gpus_ = std::move(made);
    }
    if (t.host_changed_) {
      for (auto& replica : gpus_) {
        replica.use();
        replica.model->copy_parameters_from(t.model_);
      }
      t.host_changed_ = false;
    }
    return gpus_;
  }

  // Stages each replica's share of the host batch into its model's next
  // input slot and enqueues a step on it; returns the slot (the same on all).
  // A training batch belongs to an optimizer step over group_n samples (see
  // FitOptions::accumulation_steps).
  // `frames`: the samples' lengths (Targets::frames), or null.
  int enqueue_gpu_step(Trainer& t, const float* images, const std::int32_t* labels,
                       const std::int32_t* frames, std::size_t n, bool train,
                       std::size_t group_n = 0, bool accumulate = false, bool last = true) {
    int slot = 0;
    const std::size_t sample = Net::input_shape::size;
    // Dropout's step, as run_batch counts it on CPUs.
    const std::uint64_t batch_number = train ? t.batches_++ : 0;
    for (auto& replica : gpus_) {
      replica.use();
      const auto share = batch_share(n, static_cast<std::size_t>(gpu_world()),
                                     static_cast<std::size_t>(replica.rank));
      auto& model = *replica.model;
      const auto staged = replica.stager->stage(images + share.first * sample,
                                                labels + share.first, share.count);
      replica.stager->ready(staged, model.stream());
      model.set_frames(frames != nullptr && share.count > 0 ? frames + share.first : nullptr,
                       share.count);
      if (train) {
        model.set_pass({.seed = t.options_.seed, .step = batch_number, .first_sample = share.first});
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

  // SingleDevice and DataParallel: their steps in the trainer's fit loop
  // (TrainerCore::run_fit), and their evaluation; compiled only for those
  // policies (a pipeline's steps run through its split(), as on CPUs).
  void start_fit(Trainer& t, const ::loom::detail::FitPlan& plan) override {
    if constexpr (!is_pipelined<Policy>) {
      const FitOptions& options = plan.options;
      auto& replicas = gpu_replicas(t, std::min(options.batch_size, plan.info.samples_per_epoch),
                                    options.accumulation_steps > 1);
      for (auto& replica : replicas) {
        replica.use();
        replica.model->set_max_grad_norm(options.max_grad_norm);
        replica.model->set_skip_nonfinite(options.on_nonfinite == NonFinite::skip);
      }
      pending_slots_.clear();
      reported_updates_ = replicas.front().model->optimizer_steps();
    }
  }

  // Adam's update depends on its step number, which a step skipped for an
  // fp16 overflow or a non-finite value does not take, and only the device
  // knows whether it did: then each step is read before the next is
  // enqueued.
  bool runs_ahead(const Trainer& t, const FitOptions& options) const override {
    const bool may_skip =
        t.options_.precision == Precision::fp16 || options.on_nonfinite == NonFinite::skip;
    return !may_skip ||
           std::string_view(::loom::detail::optimizer_name<Optimizer>(t.optimizer_)) == SGD::name;
  }

  // The device's totals count from each epoch's start; a step's sums are
  // what it added to them.
  void epoch_begin(Trainer&) override {
    if constexpr (!is_pipelined<Policy>) reset_totals();
  }
  void reset_totals() {
    for (auto& replica : gpus_) {
      replica.use();
      replica.model->reset_totals();
    }
    read_totals_ = {};
  }

  void run_batch(Trainer& t, const data::Batch& batch, std::size_t group_samples, bool accumulate,
                 bool last) override {
    if constexpr (!is_pipelined<Policy>) {
      // A callback changed the weights through model() (or read them: the
      // copy is the device's): the GPUs take them now, before this batch,
      // so that no update enqueued since is overwritten.
      push_host_edits(t);
      for (auto& replica : gpus_) {
        replica.use();
        replica.model->set_lr(t.optimizer_.options().lr);
      }
      const int slot = enqueue_gpu_step(t, batch.images, batch.labels, batch.targets.frames,
                                        batch.size, true, group_samples, accumulate, last);
      // Read before a later batch could reuse the slot: run_fit reads a
      // step once the next step's first batch is enqueued, on the other slot.
      if (last) pending_slots_.push_back(slot);
    }
  }

  cpu::LossSums finish_step(Trainer& t, int epoch, std::size_t step,
                            const FitOptions& options) override {
    if constexpr (is_pipelined<Policy>) {
      return {};
    } else {
      LOOM_CHECK(!pending_slots_.empty(), "finish_step: no GPU step is waiting to be read");
      const int slot = pending_slots_.front();
      pending_slots_.pop_front();
      const auto totals = wait_gpu_totals(slot);
      const bool fp16 = t.options_.precision == Precision::fp16;
      // fp16: the scale as the device left it after this step.
      loom::gpu::LossScaleState scaling{.scale = t.scaler_.scale()};
      if (fp16) scaling = gpus_.front().model->loss_scale(slot);
      t.nonfinite_.clear();
      try {
        check_totals(t, totals, epoch, step, scaling.scale);
        if (totals.skipped != loom::gpu::skipped_none) {
          const bool loss_bad = totals.skipped == loom::gpu::skipped_loss;
          t.handle_nonfinite(loss_bad ? totals.nonfinite_loss : 0.0, {}, epoch, step,
                             options.on_nonfinite,
                             fp16 && !loss_bad ? t.min_scale_note(scaling.scale) : std::string(),
                             true);
        }
      } catch (...) {
        // A step the device halted (a non-finite loss, a bad label) skipped
        // its update and every later one: the device is at the steps read
        // before, and the counters go back to them (Dropout's, Adam's step
        // count), as the CPU leaves them at the step's start.
        t.batches_ -= t.gpu_unreported_;
        t.gpu_unreported_ = 0;
        pending_slots_.clear();
        for (auto& replica : gpus_) replica.model->set_optimizer_steps(reported_updates_);
        throw;
      }
      if (fp16) {
        t.scaler_.restore(scaling.scale, scaling.good_steps);
        t.skipped_steps_ = scaling.skipped_steps;
      }
      // The update was counted when enqueued; the device skipped it (the
      // CPU's optimizer never takes a skipped step).
      const bool skipped = scaling.overflowed != 0 || !t.nonfinite_.empty();
      if (skipped)
        for (auto& replica : gpus_)
          replica.model->set_optimizer_steps(replica.model->optimizer_steps() - 1);
      reported_updates_ += skipped ? 0 : 1;
      // A non-finite batch loss is not in the totals' loss: the step's loss
      // is then the non-finite sum, as on the CPU.
      const cpu::LossSums sums{
          .loss = totals.skipped == loom::gpu::skipped_loss ? totals.nonfinite_loss
                                                            : totals.loss - read_totals_.loss,
          .correct = static_cast<std::size_t>(totals.correct - read_totals_.correct),
          .overflowed = scaling.overflowed != 0};
      read_totals_ = totals;
      return sums;
    }
  }

  // Before the callbacks: Evaluate and a user's on_epoch_end see this epoch's weights.
  void epoch_done(Trainer& t) override {
    if constexpr (!is_pipelined<Policy>) {
      push_host_edits(t);
      gpus_.front().use();
      gpus_.front().model->copy_parameters_to(t.model_);
    }
  }

  cpu::LossSums evaluate(Trainer& t, const data::Dataset& dataset,
                         std::size_t batch_size) override {
    if constexpr (is_pipelined<Policy>)
      return {};
    else
      return evaluate_replicas(t, dataset, batch_size);
  }

  static constexpr std::size_t bucket_bytes() {
    if constexpr (is_data_parallel<Policy>)
      return Policy::bucket_bytes;
    else
      return default_bucket_bytes;
  }

  // With DataParallel this is collective: every rank must call it.
  cpu::LossSums evaluate_replicas(Trainer& t, const data::Dataset& dataset,
                                  std::size_t batch_size) {
    // Existing replicas are kept (a fit may be running: this can be a
    // callback's call); larger requests are evaluated in pieces of their size.
    // Not from a fit's callback while the GPUs run steps it has not read:
    // evaluation resets the loss totals, whose per-slot snapshots those
    // steps' reads wait for. (After a fit, whatever it left, it may.)
    LOOM_CHECK(!t.fitting_ || t.gpu_unreported_ == 0, "evaluate: called while the GPU runs a "
               "step that fit() has not reported (the GPU runs a step ahead of the callbacks); "
               "evaluate at an epoch's end, from a step callback whose needs_state_at_step(steps) "
               "is true for that step, or after the fit");
    ensure_nccl(t);
    const auto world = static_cast<std::size_t>(gpu_world());
    auto& replicas =
        gpu_replicas(t, gpus_.empty() ? (batch_size == 0 ? 256 : batch_size) * world
                                   : gpus_.front().model->max_batch() * world);
    const std::size_t most = replicas.front().model->max_batch();
    const std::size_t piece = batch_size == 0 ? most : std::min(batch_size, most);
    const std::size_t sample = dataset.sample_size();
    reset_totals();
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
        replica.model->set_frames(dataset.frames.empty() || n == 0 ? nullptr
                                                                   : dataset.frames.data() + first,
                                  n);
        replica.model->evaluate_step(staged.slot, n, global);
        replica.stager->consumed(staged, replica.model->stream());
        last = staged.slot;
      }
    }
    const auto totals = wait_gpu_totals(last);
    // A fit's next step counts from zero (see finish_step).
    reset_totals();
    if (totals.halted == loom::gpu::halt_bad_label)
      LOOM_FAIL("evaluate: dataset '", dataset.name, "': label ", totals.bad_label,
                " of a sample is outside the network's ", classes, " classes");
    return {totals.loss, static_cast<std::size_t>(totals.correct)};
  }

  // loss_scale: fp16's, which the device leaves as it was at a halt.
  // Raises the CPU's words (handle_nonfinite), without the first
  // non-finite output or gradient, which the device does not look for.
  void check_totals(Trainer& t, const loom::gpu::LossTotals& totals, int epoch, std::size_t step,
                    float loss_scale) {
    if (totals.halted == loom::gpu::halt_gradient_overflow)
      t.handle_nonfinite(0.0, {}, epoch, step, NonFinite::raise, t.min_scale_note(loss_scale));
    if (totals.halted == loom::gpu::halt_nonfinite_gradients)
      t.handle_nonfinite(0.0, {}, epoch, step, NonFinite::raise, {}, true);
    if (totals.halted == loom::gpu::halt_nonfinite_loss)
      t.handle_nonfinite(totals.halt_loss, {}, epoch, step, NonFinite::raise);
    if (totals.halted == loom::gpu::halt_bad_label && totals.bad_row == ~0ull)
      LOOM_FAIL("a label in step ", step, " of epoch ", epoch, " is outside the network's ",
                classes, " classes (in another rank's share of the batch)");
    if (totals.halted == loom::gpu::halt_bad_label)
      LOOM_FAIL("label ", totals.bad_label, " of sample ", totals.bad_row,
                gpu_world() > 1 ? " of this rank's share" : "", " in step ", step, " of epoch ",
                epoch, " is outside the network's ", classes, " classes");
  }

  // On GPUs (SingleDevice, DataParallel): the device's weights, running
  // statistics and optimizer state into the trainer's model_ and optimizer_, for a
  // checkpoint (weights changed through model() since are kept: the host
  // holds the newer ones); and back after a checkpoint was loaded.
  void pull(Trainer& t) override {
    if constexpr (!is_pipelined<Policy>) {
      if (gpus_.empty()) return;
      auto& first = gpus_.front();
      first.use();
      if (!t.host_changed_) first.model->copy_parameters_to(t.model_);
      pull_optimizer(t, *first.model);
    }
  }
  // Weights changed through model() during a fit on GPUs: onto the
  // replicas before the next step (the CPU's scatter_if_changed).
  void push_host_edits(Trainer& t) {
    if (!t.host_changed_ || gpus_.empty()) return;
    for (auto& replica : gpus_) {
      replica.use();
      replica.model->copy_parameters_from(t.model_);
    }
    t.host_changed_ = false;
  }
  void push(Trainer& t) override {
    if constexpr (!is_pipelined<Policy>) {
      if (gpus_.empty()) return;
      t.host_changed_ = true;
      push_host_edits(t);
      for (auto& replica : gpus_) {
        replica.use();
        push_optimizer(t, *replica.model);
        push_scaler(t, *replica.model);
      }
    }
  }

  // ModelSplit or Hybrid on GPUs: the grid engine over GPU stages, made at
  // the first fit() or evaluate() (its stages grow with the batches they
  // are given), from the trainer's model_ and optimizer_ (a fresh
  // optimizer's zeros, or a loaded checkpoint's state).
  void plan_split(Trainer& t) override {
    if constexpr (is_pipelined<Policy>) {
      if (pipeline_) return;
      t.host_changed_ = false;
      auto made = std::make_unique<Pipeline>(
          t.devices_, t.processes_, t.model_, t.optimizer_.options(), t.grid_,
          t.options_.schedule,
          DeviceStages{.precision = t.options_.precision, .allow_tf32 = t.options_.allow_tf32});
      for (std::size_t b = 0; b < t.optimizer_.buffer_count(); ++b)
        made->scatter_optimizer(b, t.optimizer_.buffer(b).data());
      made->set_optimizer_steps(t.optimizer_.steps());
      pipeline_ = std::move(made);
    }
  }

  std::vector<comm::NcclComm> nccl_;  // DataParallel on GPUs: one rank per replica
  std::vector<GpuReplica> gpus_;      // after nccl_: destroyed first
  std::unique_ptr<Pipeline> pipeline_;  // ModelSplit or Hybrid on GPUs
  // The input slots of the steps enqueued and not yet read (finish_step),
  // oldest first; the totals as the last step read left them (this
  // epoch's); optimizer steps the read steps took.
  std::deque<int> pending_slots_;
  loom::gpu::LossTotals read_totals_{};
  std::uint64_t reported_updates_ = 0;
};

}  // namespace gpu

// Found by the Trainer's constructor (argument-dependent lookup) in a
// program nvcc compiles.
template <class Net, class Policy, class Optimizer, class Loss>
std::unique_ptr<detail::GpuExecutor<Trainer<Net, Policy, Optimizer, Loss>>> make_gpu_executor(
    Trainer<Net, Policy, Optimizer, Loss>&) {
  return std::make_unique<gpu::TrainerExecutor<Trainer<Net, Policy, Optimizer, Loss>>>();
}

namespace gpu {

// For a program whose trainers the host compiler builds: its CUDA
// translation unit (nvcc, including <loom/loom.hpp>) registers the CUDA
// executor of each trainer type the program puts on GPUs, before any is
// made, e.g. at static initialisation:
//
//   static const bool registered = loom::gpu::register_trainers<Trainer<Net>>();
//
// That unit compiles the GPU side alone (the trainers' CPU engines are not
// instantiated there). It must not construct those trainers itself: there
// the constructor finds make_gpu_executor, and would differ from the host's.
template <class... Trainers>
bool register_trainers() {
  ((::loom::detail::gpu_executor_factory<Trainers> =
        []() -> std::unique_ptr<::loom::detail::GpuExecutor<Trainers>> {
          return std::make_unique<TrainerExecutor<Trainers>>();
        }),
   ...);
  return true;
}

}  // namespace gpu
}  // namespace loom
