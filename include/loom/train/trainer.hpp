// Trainer<Net, Policy, Optimizer, Loss>: fits a network to a dataset. The
// policy says how the network is spread over devices; the optimizer how
// weights move; the loss (loss/loss.hpp) what the outputs train against.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/cpu/threads.hpp"
#include "../comm/communicator.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/data.hpp"
#include "../layers/layer.hpp"
#include "../loss/ctc.hpp"
#include "../loss/loss.hpp"
#include "../loss/position_cross_entropy.hpp"
#include "../loss/softmax_cross_entropy.hpp"
#include "../net/model.hpp"
#include "../optim/adam.hpp"
#include "../optim/any_optimizer.hpp"
#include "../optim/sgd.hpp"
#include "../parallel/data_parallel.hpp"
#include "../parallel/hybrid.hpp"
#include "../parallel/model_split.hpp"
#include "../parallel/single_device.hpp"
#include "../parallel/tensor_parallel.hpp"
#include "agreement.hpp"
#include "checkpoint.hpp"
#include "fit_events.hpp"
#include "trainer_checkpoint.hpp"
#include "trainer_core.hpp"

namespace loom {
namespace gpu {
template <class Trainer>
class TrainerExecutor;
}  // namespace gpu

// The loss is the Trainer's, not a layer: a Sequential that lists it is
// refused by name rather than as an unknown layer.
template <class In_, std::size_t Index_>
struct Bind<SoftmaxCrossEntropy, In_, Index_> : LayerBase<SoftmaxCrossEntropy, In_, In_, Index_> {
  static_assert(dependent_false<In_>,
                "SoftmaxCrossEntropy is the Trainer's loss, not a layer: end the Sequential with "
                "the class scores (e.g. Linear<10>); the Trainer trains them with softmax "
                "cross-entropy");
};

// The losses are the Trainer's too.
template <bool Z, class In_, std::size_t Index_>
struct Bind<CTC<Z>, In_, Index_> : LayerBase<CTC<Z>, In_, In_, Index_> {
  static_assert(dependent_false<In_>,
                "CTCLoss is the Trainer's loss, not a layer: end the Sequential with the "
                "per-frame class scores (e.g. Linear<classes> over Input<Frames, Features>) and "
                "give the Trainer CTCLoss as its fourth argument");
};

template <class Net_, class Policy_ = SingleDevice, class Optimizer_ = SGD,
          class Loss_ = SoftmaxCrossEntropy>
class Trainer : public detail::TrainerCore {
  // The CUDA executor reads and writes the trainer's state.
  template <class T>
  friend class gpu::TrainerExecutor;

 public:
  using Net = Net_;
  using Policy = Policy_;
  using Optimizer = Optimizer_;
  using Loss = Loss_;
  static_assert(LossType<Loss>, "Trainer: the fourth argument must be a loss (loss/loss.hpp), "
                                "e.g. SoftmaxCrossEntropy or CTCLoss");
  // The scores of each sample (or of each of its frames) are the output's last dimension.
  using Out = typename Net::output_shape;
  static constexpr std::size_t classes = Out::dims[Out::rank - 1];

  // The loss says what output it trains, in its own words, inside fits()
  // (this message is for a loss whose fits() returns false instead).
  static_assert(Loss::template fits<Out>(), "Trainer: the network's output does not suit the loss");

  // `processes`: for DataParallel, ModelSplit or Hybrid across MPI
  // processes, the world communicator (dist::Environment::world()); this
  // process then runs the mesh's ranks of its devices: one
  // (dist::Environment::devices(), a rank per process), or several on CPUs,
  // each a rank on a thread of its own (process p of P with T devices holds
  // ranks p*T ... p*T+T-1 of the P*T).
  Trainer(std::vector<Device> devices, typename Optimizer::Options options = {},
          TrainerOptions trainer_options = {}, comm::Comm processes = {})
      : detail::TrainerCore(trainer_options, options.lr),
        devices_(std::move(devices)),
        model_(trainer_options.seed),
        optimizer_(options, Net::parameter_count) {
    loss_denominator_ = denominator_of<Loss>;
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
    }
    // GPUs run on the CUDA executor: a program built by nvcc has it (loom.hpp
    // brings gpu/trainer_executor.cuh); one built by the host compiler has
    // what its CUDA translation unit registered (gpu::register_trainers).
    // Every policy runs there on the grid engine over GPU stages, which
    // take any loss.
    if (on_gpu()) {
      if constexpr (requires(Trainer& t) { make_gpu_executor(t); })
        gpu_ = make_gpu_executor(*this);
      else if (detail::gpu_executor_factory<Trainer> != nullptr)
        gpu_ = detail::gpu_executor_factory<Trainer>();
      LOOM_CHECK(gpu_ != nullptr, "device ", devices_.front().name(),
                 " needs the CUDA backend: compile with nvcc, including <loom/loom.hpp>, or "
                 "register this trainer from a CUDA translation unit "
                 "(loom::gpu::register_trainers), to use GPUs");
    }
    if constexpr (!is_pipelined<Policy>) {
      if (devices_.front().kind == Device::Kind::cpu)
        engine_ = std::make_unique<Engine>(devices_, std::move(processes), trainer_options.seed,
                                           options);
      else
        processes_ = std::move(processes);
    }
    if constexpr (is_pipelined<Policy>) {
      grid_ = pipeline_grid<Policy>(
          processes ? static_cast<std::size_t>(processes.size()) * devices_.size()
                    : devices_.size(),
          trainer_options.replicas);
      // On GPUs the CUDA executor makes the same engine over GPU stages, at
      // the first fit() or evaluate().
      if (devices_.front().kind == Device::Kind::cpu)
        pipeline_ = std::make_unique<Pipeline>(devices_, std::move(processes), model_, options,
                                               grid_, trainer_options.schedule);
      else
        processes_ = std::move(processes);
    }
  }

  const char* policy_name() const override {
    if constexpr (is_pipelined<Policy>)
      return grid_.policy;
    else
      return Policy::name;
  }

  std::vector<Placement> placement() const override {
    return loom::placement<Net, Policy>(devices_, process_count_, process_rank_,
                                        options_.replicas, process_devices_);
  }

  // Across MPI processes fit() first compares, in one collective, what
  // every process must share (Fingerprint: the network, policy, optimizer
  // and its options, precision, the fit's options, the data, and what the
  // callbacks add in on_fit_prepare): processes that differ, or one whose
  // checks failed, all raise a loom::Error naming the first difference
  // before anything trains.
  template <class... Callbacks>
  void fit(const data::Dataset& train, FitOptions options, Callbacks&&... callbacks) {
    detail::CallbackEvents<Trainer, std::remove_reference_t<Callbacks>...> events(*this,
                                                                             callbacks...);
    fit_with(train, options, events);
  }

  // batch_size 0: one device on CPUs, the training batch size when fit()
  // has run (the arena already holds it); else 256. Each replica evaluates
  // its share of the data set in pieces of batch_size samples (its stages
  // grow to hold one).
  EvalResult evaluate(const data::Dataset& dataset, std::size_t batch_size = 0) {
    check_dataset(dataset, "evaluate");
    if (gpu_ && !split_engine()) gpu_->plan_split(*this);
    scatter_if_changed();
    cpu::LossSums sums;
    if (auto* split = split_engine()) {
      sums = split->evaluate(dataset, batch_size == 0 ? 256 : batch_size, options_.precision);
    } else if constexpr (!is_pipelined<Policy>) {
      // One device evaluates in pieces of its training batch (the arena holds it).
      const std::size_t planned = engine_->model().capacity();
      if (batch_size == 0) batch_size = !is_data_parallel<Policy> && planned > 0 ? planned : 256;
      sums = engine_->evaluate(dataset, batch_size, options_.precision);
    }
    EvalResult result;
    result.samples = dataset.count;
    // A per-sample loss divides by the data set's samples (the GPU's sums
    // carry no denominator).
    result.denominator = denominator_of<Loss> == Denominator::samples
                             ? static_cast<double>(dataset.count)
                             : sums.denominator;
    result.loss = mean_over(sums.loss, result.denominator);
    result.accuracy = mean_over(static_cast<double>(sums.correct), result.denominator);
    result.error_rate = error_rate_of(sums.errors, sums.references);
    return result;
  }

  // ModelSplit and Hybrid, and every policy on GPUs: the stages' weights
  // gathered into one Model (a copy), which the stages take back at the next
  // fit() or evaluate(), so changes made through the reference count;
  // across processes, as of the end of the last epoch. The const overload
  // returns them as of the end of the last epoch. (The stages keep their
  // own optimizer state: optimizer()'s buffers take theirs when save()
  // writes them.)
  // SingleDevice and DataParallel on CPUs: (replica 0's) Model; the other
  // replicas take its weights and running statistics at the next fit() or
  // evaluate() (within one process; across processes it is read-only, like
  // ModelSplit's).
  Model<Net, float>& model() {
    if constexpr (!is_pipelined<Policy>)
      if (!on_gpu()) {
        host_changed_ = true;  // the other replicas take replica 0's weights next
        return engine_->model();
      }
    // Across processes nothing is gathered: the copy is read-only there
    // (a change would overwrite the stages with old weights). Gathered
    // once: a second call must not overwrite the first one's changes.
    if (auto* split = split_engine()) {
      if (split->all_local() && !host_changed_) {
        split->gather(model_);
        host_changed_ = true;
      }
    } else {
      host_changed_ = true;
    }
    return model_;
  }
  const Model<Net, float>& model() const {
    if constexpr (!is_pipelined<Policy>)
      if (!on_gpu()) return engine_->model();
    return model_;
  }

  // ModelSplit's engine on CPU devices (its stages' reports, its schedule).
  auto& model_split()
    requires is_pipelined<Policy>
  {
    LOOM_CHECK(pipeline_ != nullptr, "Trainer::model_split(): the engine is the CPU devices'; "
               "on GPUs the stages are gpu::DeviceStages");
    return *pipeline_;
  }

  // DataParallel's engine on CPU devices (the replicas and their communicators).
  auto& data_parallel()
    requires is_data_parallel<Policy>
  {
    LOOM_CHECK(engine_ != nullptr, "Trainer::data_parallel(): the engine is the CPU devices'; on "
               "GPUs the replicas are gpu::DeviceStages");
    return *engine_;
  }
  const std::vector<Device>& devices() const { return devices_; }
  // The optimizer's options and learning rate (schedules set it here). Its
  // state (momentum, moments, step count) is the one device's; under
  // DataParallel each replica keeps its own, under ModelSplit each stage
  // (a checkpoint gathers them).
  typename Optimizer::template State<float>& optimizer() {
    if constexpr (std::is_same_v<Policy, SingleDevice>)
      if (engine_) return engine_->replica_optimizer(0);
    return optimizer_;
  }
  // The policy's ranks laid out on the mesh: data x pipe x tensor.
  Mesh mesh() const {
    if constexpr (is_pipelined<Policy>)
      return {grid_.replicas, grid_.stages, grid_.tensor};
    else if constexpr (is_data_parallel<Policy>)
      return {std::max<std::size_t>(process_count_, 1) * devices_.size(), 1, 1};
    else
      return {};
  }
  // After load(): how the checkpoint's whole tensors were cut for this
  // run's mesh, when it differs from the mesh that saved them (empty when
  // the same, or when the checkpoint does not say).
  const std::string& resharded() const { return resharded_; }
  // Writes a checkpoint (safetensors; atomically: a crash mid-write keeps
  // the file that was there): weights, running statistics, optimizer state
  // and the position in the fit, in the whole network's layout, so it loads
  // under any policy and device count. Across MPI processes every process
  // calls it (the stages' parts are gathered) and rank 0 writes.
  void save(const std::filesystem::path& path) {
    save_with(path, [&](detail::CheckpointImage& image) { fill_image(image); },
              [](const std::filesystem::path& to, const detail::CheckpointImage& image) {
                detail::write_checkpoint(to, image, tensor_table<Net>());
              });
  }
  // Reads a checkpoint written by save() under any policy or device count.
  // Names, shapes and types are checked first: a loom::Error names the first
  // mismatch, and leaves the trainer as it was. With `resume` the next fit()
  // goes on from the checkpoint's position (with the same optimizer options
  // but lr, data and batch options; a different set-up is an error naming
  // it); without, it starts a fit of its own, with its own options, from the
  // checkpoint's weights and optimizer state.
  void load(const std::filesystem::path& path, bool resume = true) {
    load_with(path, resume, [&] { return read_image(path, resume); },
              [&](const detail::CheckpointImage& image) { restore_image(image, resume); });
  }
  // Each local device's time in the last optimizer step (a data-parallel
  // replica or pipeline stage: its own jobs; wait for others included);
  // on GPUs empty before the stages are made, zeros before the first step.
  std::vector<double> device_step_seconds() const {
    if (auto* split = split_engine()) return split->step_seconds();
    if constexpr (!is_pipelined<Policy>)
      if (engine_) return engine_->step_seconds();
    return {};
  }

 private:
  // The optimizer state this process updates (a replica's or stage's
  // under the parallel policies; the trainer's own holds the options).
  const typename Optimizer::template State<float>& local_optimizer() {
    if constexpr (!is_pipelined<Policy>)
      if (!on_gpu()) return engine_->replica_optimizer(0);
    return optimizer_;
  }

  void check_fit(const data::Dataset& train, const FitOptions& options) override {
    check_dataset(train, "fit");
    check_fit_options(options);
    if constexpr (is_data_parallel<Policy> && Net::syncs) {
      // Found now rather than when the epoch's last batch comes.
      const std::size_t last = train.count % options.batch_size;
      const auto replicas = engine_ ? static_cast<std::size_t>(engine_->world())
                                    : std::max<std::size_t>(process_count_, 1) * devices_.size();
      LOOM_CHECK(options.drop_last || last == 0 || last >= replicas, "fit: the last batch of an "
                 "epoch of '", train.name, "' has ", last, " sample(s) for ", replicas,
                 " replicas, and SyncBatchNorm needs a sample on each; set "
                 "FitOptions::drop_last or a batch size that leaves at least ", replicas);
    }
  }

  // The processes' fingerprint of a fit (TrainerCore::describe_fit): this
  // trainer's network, policy, devices and optimizer, and the schedule that
  // runs (micro_batches 0: the policy's).
  void describe_setup(Fingerprint& f) const override {
    f.add("network", detail::type_label<Net>())
        .add("loss", Loss::name)
        .add("loss denominator", denominator_name(denominator_of<Loss>))
        .add("policy", detail::type_label<Policy>())
        .add("device kind", devices_.front().kind == Device::Kind::cpu ? "cpu" : "cuda")
        .add("devices per process", devices_.size())
        .add("optimizer", detail::optimizer_name<Optimizer>(optimizer_))
        .add("optimizer.lr", base_lr_);
    for (const auto& [name, value] : optimizer_.options().hyperparameters())
      f.add(std::string("optimizer.") + name, value);
  }
  std::optional<PipelineSchedule> running_schedule() const override {
    if constexpr (is_pipelined<Policy>)
      return options_.schedule.micro_batches == 0 ? grid_.schedule : options_.schedule;
    else
      return std::nullopt;
  }

  // save() and load() (trainer_checkpoint.hpp): the weights, running
  // statistics and optimizer state from the devices, in the whole
  // network's layout, and back.
  void fill_image(detail::CheckpointImage& image) {
    Model<Net, float>* model = &model_;
    if constexpr (!is_pipelined<Policy>)
      if (!on_gpu()) model = &engine_->model();
    // GPU stages made by no fit yet: model_ and optimizer_ hold all.
    auto* const split = split_engine();
    if (split) {
      scatter_if_changed();  // weights edited through model() count
      split->gather(model_);
    }
    image.parameters.assign(model->parameters().begin(), model->parameters().end());
    image.state.assign(model->state().begin(), model->state().end());
    const auto& optimizer = local_optimizer();
    for (std::size_t b = 0; b < optimizer.buffer_count(); ++b) {
      image.buffer_names.emplace_back(optimizer.buffer_name(b));
      if (split) {
        image.buffers.emplace_back(Net::parameter_count, 0.0f);
        split->gather_optimizer(b, image.buffers.back().data());
        continue;
      }
      image.buffers.emplace_back(optimizer.buffer(b).begin(), optimizer.buffer(b).end());
    }
    image.optimizer = detail::optimizer_name<Optimizer>(optimizer_);
    image.optimizer_steps = optimizer.steps();
    if (split) {
      image.optimizer_steps = split->optimizer_steps();
      // optimizer() shows the stages' state, as it shows a GPU's after save().
      for (std::size_t b = 0; b < image.buffers.size(); ++b)
        std::ranges::copy(image.buffers[b], optimizer_.buffer(b).begin());
      optimizer_.set_steps(image.optimizer_steps);
    }
    for (const auto& [name, value] : optimizer_.options().hyperparameters())
      image.optimizer_options.emplace_back(name, value);
    image.lr = this->optimizer().options().lr;
    image.network = detail::type_label<Net>();
    image.policy = policy_name();
    image.mesh = mesh().describe();
  }
  detail::CheckpointImage read_image(const std::filesystem::path& path, bool resume) {
    std::vector<std::string> names;
    for (std::size_t b = 0; b < optimizer_.buffer_count(); ++b)
      names.emplace_back(optimizer_.buffer_name(b));
    const auto options = optimizer_.options().hyperparameters();
    auto image = detail::read_checkpoint(path, detail::optimizer_name<Optimizer>(optimizer_),
                                         names, options, tensor_table<Net>(),
                                         Net::parameter_count, Net::state_count);
    if (resume) detail::check_resumed_options(image, options, path.string());
    // Training keeps a tied pair equal bit for bit: copies that differ
    // were not written by it, and would train as two tensors.
    for (const detail::TieRun& tie : Net::ties) {
      const auto source = std::span<const float>(image.parameters).subspan(tie.source, tie.count);
      const auto copy = std::span<const float>(image.parameters).subspan(tie.copy, tie.count);
      const auto at = std::ranges::mismatch(source, copy).in1 - source.begin();
      if (at == static_cast<std::ptrdiff_t>(tie.count)) continue;
      const auto table = tensor_table<Net>();
      const auto name = [&](std::size_t offset) {
        const auto slot = std::ranges::find_if(
            table, [&](const TensorSlot& t) { return !t.state && t.offset == offset; });
        return slot == table.end() ? std::string("?") : slot->name;
      };
      LOOM_FAIL("Trainer::load: checkpoint '", path.string(), "' holds the tied weights '",
                name(tie.copy), "' and '", name(tie.source), "', which differ at element ", at,
                " (", copy[static_cast<std::size_t>(at)], " and ",
                source[static_cast<std::size_t>(at)],
                "); a tied pair trains as one tensor: give both the same values");
    }
    return image;
  }
  std::string resharding(const detail::CheckpointImage& image) const {
    // Only the pipe and tensor axes cut tensors (data replicas hold them whole).
    const Mesh now = mesh();
    const auto cut = [](const Mesh& m) {
      return " x pipe " + std::to_string(m.pipe) + " x tensor " + std::to_string(m.tensor);
    };
    if (image.mesh.empty() || image.mesh.ends_with(cut(now))) return {};
    std::ostringstream text;
    text << "resharded: the checkpoint was saved by " << image.policy << " on " << image.mesh
         << "; this " << policy_name() << " runs " << now.describe() << ": ";
    if constexpr (is_tensor_parallel<Policy>) {
      std::size_t split = 0;
      for (const auto& run : detail::TensorEngine<Net, Policy, Optimizer, Loss>::segments(
               0, {0, Net::executed::size}))
        if (run.split) split += run.count;
      text << "each of its " << now.tensor << " tensor ranks takes its 1/" << now.tensor
           << " of the split layers' " << split * now.tensor << " weights and all of the other "
           << Net::parameter_count - split * now.tensor;
    } else {
      text << "each rank takes the whole tensors of its layers";
    }
    if (now.pipe > 1) text << ", the layers cut into " << now.pipe << " stages";
    text << " (optimizer state alike)";
    return text.str();
  }
  void restore_image(const detail::CheckpointImage& image, bool resume) {
    const auto put = [&](Model<Net, float>& model, auto& optimizer) {
      std::ranges::copy(image.parameters, model.parameters().begin());
      std::ranges::copy(image.state, model.state().begin());
      for (std::size_t b = 0; b < image.buffers.size(); ++b)
        std::ranges::copy(image.buffers[b], optimizer.buffer(b).begin());
      optimizer.set_steps(image.optimizer_steps);
      optimizer.set_lr(resume ? image.lr : base_lr_);
    };
    put(model_, optimizer_);
    resharded_ = resharding(image);
    if constexpr (!is_pipelined<Policy>)
      if (!on_gpu())
        for (std::size_t r = 0; r < engine_->local_replicas(); ++r)
          put(engine_->replica_model(r), engine_->replica_optimizer(r));
    // GPU stages made by a later fit start from model_ and optimizer_.
    if (auto* split = split_engine()) {
      split->scatter(model_);
      for (std::size_t b = 0; b < image.buffers.size(); ++b)
        split->scatter_optimizer(b, image.buffers[b].data());
      split->set_optimizer_steps(image.optimizer_steps);
      host_changed_ = false;
    }
  }

 protected:
  // The fit loop's calls (TrainerCore::run_fit), protected so that a
  // subclass may wrap them (tests run the CPU's steps ahead, as a GPU's).
  void start_fit(const detail::FitPlan&, std::size_t planned_batch) override {
    if (gpu_) gpu_->plan_split(*this);
    cpu::set_threads(devices_.front().threads);
    if constexpr (!is_pipelined<Policy>)
      if (engine_) engine_->reserve(planned_batch);
    scatter_if_changed();
  }
  void before_step() override { scatter_if_changed(); }
  // Every engine's step is done when run_batch returns: none runs ahead of
  // the host (TrainerCore's protocol for one that does: finish_step).
  bool runs_ahead(const FitOptions&) const override { return false; }
  cpu::LossSums finish_step(int, std::size_t, const FitOptions&) override {
    LOOM_FAIL("finish_step: no step of ", Policy::name, " runs ahead of the host");
  }
  void epoch_begin() override {}
  // Before the callbacks; across processes model() cannot gather (it is not
  // collective) and returns these. Weights a step callback changed through
  // model() reach the stages first, so the gather keeps them.
  void epoch_done() override {
    if (auto* split = split_engine()) {
      scatter_if_changed();
      split->gather(model_);
    }
  }
  // One batch of an optimizer step (the engine runs the step protocol).
  std::optional<cpu::LossSums> run_batch(const data::Batch& batch, std::size_t group_samples,
                                         bool accumulate, bool last, int epoch, std::size_t step,
                                         const FitOptions& fit) override {
    const float max_grad_norm = fit.max_grad_norm;
    nonfinite_.clear();
    const Pass pass{.training = true, .seed = options_.seed, .step = batches_++};
    const StepSettings settings{
        .lr = optimizer().options().lr,
        .max_grad_norm = max_grad_norm,
        .precision = options_.precision,
        .loss_scale = options_.precision == Precision::fp16 ? scaler_.scale() : 1.0f,
        .at_min_scale = options_.precision == Precision::fp16 && scaler_.at_min_scale()};
    auto& engine = engine_for_step();
    const auto sums = engine.micro_step(batch.images, batch.targets, batch.size, group_samples,
                                        accumulate, last, settings, pass);
    if (!last) return std::nullopt;
    const NonFiniteSpot spot = engine.fault();
    // The ranks skipped their update. An fp16 overflow's spot (at the
    // minimum scale) is the scale's to report.
    if (sums.overflowed || !handle_nonfinite(sums.loss, spot, epoch, step, fit.on_nonfinite))
      note_overflow(sums, spot, epoch, step, fit.on_nonfinite);
    return sums;
  }

 private:
  std::string spot_text(const NonFiniteSpot& spot) const override {
    return detail::spot_text<Net>(spot);
  }
  // Over the engine's ranks, or the processes' world before GPU stages
  // are made (the agreement before the first fit).
  double sum_over_processes(double value) override {
    if (process_count_ <= 1) return value;
    if (auto* split = split_engine()) return split->sum_over_ranks(value);
    if constexpr (!is_pipelined<Policy>)
      if (engine_) return engine_->sum_over_ranks(value);
    processes_.all_reduce(std::span<double>(&value, 1), comm::ReduceOp::sum);
    return value;
  }
  std::vector<double> gather_over_processes(std::span<const double> row) override {
    if (process_count_ <= 1) return {row.begin(), row.end()};
    if (auto* split = split_engine()) return split->gather_rows(row);
    if constexpr (!is_pipelined<Policy>)
      if (engine_) return engine_->gather_rows(row);
    return comm::gather_rows(processes_, row);
  }

  const Device& device_of_process() const override { return devices_.front(); }

  void check_dataset(const data::Dataset& dataset, const char* what) const {
    check_samples(dataset, what, Net::input_shape::dims, classes, Loss::target, Loss::name,
                  model_.input_takes_ids());
    // What the loss checks of the whole data set (CTCLoss: every target fits its frames).
    if constexpr (requires { Loss::template check_targets<Out>(Targets{}, std::size_t{}); })
      Loss::template check_targets<Out>(data::targets_of(dataset), dataset.count);
  }
  bool on_gpu() const { return devices_.front().kind == Device::Kind::cuda; }

  // model() handed out the weights: the stages take them back, or the
  // other replicas take replica 0's. (Across processes model() is
  // read-only: the other processes could not know to take part.)
  void scatter_if_changed() {
    if (auto* split = split_engine()) {
      if (std::exchange(host_changed_, false)) split->scatter(model_);
      return;
    }
    if constexpr (!is_pipelined<Policy>)
      if (engine_ && std::exchange(host_changed_, false) && engine_->all_local())
        engine_->share_first_replica();
  }

  // The engine of a step: the one whose stages hold the weights, or
  // SingleDevice's and DataParallel's on CPUs.
  detail::SplitEngine<Net>& engine_for_step() {
    if constexpr (!is_pipelined<Policy>)
      if (!gpu_) return *engine_;
    return *split_engine();
  }
  // The engine whose stages hold the weights, away from model_: ModelSplit's
  // and Hybrid's on CPU devices, and every policy's on GPUs (none there
  // until a fit or evaluate() planned the stages); SingleDevice and
  // DataParallel on CPUs hold theirs in their replicas' Models (none here).
  detail::SplitEngine<Net>* split_engine() const {
    if (gpu_) return gpu_->split();
    if constexpr (is_pipelined<Policy>)
      return pipeline_.get();
    else
      return nullptr;
  }

  // " (R replicas x S stages)" for the policies laid out as a grid.
  static std::string grid_text() {
    if constexpr (is_hybrid<Policy>)
      if (Policy::replicas > 0 && Policy::stages > 0)
        return " (" + std::to_string(Policy::replicas) + " replicas x " +
               std::to_string(Policy::stages) + " stages)";
    return "";
  }

  struct NoEngine {};
  // SingleDevice and DataParallel on CPUs: replicas of the whole network.
  using Engine = std::conditional_t<!is_pipelined<Policy>,
                                    detail::DataParallelEngine<Net, Policy, Optimizer, Loss>,
                                    NoEngine>;
  // The pipelined policies' engines are types over the network and the
  // stage cut: ModelSplit and every Hybrid over one cut share them.
  struct NoPipeline {};
  static auto pipeline_type() {
    if constexpr (is_tensor_parallel<Policy>)
      return static_cast<detail::TensorEngine<Net, Policy, Optimizer, Loss>*>(nullptr);
    else if constexpr (is_pipelined<Policy>)
      return static_cast<
          detail::PipelineEngine<Net, typename Policy::partition, Optimizer, Loss>*>(nullptr);
    else
      return static_cast<NoPipeline*>(nullptr);
  }
  using Pipeline = std::remove_pointer_t<decltype(pipeline_type())>;

  std::vector<Device> devices_;
  // GPUs' weights on the host, and pipelines' gathered copy (on CPUs the
  // engines' replicas and stages hold the live weights).
  Model<Net, float> model_;
  typename Optimizer::template State<float> optimizer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Pipeline> pipeline_;
  PipelineGrid grid_;  // pipelined policies: replicas, buckets, the policy's schedule
  comm::Comm processes_;  // on GPUs across processes (the engine's, bootstraps NCCL)
  bool host_changed_ = false;  // model() handed out the weights since the device(s) last had them
  std::string resharded_;  // the last load's resharding (resharded())
  // On GPUs: the CUDA executor (gpu/trainer_executor.cuh), which holds
  // the grid engine over their stages.
  std::unique_ptr<detail::GpuExecutor<Trainer>> gpu_;
};

}  // namespace loom
