// The CUDA executor of a Trainer: what the trainer asks of GPUs
// (detail::GpuExecutor), on DeviceModels (SingleDevice, DataParallel: one
// per GPU, each an NCCL rank, stepped a step ahead of the host) and the GPU
// pipeline engine (ModelSplit, Hybrid). loom.hpp includes it when nvcc
// compiles; a Trainer finds it by make_gpu_executor, so that train/ never
// names CUDA and the host compiler never sees this file.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/cuda/staging.hpp"
#include "../comm/nccl_comm.hpp"
#include "../train/trainer.hpp"
#include "model.cuh"
#include "pipeline.cuh"

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
      return static_cast<PipelineEngine<Net, typename Policy::partition>*>(nullptr);
    else
      return static_cast<NoPipeline*>(nullptr);
  }
  using Pipeline = std::remove_pointer_t<decltype(pipeline_type())>;

  void weights_to_host(Trainer& t) override {
    if (gpus_.empty()) return;
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
  int enqueue_gpu_step(Trainer& t, const float* images, const std::int32_t* labels, std::size_t n,
                       bool train, std::size_t group_n = 0, bool accumulate = false,
                       bool last = true) {
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

  // The loss of an optimizer step is read on the host late: its totals are
  // waited for once the next batch is enqueued, so the GPU never waits for
  // the host. A step whose callbacks need the trainer's state after it
  // (needs_state_at_step: callbacks::Checkpoint's saves) is reported before
  // the next one is enqueued instead. The position follows the reported
  // steps, and a loaded checkpoint's fit goes on from its position.
  // SingleDevice and DataParallel (a pipeline's steps run through its
  // split(), as on CPUs): the replicas' fit and evaluation, compiled only
  // for those policies.
  void fit(Trainer& t, data::Loader& loader, const ::loom::detail::FitPlan& plan,
           ::loom::detail::FitEvents& events) override {
    if constexpr (!is_pipelined<Policy>) fit_replicas(t, loader, plan, events);
  }
  cpu::LossSums evaluate(Trainer& t, const data::Dataset& dataset,
                         std::size_t batch_size) override {
    if constexpr (is_pipelined<Policy>)
      return {};
    else
      return evaluate_replicas(t, dataset, batch_size);
  }

  void fit_replicas(Trainer& t, data::Loader& loader, const ::loom::detail::FitPlan& plan,
                    ::loom::detail::FitEvents& events) {
    const FitOptions& options = plan.options;
    const FitInfo& info = plan.info;
    const std::size_t k = options.accumulation_steps;
    auto& replicas = gpu_replicas(t, std::min(options.batch_size, info.samples_per_epoch), k > 1);
    const bool fp16 = t.options_.precision == Precision::fp16;
    const bool skip_nonfinite = options.on_nonfinite == NonFinite::skip;
    // Adam's update depends on its step number, which a step skipped for
    // an fp16 overflow or a non-finite value does not take, and only the
    // device knows whether it did: then each step is reported before the
    // next is enqueued.
    const bool report_each_step =
        (fp16 || skip_nonfinite) &&
        std::string_view(::loom::detail::optimizer_name<Optimizer>(t.optimizer_)) != SGD::name;
    for (auto& replica : replicas) {
      replica.use();
      replica.model->set_max_grad_norm(options.max_grad_norm);
      replica.model->set_skip_nonfinite(skip_nonfinite);
    }
    const auto resumed = t.resume_position(plan.identity, loader.batches_per_epoch());
    // A fit that failed may have left steps unreported; this one goes on
    // from the device's state.
    t.gpu_unreported_ = 0;
    // What the reported steps leave. A step the device halted (a non-finite
    // loss, a bad label) skipped its update and every later one: the
    // counters go back to them (Dropout's, Adam's step count), as the CPU
    // leaves them at the step's start, and the device is at the position.
    std::uint64_t reported_batches = t.batches_;
    std::uint64_t reported_updates = replicas.front().model->optimizer_steps();
    const auto rewind = [&] {
      t.gpu_unreported_ = 0;
      t.batches_ = reported_batches;
      for (auto& replica : replicas) replica.model->set_optimizer_steps(reported_updates);
    };
    events.fit_begin(info);
    const int first_epoch = resumed ? resumed->epoch + (resumed->ended ? 1 : 0) : 1;
    for (int epoch = first_epoch; epoch <= options.epochs && !t.stop_.get(); ++epoch) {
      const bool part = resumed && epoch == resumed->epoch;
      t.position_ = part ? *resumed : TrainingPosition{.epoch = epoch};
      // The device's totals count from here (a resumed epoch's sums come first).
      const TrainingPosition base = t.position_;
      loader.start_epoch(static_cast<std::size_t>(epoch - 1), t.position_.batches);
      const auto start = std::chrono::steady_clock::now() -
                         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(t.position_.seconds));
      StepInfo step{.epoch = epoch, .epochs = options.epochs, .steps = info.steps_per_epoch};
      step.step = t.position_.steps;
      step.samples = t.position_.samples;
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
        loom::gpu::LossScaleState scaling{.scale = t.scaler_.scale()};
        if (fp16) scaling = replicas.front().model->loss_scale(slot);
        t.nonfinite_.clear();
        try {
          check_totals(t, totals, epoch, step.step + 1, scaling.scale);
          if (totals.skipped != loom::gpu::skipped_none) {
            const bool loss_bad = totals.skipped == loom::gpu::skipped_loss;
            t.handle_nonfinite(loss_bad ? totals.nonfinite_loss : 0.0, {}, epoch, step.step + 1,
                             options.on_nonfinite,
                             fp16 && !loss_bad ? t.min_scale_note(scaling.scale) : std::string(),
                             true);
          }
        } catch (...) {
          rewind();
          throw;
        }
        if (fp16) {
          t.scaler_.restore(scaling.scale, scaling.good_steps);
          t.skipped_steps_ = scaling.skipped_steps;
        }
        const bool nonfinite = !t.nonfinite_.empty();
        step.skipped = scaling.overflowed != 0 || nonfinite;
        step.nonfinite = t.nonfinite_;
        // The update was counted when enqueued; the device skipped it
        // (the CPU's optimizer never takes a skipped step).
        if (step.skipped)
          for (auto& replica : replicas)
            replica.model->set_optimizer_steps(replica.model->optimizer_steps() - 1);
        t.gpu_unreported_ -= batches;
        reported_batches += batches;
        reported_updates += step.skipped ? 0 : 1;
        t.steps_ += 1;
        step.step += 1;
        const std::size_t samples = base.samples + static_cast<std::size_t>(totals.samples);
        double loss_sum = base.loss_sum + totals.loss - dropped_loss;
        std::size_t correct =
            base.correct + static_cast<std::size_t>(totals.correct) - dropped_correct;
        step.step_samples = samples - step.samples;
        const auto step_n = static_cast<double>(std::max<std::size_t>(1, step.step_samples));
        step.step_loss = totals.skipped == loom::gpu::skipped_loss
                             ? totals.nonfinite_loss / step_n
                             : (loss_sum - t.position_.loss_sum) / step_n;
        step.step_accuracy = static_cast<double>(correct - t.position_.correct) / step_n;
        if (nonfinite) {
          dropped_loss += loss_sum - t.position_.loss_sum;
          dropped_correct += correct - t.position_.correct;
          dropped_samples += step.step_samples;
          loss_sum = t.position_.loss_sum;
          correct = t.position_.correct;
        }
        step.samples = samples;
        const auto counted =
            static_cast<double>(std::max<std::size_t>(1, samples - dropped_samples));
        step.loss = loss_sum / counted;
        step.accuracy = static_cast<double>(correct) / counted;
        step.seconds = t.seconds_since(start);
        t.position_.batches += batches;
        t.position_.steps = step.step;
        t.position_.samples = samples;
        t.position_.loss_sum = loss_sum;
        t.position_.correct = correct;
        t.position_.seconds = step.seconds;
        events.step(step);
      };
      // The optimizer step whose totals are still to be read, by its slot:
      // read once the next batch is enqueued (on the other slot), before a
      // later one could reuse this slot.
      int pending = -1;
      std::size_t pending_batches = 0, step_batches = 0;
      ::loom::detail::StepGroups groups(k, options.batch_size, plan.epoch_samples, t.position_.samples);
      data::Batch batch{};
      // stop() takes effect at a step's first batch: the step before it,
      // still being reported, completes.
      while (loader.next(batch)) {
        if (pending >= 0 && groups.at_step_start() &&
            (report_each_step || events.needs_state_at_step(t.steps_ + 1)))
          report(std::exchange(pending, -1), pending_batches);
        if (t.stop_.get() && groups.at_step_start()) break;
        // A callback changed the weights through model(): the GPUs take them now.
        if (groups.at_step_start()) push_host_edits(t);
        const auto place = groups.next(batch.size);
        if (!place.accumulate)
          events.step_begin(t.step_begin(epoch, step.step + (pending >= 0 ? 1 : 0), info, options));
        for (auto& replica : replicas) {
          replica.use();
          replica.model->set_lr(t.optimizer_.options().lr);
        }
        const int slot = enqueue_gpu_step(t, batch.images, batch.labels, batch.size, true,
                                          place.group_samples, place.accumulate, place.last);
        step_batches += 1;
        t.gpu_unreported_ += 1;
        if (pending >= 0) report(std::exchange(pending, -1), pending_batches);
        if (place.last) {
          pending = slot;
          pending_batches = std::exchange(step_batches, 0);
        }
      }
      if (pending >= 0) report(pending, pending_batches);
      if (t.stop_.get() && t.position_.batches < loader.batches_per_epoch()) break;
      // Before the callbacks: Evaluate and a user's on_epoch_end see this epoch's weights.
      push_host_edits(t);
      replicas.front().use();
      replicas.front().model->copy_parameters_to(t.model_);
      t.position_.ended = true;
      [[maybe_unused]] const EpochInfo done{epoch,         options.epochs, step.loss,
                                            step.accuracy, step.samples,   t.seconds_since(start)};
      events.epoch_end(done);
    }
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
    ensure_nccl(t);
    const auto world = static_cast<std::size_t>(gpu_world());
    auto& replicas =
        gpu_replicas(t, gpus_.empty() ? (batch_size == 0 ? 256 : batch_size) * world
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

  // ModelSplit or Hybrid on GPUs: stages planned for global batches up to `batch`
  // (made again, weights and momentum carried over, when a larger one comes).
  void plan_split(Trainer& t, std::size_t batch) override {
    if constexpr (is_pipelined<Policy>) {
      if (pipeline_ && pipeline_->max_batch() >= batch) return;
      // The old stages hand over weights and optimizer state; weights
      // changed through model() since follow (scatter_if_changed). The
      // first stages start from the trainer's model_ and optimizer_ (a fresh optimizer's
      // zeros, or a loaded checkpoint's state).
      const bool first = !pipeline_;
      if (first) t.host_changed_ = false;
      auto made = std::make_unique<Pipeline>(
          t.devices_, t.model_, loom::gpu::device_optimizer(t.optimizer_.options()), t.grid_,
          t.options_.schedule, t.options_.precision, t.options_.allow_tf32,
          std::max(batch, pipeline_ ? pipeline_->max_batch() : std::size_t{1}),
          pipeline_.get());
      if (first) {
        for (std::size_t b = 0; b < t.optimizer_.buffer_count(); ++b)
          made->scatter_optimizer(b, t.optimizer_.buffer(b).data());
        made->set_optimizer_steps(t.optimizer_.steps());
      }
      pipeline_ = std::move(made);
    }
  }

  std::vector<comm::NcclComm> nccl_;  // DataParallel on GPUs: one rank per replica
  std::vector<GpuReplica> gpus_;      // after nccl_: destroyed first
  std::unique_ptr<Pipeline> pipeline_;  // ModelSplit or Hybrid on GPUs
};

}  // namespace gpu

// Found by the Trainer's constructor (argument-dependent lookup) in a
// program nvcc compiles.
template <class Net, class Policy, class Optimizer>
std::unique_ptr<detail::GpuExecutor<Trainer<Net, Policy, Optimizer>>> make_gpu_executor(
    Trainer<Net, Policy, Optimizer>&) {
  return std::make_unique<gpu::TrainerExecutor<Trainer<Net, Policy, Optimizer>>>();
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
