// ModelSplit and Hybrid on GPUs: each stage a DeviceStage on its GPU (a
// range of the whole network's executed layers on DeviceLayers, as
// DeviceModel runs them all, when the cuts fall between executed layers;
// several stages may share one GPU, each on streams of its own), driven by
// a host thread that enqueues its schedule's passes (schedule.hpp) without
// waiting for the GPU.
//
// Between stages, DeviceLinks carry activations forward and gradients back
// as device-to-device copies (peer copies between GPUs) on the receiving
// stage's copy stream: the copy waits for the sender's event, the receiver's
// compute stream waits for the copy, so a stage copies its next input while
// it computes. A sender that is about to overwrite a buffer it sent from
// waits (host: the receiver has enqueued the copy; device: the copy is done).
//
// The loss is the last stage's (on the device, LossTotals). Gradients of a
// step's micro-batches are summed into an accumulator; the update reads it,
// with any of the optimizers DeviceModel takes (SGD, Adam, AdamW). At the
// end of an optimizer step the host reads the loss and the stages' squared
// gradient norms (one reduction each on its GPU): every stage updates, or
// none when the loss or the norm is not finite, as the CPU checks before
// every update; the stages then put back the running statistics of the
// step's start, and the engine looks on the host for what to name (the
// input batch, the weights, the gradients; fault()). Clipping by global
// norm hands every stage the stages' summed norm, so all scale by the
// factor one device would.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../backend/cuda/memory.hpp"
#include "../backend/cuda/stream.hpp"
#include "../data/dataset.hpp"
#include "../parallel/crew.hpp"
#include "../parallel/data_parallel.hpp"
#include "../parallel/model_split.hpp"
#include "../parallel/step_protocol.hpp"
#include "model.cuh"

namespace loom::gpu {

// One direction between two pipeline stages. send() and before_overwrite()
// are the sender thread's; receive() the receiver's.
class DeviceLink {
 public:
  DeviceLink(int from_device, int to_device) : from_(from_device), to_(to_device) {}
  DeviceLink(const DeviceLink&) = delete;
  DeviceLink& operator=(const DeviceLink&) = delete;
  ~DeviceLink() {
    for (cudaEvent_t e : events_) LOOM_CUDA_RELEASE(cudaEventDestroy(e));
  }

  // `count` floats at `data` (on the sender's GPU) are ready once the work
  // enqueued on `stream` so far is done.
  void send(const float* data, std::size_t count, cudaStream_t stream) {
    cudaEvent_t ready = take_event();
    LOOM_CUDA_CHECK(cudaEventRecord(ready, stream));
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({data, count, ready});
      ++sources_[data].pending;
    }
    changed_.notify_all();
  }

  // Before the sender writes `data` again: waits until the receiver has
  // enqueued the copy of every message sent from it, and makes `stream`
  // wait for those copies.
  void before_overwrite(const float* data, cudaStream_t stream) {
    cudaEvent_t copied = nullptr;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return !why_.empty() || sources_[data].pending == 0; });
      throw_if_cancelled();
      copied = sources_[data].copied;
    }
    if (copied != nullptr) LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream, copied, 0));
  }

  // Copies the next message (which must hold `count` floats) into
  // `destination` on `copy`, after `destination_free` (when given); later
  // work on `compute` waits for the copy.
  void receive(float* destination, std::size_t count, cudaStream_t copy,
               const Event* destination_free, cudaStream_t compute) {
    Message message;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return !why_.empty() || !queue_.empty(); });
      throw_if_cancelled();
      message = queue_.front();
      queue_.pop_front();
    }
    if (message.count != count) {
      const std::string why = "stage on cuda:" + std::to_string(from_) + " sent " +
                              std::to_string(message.count) + " values to the stage on cuda:" +
                              std::to_string(to_) + ", which expected " + std::to_string(count);
      cancel(why);
      LOOM_FAIL("ModelSplit: ", why);
    }
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(copy, message.ready, 0));
    if (destination_free != nullptr) destination_free->wait_on(copy);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(destination, message.data, count * sizeof(float),
                                    cudaMemcpyDeviceToDevice, copy));
    cudaEvent_t copied = nullptr;
    {
      std::lock_guard lock(mutex_);
      copied = sources_[message.data].copied;
    }
    if (copied == nullptr) {
      copied = make_event();  // on the receiver's GPU, where it is recorded
      std::lock_guard lock(mutex_);
      sources_[message.data].copied = copied;
    }
    LOOM_CUDA_CHECK(cudaEventRecord(copied, copy));
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(compute, copied, 0));
    {
      std::lock_guard lock(mutex_);
      --sources_[message.data].pending;
      free_ready_.push_back(message.ready);  // the wait above has taken its state
    }
    changed_.notify_all();
  }

  // Ends every wait on this link with a loom::Error carrying `why`.
  void cancel(const std::string& why) {
    {
      std::lock_guard lock(mutex_);
      if (why_.empty()) why_ = why.empty() ? "cancelled" : why;
    }
    changed_.notify_all();
  }

 private:
  struct Message {
    const float* data = nullptr;
    std::size_t count = 0;
    cudaEvent_t ready = nullptr;
  };
  struct Source {
    std::size_t pending = 0;       // sent, copy not yet enqueued
    cudaEvent_t copied = nullptr;  // the last copy from it
  };

  void throw_if_cancelled() const {
    if (!why_.empty())
      LOOM_FAIL("ModelSplit: the link from the stage on cuda:", from_, " to the stage on cuda:",
                to_, " stopped: ", why_);
  }

  // A "ready" event on the sender's GPU (reused once its wait is enqueued).
  cudaEvent_t take_event() {
    {
      std::lock_guard lock(mutex_);
      if (!free_ready_.empty()) {
        cudaEvent_t e = free_ready_.back();
        free_ready_.pop_back();
        return e;
      }
    }
    return make_event();
  }

  cudaEvent_t make_event() {
    cudaEvent_t e = nullptr;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard lock(mutex_);
    events_.push_back(e);
    return e;
  }

  int from_, to_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Message> queue_;
  std::map<const float*, Source> sources_;
  std::vector<cudaEvent_t> free_ready_, events_;
  std::string why_;
};

// What the engine asks of a stage, whatever its network type.
class DeviceStageBase {
 public:
  virtual ~DeviceStageBase() = default;
  virtual int device() const = 0;
  virtual std::size_t max_batch() const = 0;
  virtual std::size_t input_size() const = 0;
  virtual std::size_t output_size() const = 0;
  virtual cudaStream_t stream() const = 0;
  virtual cudaStream_t copy_stream() const = 0;
  virtual float* input(std::size_t slot) = 0;
  virtual const float* output(std::size_t slot) const = 0;
  virtual std::int32_t* labels(std::size_t slot) = 0;
  virtual float* output_gradient() = 0;
  virtual float* input_gradient() = 0;
  virtual Event& slot_done(std::size_t slot) = 0;
  // Pinned host memory a slot's host data (images, labels) goes through,
  // so the copy to the GPU does not hold the stage's thread; free again
  // once staged(slot) has passed.
  virtual float* pinned_input(std::size_t slot) = 0;
  virtual std::int32_t* pinned_labels(std::size_t slot) = 0;
  virtual Event& staged(std::size_t slot) = 0;
  virtual Event& backward_done() = 0;
  // Before a step's or an evaluation's first forward, in a reduced
  // precision: the weights the layers compute with are rounded again from
  // the master weights (an update or the host changed them).
  virtual void round_weights() = 0;
  // Before a step's first forward, fp16: the trainer's loss scale, which
  // the last stage's loss gradients are multiplied by and every stage's
  // summed gradients divided by (squared_norm).
  virtual void set_loss_scale(float loss_scale) = 0;
  // The running statistics at a step's start, enqueued: kept, or put back
  // when the step is skipped.
  virtual void keep_state() = 0;
  virtual void restore_state() = 0;
  // pass: what Dropout draws from (training only).
  virtual void forward(std::size_t slot, std::size_t n, bool training, const DevicePass& pass) = 0;
  // The last stage: loss of slot's n samples (train: its gradient too, over group samples).
  virtual void loss(std::size_t slot, std::size_t n, std::size_t group, bool train) = 0;
  // first_of_step: the step's first backward (overwrites the accumulator).
  virtual void backward(std::size_t slot, std::size_t n, bool first_of_step) = 0;
  // The step's update of the accumulated gradients, with optimizer step
  // `scalars`' (update_scalars); clip_squares >= 0: the whole network's
  // squared gradient norm, to clip by scalars.max_norm first.
  virtual void update(const UpdateScalars& scalars, double clip_squares) = 0;
  // The squared norm of the accumulated gradients (waits for the stream),
  // not finite exactly when a gradient is not; with `unscale` (fp16) the
  // gradients are first divided by the loss scale, in place.
  virtual double squared_norm(bool unscale) = 0;
  // Optimizer buffer b (SGD's velocity; Adam's exp_avg, exp_avg_sq) to or
  // from the stage's slice of a host buffer in the Model's order (waits).
  virtual void copy_optimizer(std::size_t b, float* host, cudaMemcpyKind kind) = 0;
  // The step's micro-batches' gradients, summed (Hybrid sums it over copies).
  virtual float* accumulator() = 0;
  // The accumulator into the stage's slice of a host buffer in the Model's
  // order (waits).
  virtual void copy_accumulator(float* host) = 0;
  virtual void zero_accumulator() = 0;
  // Waits for the stream; returns the totals since the last call and zeroes them.
  virtual LossTotals take_totals() = 0;
  virtual void copy_parameters(float* host, cudaMemcpyKind kind) = 0;
  // The stage's running statistics (its slice of the Model's state); waits.
  virtual void copy_running_state(float* host, cudaMemcpyKind kind) = 0;
  virtual void copy_state_from(DeviceStageBase& other) = 0;
  virtual void synchronize() = 0;
  virtual float* parameters_on_device() = 0;
  virtual float* optimizer_on_device(std::size_t b) = 0;
  virtual float* running_state_on_device() = 0;
  virtual std::size_t device_parameters() const = 0;
};

// A pipeline stage on one GPU: the layers `range` of Net's executed list
// (DeviceLayers, as DeviceModel runs the whole network; Net is the stage's
// own network, stage_net_t, where a cut splits a fused pair), with `slots`
// micro-batches of up to `max_batch` samples alive at once, the step's
// gradients summed over its micro-batches (which the update reads), and,
// as the last stage, the loss. The loss gradient is rounded as DeviceModel
// rounds it (fp16 scales it first); the summed gradients stay fp32.
template <class Net>
class DeviceStage final : public DeviceStageBase {
 public:
  // Made with `device` current; `weights` and `state` are the range's
  // slices of the CPU Model's. Not the first stage: it passes its input's
  // gradient back.
  DeviceStage(int device, LayerRange range, bool first, std::span<const float> weights,
              std::span<const float> state, const DeviceOptimizer& optimizer,
              std::size_t max_batch, std::size_t slots, Precision precision, bool allow_tf32)
      : device_(device),
        first_(first),
        optimizer_(optimizer),
        precision_(precision),
        layers_(context_, range, max_batch, slots, optimizer.buffers(), precision,
                tensor_math(precision, allow_tf32),
                "ModelSplit stage on cuda:" + std::to_string(device), !first),
        loss_(max_batch),
        totals_host_(1),
        norm_host_(1),
        pinned_inputs_(first ? slots * max_batch * layers_.input_size() : 0),
        pinned_labels_(slots * max_batch),
        inputs_(slots),
        labels_(slots),
        slot_done_(slots),
        staged_(slots) {
    const std::size_t total = layers_.parameters();
    norm_scratch_bytes_ = ::loom::gpu::squared_norm_bytes(total);
    arena_ = make_arena([&](auto&& take) { lay_out(take); },
                        "ModelSplit stage on cuda:" + std::to_string(device));
    LOOM_CUDA_CHECK(cudaMemsetAsync(accum_, 0, total * sizeof(float), stream()));
    LOOM_CUDA_CHECK(cudaMemsetAsync(totals_, 0, sizeof(LossTotals), stream()));
    // The host decides whether a step with a non-finite loss halts or is
    // skipped: the totals only mark it (LossTotals::skipped) and go on
    // counting hits, as the CPU's sums do.
    scalars_.copy(skip_nonfinite_, 1, stream());
    copy_parameters(const_cast<float*>(weights.data()), cudaMemcpyHostToDevice);
    copy_running_state(const_cast<float*>(state.data()), cudaMemcpyHostToDevice);
  }
  ~DeviceStage() override { synchronize(); }

  // Waits for both streams (the copies read other stages' memory).
  void synchronize() override {
    LOOM_CUDA_RELEASE(cudaStreamSynchronize(copy_stream_.get()));
    LOOM_CUDA_RELEASE(cudaStreamSynchronize(context_.stream.get()));
  }

  int device() const override { return device_; }
  std::size_t max_batch() const override { return layers_.max_batch(); }
  std::size_t input_size() const override { return layers_.input_size(); }
  std::size_t output_size() const override { return layers_.output_size(); }
  cudaStream_t stream() const override { return context_.stream.get(); }
  cudaStream_t copy_stream() const override { return copy_stream_.get(); }
  float* input(std::size_t slot) override { return inputs_[slot]; }
  // Before the slot's first forward too (an in-place stage's is its input).
  const float* output(std::size_t slot) const override {
    return layers_.output_is_input() ? inputs_[slot] : layers_.output(slot);
  }
  std::int32_t* labels(std::size_t slot) override { return labels_[slot]; }
  float* output_gradient() override { return layers_.output_gradient(); }
  float* input_gradient() override { return layers_.input_gradient(); }
  Event& slot_done(std::size_t slot) override { return slot_done_[slot]; }
  float* pinned_input(std::size_t slot) override {
    LOOM_CHECK(first_, "ModelSplit: only the first stage takes images from the host");
    return pinned_inputs_.data() + slot * max_batch() * input_size();
  }
  std::int32_t* pinned_labels(std::size_t slot) override {
    return pinned_labels_.data() + slot * max_batch();
  }
  Event& staged(std::size_t slot) override { return staged_[slot]; }
  Event& backward_done() override { return backward_done_; }

  void round_weights() override { layers_.round_weights(); }
  void set_loss_scale(float loss_scale) override {
    if (precision_ == Precision::fp16 && loss_scale != scale_value_.scale) {
      scale_value_.scale = loss_scale;
      scalars_.copy(scale_, scale_value_, stream());
    }
  }
  void keep_state() override { layers_.keep_state(); }
  void restore_state() override { layers_.restore_state(); }

  void forward(std::size_t slot, std::size_t n, bool training, const DevicePass& pass) override {
    if (training && layers_.contextual()) scalars_.copy(layers_.pass(slot), pass, stream());
    layers_.forward(slot, inputs_[slot], n, training);
  }

  void loss(std::size_t slot, std::size_t n, std::size_t group, bool train) override {
    LOOM_CHECK(n >= 1 && n <= max_batch(), "ModelSplit stage on cuda:", device_,
               ": the loss of a micro-batch of ", n, " samples; it was planned for 1 to ",
               max_batch());
    softmax_xent_async(output(slot), labels_[slot], n, output_size(), group,
                       train ? output_gradient() : nullptr, loss_, stream(),
                       precision_ == Precision::fp16 ? &scale_->scale : nullptr);
    if (train) round_values(precision_, output_gradient(), n * output_size(), stream());
    accumulate_loss(loss_, labels_[slot], n, train, totals_, stream(), skip_nonfinite_);
  }

  void backward(std::size_t slot, std::size_t n, bool first_of_step) override {
    layers_.backward(slot, n);
    const std::size_t total = layers_.parameters();
    if (first_of_step)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(accum_, layers_.grads(), total * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream()));
    else
      add_into(accum_, layers_.grads(), total, stream());
  }

  void update(const UpdateScalars& scalars, double clip_squares) override {
    if (!(scalars == update_value_)) {
      update_value_ = scalars;
      scalars_.copy(update_, update_value_, stream());
    }
    const bool clip = clip_squares >= 0.0;
    if (clip) scalars_.copy(norm_, clip_squares, stream());
    optimizer_update(optimizer_, layers_.params(), accum_, layers_.moment(0), layers_.moment(1),
                     layers_.parameters(), update_, clip ? norm_ : nullptr, nullptr, stream());
  }

  double squared_norm(bool unscale) override {
    const std::size_t total = layers_.parameters();
    if (unscale && total > 0) {
      // Its overflow flag is not read: the norm says it.
      LOOM_CUDA_CHECK(cudaMemsetAsync(&scale_->overflowed, 0, sizeof(int), stream()));
      kernels::scan_gradients<true><<<grid_blocks(total), block_threads, 0, stream()>>>(
          accum_, total, scale_, &scale_->overflowed);
      LOOM_CUDA_LAUNCH_CHECK("scan_gradients<true>");
    }
    ::loom::gpu::squared_norm(accum_, total, norm_, norm_scratch_, norm_scratch_bytes_, stream());
    LOOM_CUDA_CHECK(cudaMemcpyAsync(norm_host_.data(), norm_, sizeof(double),
                                    cudaMemcpyDeviceToHost, stream()));
    context_.stream.synchronize();
    return norm_host_.data()[0];
  }

  void copy_optimizer(std::size_t b, float* host, cudaMemcpyKind kind) override {
    LOOM_CHECK(b < optimizer_.buffers(), "ModelSplit stage: ", optimizer_.name(), " has ",
               optimizer_.buffers(), " buffer(s), not ", b + 1);
    layers_.copy_parameters(layers_.moment(b), host, kind);
    context_.stream.synchronize();
  }

  float* accumulator() override { return accum_; }
  void copy_accumulator(float* host) override {
    layers_.copy_parameters(accum_, host, cudaMemcpyDeviceToHost);
    context_.stream.synchronize();
  }
  void zero_accumulator() override {
    LOOM_CUDA_CHECK(cudaMemsetAsync(accum_, 0, layers_.parameters() * sizeof(float), stream()));
  }

  LossTotals take_totals() override {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(totals_host_.data(), totals_, sizeof(LossTotals),
                                    cudaMemcpyDeviceToHost, stream()));
    LOOM_CUDA_CHECK(cudaMemsetAsync(totals_, 0, sizeof(LossTotals), stream()));
    context_.stream.synchronize();
    return totals_host_.data()[0];
  }

  // The range's slice of a host buffer in the CPU Model's order to or from
  // the padded device layout; waits for the stream (the host slice may go).
  void copy_parameters(float* host, cudaMemcpyKind kind) override {
    layers_.copy_parameters(layers_.params(), host, kind);
    context_.stream.synchronize();
  }
  void copy_running_state(float* host, cudaMemcpyKind kind) override {
    layers_.copy_running_state(host, kind);
    context_.stream.synchronize();
  }

  void copy_state_from(DeviceStageBase& other) override {
    const std::size_t total = layers_.parameters();
    LOOM_CHECK(other.device_parameters() == total,
               "ModelSplit: a stage takes the state of the same stage only");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(other.stream()));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(layers_.params(), other.parameters_on_device(),
                                    total * sizeof(float), cudaMemcpyDefault, stream()));
    for (std::size_t b = 0; b < optimizer_.buffers(); ++b)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(layers_.moment(b), other.optimizer_on_device(b),
                                      total * sizeof(float), cudaMemcpyDefault, stream()));
    if (layers_.state_count() > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(layers_.state(), other.running_state_on_device(),
                                      layers_.state_count() * sizeof(float), cudaMemcpyDefault,
                                      stream()));
    context_.stream.synchronize();  // `other` may go when this returns
  }
  float* parameters_on_device() override { return layers_.params(); }
  float* optimizer_on_device(std::size_t b) override { return layers_.moment(b); }
  float* running_state_on_device() override { return layers_.state(); }
  std::size_t device_parameters() const override { return layers_.parameters(); }

 private:
  // take(pointer, count) for every buffer besides the layers', in the
  // arena's order (make_arena).
  template <class Take>
  void lay_out(Take&& take) {
    take(accum_, layers_.parameters());
    take(scale_, 1);
    take(update_, 1);
    take(norm_, 1);
    take(norm_scratch_, norm_scratch_bytes_);
    take(totals_, 1);
    take(skip_nonfinite_, 1);
    for (std::size_t slot = 0; slot < inputs_.size(); ++slot) {
      take(inputs_[slot], max_batch() * input_size());
      take(labels_[slot], max_batch());
    }
  }

  int device_;
  bool first_;
  DeviceOptimizer optimizer_;
  Precision precision_;
  DeviceContext context_;
  Stream copy_stream_;
  DeviceLayers<Net> layers_;
  SoftmaxXentWorkspace loss_;
  PinnedBuffer<LossTotals> totals_host_;
  PinnedBuffer<double> norm_host_;  // squared_norm()'s
  PinnedBuffer<float> pinned_inputs_;         // per slot (the first stage)
  PinnedBuffer<std::int32_t> pinned_labels_;  // per slot (the last stage's are read)
  std::vector<float*> inputs_;                // per slot
  std::vector<std::int32_t*> labels_;         // per slot (the last stage's are read)
  std::unique_ptr<DeviceArena> arena_;
  float* accum_ = nullptr;  // the step's micro-batches' gradients, summed
  LossScaleState* scale_ = nullptr;  // fp16: the scale (from the host) and scratch for a flag
  LossScaleState scale_value_{.scale = std::numeric_limits<float>::quiet_NaN()};  // the last copied
  UpdateScalars* update_ = nullptr;
  UpdateScalars update_value_{.lr = std::numeric_limits<float>::quiet_NaN()};  // the last copied
  double* norm_ = nullptr;  // squared norms: the stage's, then the whole network's for the update
  std::size_t norm_scratch_bytes_ = 0;
  unsigned char* norm_scratch_ = nullptr;
  int* skip_nonfinite_ = nullptr;  // 1: a non-finite loss marks the totals, never halts them
  LossTotals* totals_ = nullptr;
  std::vector<Event> slot_done_;  // the last pass that used each slot
  std::vector<Event> staged_;     // each slot's last copy from pinned memory
  Event backward_done_;           // the last backward (it read output_gradient())
  ScalarStager scalars_;          // the host's per-step values, through pinned slots
};

// The pipelines of one process's GPUs: ModelSplit (one pipeline, stage k on
// devices[k]) or Hybrid (grid.replicas pipelines: rank w = replica w / S,
// stage w % S on devices[w]). A GPU may hold several ranks.
//
// Hybrid sums each stage's accumulated gradients over its copies after the
// step's last backward: replica 0's copy (the leader) adds the others' in
// replica order (peer copies, then one add kernel each; deterministic, and
// copies may share a GPU, which NCCL refuses), then each copy takes the sum
// back before its update. Events order it: the leader waits for each copy's
// gradients, the copies for the sum (as fp16's unscaling left it), and the
// leader's next step for every copy to have taken it; after a skipped step
// each copy's next backward waits for the leader's reads of its gradients.
template <class Net, class Partition>
class PipelineEngine final : public ::loom::detail::SplitEngine<Net> {
 public:
  static constexpr std::size_t classes = Net::output_shape::size;

  // Planned for global batches of up to max_batch samples; `previous` (same
  // network, devices and optimizer, planned smaller) hands over weights and
  // optimizer state, else it starts at zero (scatter_optimizer sets another).
  // `precision` is every step's and evaluation's (the stages' GEMMs are
  // planned for it).
  // `grid`: the policy's replicas and schedule (see ::loom::PipelineGrid);
  // `schedule`: the one to run (micro_batches 0: the grid's).
  PipelineEngine(const std::vector<Device>& devices, const Model<Net, float>& initial,
                 const DeviceOptimizer& optimizer, const ::loom::PipelineGrid& grid,
                 PipelineSchedule schedule, Precision precision, bool allow_tf32,
                 std::size_t max_batch, PipelineEngine* previous = nullptr)
      : name_(grid.policy),
        replicas_(grid.replicas),
        stage_count_(grid.stages),
        ranks_(grid.replicas * grid.stages),
        schedule_(schedule.micro_batches == 0 ? grid.schedule : schedule),
        max_batch_(max_batch),
        optimizer_(optimizer),
        precision_(precision),
        updates_(previous != nullptr ? previous->updates_ : 0),
        totals_(grid.replicas),
        crew_(name_.c_str(), devices::hardware_threads()) {
    LOOM_CHECK(replicas_ >= 1, name_, " needs at least one replica");
    if (replicas_ > 1)
      LOOM_CHECK(devices.size() == ranks_, name_, " has ", replicas_, " replicas x ", stage_count_,
                 " stages and needs ", ranks_, " GPUs, one per rank, but ", devices.size(),
                 " were given (a GPU may be named more than once)");
    else
      LOOM_CHECK(devices.size() == stage_count_, name_, " has ", stage_count_, " stages but ",
                 devices.size(), " GPUs were given (a GPU may be named more than once)");
    try {
      make_stages(devices, initial, allow_tf32, previous);
      crew_.start(
          ranks_, [this](std::size_t w, const Job& job) { work(w, job); },
          [this](std::size_t, const std::string& why) {
            for (auto& link : forward_) link->cancel(why);
            for (auto& link : backward_) link->cancel(why);
          });
    } catch (...) {
      crew_.stop();
      release();  // no destructor runs for a constructor that throws
      throw;
    }
  }
  PipelineEngine(const PipelineEngine&) = delete;
  PipelineEngine& operator=(const PipelineEngine&) = delete;
  ~PipelineEngine() override {
    crew_.stop();
    release();
  }

  std::size_t max_batch() const { return max_batch_; }
  bool all_local() const override { return true; }

  // The stages' layers would take every frame as valid (their slots get no
  // lengths, DeviceLayers::set_frames): refused rather than computing other
  // numbers than the CPU.
  void check_no_lengths(bool lengths) const {
    LOOM_CHECK(!lengths, name_, " on GPUs does not take sequences with lengths (Targets::frames) "
               "yet; train such a network on one GPU or with DataParallel, or on CPUs");
  }
  std::size_t local_stages() const { return ranks_; }

  cpu::LossSums micro_step(const float* images, const Targets& targets, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last,
                           const StepSettings& settings,
                           const Pass& pass = {.training = true}) override {
    LOOM_CHECK(settings.precision == precision_, name_, " on GPUs: a ",
               precision_name(settings.precision), " step; the stages were made for ",
               precision_name(precision_));
    LOOM_CHECK(n <= max_batch_, name_, ": a batch of ", n, " samples; planned for ",
               max_batch_);
    check_no_lengths(targets.frames != nullptr);
    crew_.run({.kind = JobKind::train,
               .images = images,
               .labels = targets.labels,
               .n = n,
               .group_samples = group_samples,
               .accumulate = accumulate,
               .last = last,
               .settings = settings,
               .pass = pass});
    if (!last) return {};
    fault_ = {};
    gradients_nonfinite_ = false;
    std::size_t replica = 0;
    const LossTotals t = total(&replica);
    if (t.halted == halt_bad_label)
      LOOM_FAIL("label ", t.bad_label, " of sample ", t.bad_row, " of a micro-batch",
                replicas_ > 1 ? " of replica " + std::to_string(replica) : std::string(),
                " is outside the network's ", classes, " classes");
    cpu::LossSums sums{t.loss, static_cast<std::size_t>(t.correct)};
    clip_squares_ = -1.0;  // no clipping unless the protocol clips
    StageExecutor executor{*this, settings, images, n, sums.loss};
    sums.overflowed =
        ::loom::detail::step_protocol(executor, settings) == ::loom::detail::StepEnd::overflowed;
    return sums;
  }

  // The GPUs' executor of the step protocol: the host decides, from the
  // loss the last stages summed and the squared norms every stage reads
  // back (finite exactly when every gradient is: a float's square cannot
  // overflow a double, nor can any count of them); the stages' jobs do.
  struct StageExecutor {
    PipelineEngine& e;
    const StepSettings& settings;
    const float* images;  // the step's last batch, which a non-finite step searches
    std::size_t n;
    double loss;
    double squares = 0.0;
    bool summed = false;

    bool loss_finite() const { return std::isfinite(loss); }
    bool gradients_finite() { return std::isfinite(summed_squares()); }
    // fp16: the norm job unscales replica 0's sums before it squares them
    // (the copies take them as unscaled).
    bool unscale(float) { return std::isfinite(summed_squares()); }
    void skip_nonfinite(bool gradients_bad) { e.skip_step(images, n, gradients_bad); }
    // The trainer's scale backs off, or (at its minimum) reports the step
    // as non-finite, naming the gradient.
    void skip_overflow(bool name_spot) {
      e.crew_.run({.kind = JobKind::restore});
      if (name_spot) e.fault_ = e.gradient_spot();
    }
    void clip(float) { e.clip_squares_ = summed_squares(); }
    // Read by the update jobs (the crew's run orders the writes before them).
    void update(float lr) {
      e.scalars_ = update_scalars(e.optimizer_, lr, e.updates_ + 1, settings.max_grad_norm);
      e.crew_.run({.kind = JobKind::update});
      e.updates_ += 1;
    }

    // Hybrid first sums each stage's copies into replica 0's stages, which
    // then hold the step's gradients.
    double summed_squares() {
      if (summed) return squares;
      summed = true;
      if (e.replicas_ > 1) e.crew_.run({.kind = JobKind::reduce});
      e.crew_.run({.kind = JobKind::norm, .settings = settings});
      for (const double stage_squares : e.stage_squares_) squares += stage_squares;
      return squares;
    }
  };

  // After a step whose loss or gradients went non-finite, which no stage
  // took: the first non-finite value the host could find (the step's last
  // batch, the weights, with a finite loss the summed gradients), else
  // nowhere; and whether the gradients were the ones.
  const NonFiniteSpot& fault() const override { return fault_; }
  bool gradients_nonfinite() const override { return gradients_nonfinite_; }

  cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch,
                         Precision precision = Precision::fp32) override {
    LOOM_CHECK(precision == precision_, name_, " on GPUs: a ", precision_name(precision),
               " evaluation; the stages were made for ", precision_name(precision_));
    check_no_lengths(!dataset.frames.empty());
    crew_.run({.kind = JobKind::evaluate, .n = std::min(batch, max_batch_), .dataset = &dataset});
    const LossTotals t = total();
    if (t.halted == halt_bad_label)
      LOOM_FAIL("evaluate: dataset '", dataset.name, "': label ", t.bad_label,
                " of a sample is outside the network's ", classes, " classes");
    return {t.loss, static_cast<std::size_t>(t.correct)};
  }

  // Replica 0's stages hold the weights (the copies are equal) and the
  // running statistics (each copy keeps its own).
  void gather(Model<Net, float>& whole) override {
    for (std::size_t k = 0; k < stage_count_; ++k) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[k]->device()));
      stages_[k]->copy_parameters(whole.parameters().data() + offsets_[k], cudaMemcpyDeviceToHost);
      stages_[k]->copy_running_state(whole.state().data() + state_offsets_[k],
                                     cudaMemcpyDeviceToHost);
    }
  }
  // Optimizer buffer b of the whole network into `whole` (replica 0's
  // stages: the copies are equal), or every stage's slice from it.
  void gather_optimizer(std::size_t b, float* whole) override {
    for (std::size_t k = 0; k < stage_count_; ++k) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[k]->device()));
      stages_[k]->copy_optimizer(b, whole + offsets_[k], cudaMemcpyDeviceToHost);
    }
  }
  void scatter_optimizer(std::size_t b, const float* whole) override {
    for (std::size_t w = 0; w < ranks_; ++w) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[w]->device()));
      stages_[w]->copy_optimizer(b, const_cast<float*>(whole) + offsets_[w % stage_count_],
                                 cudaMemcpyHostToDevice);
    }
  }
  // Optimizer steps taken (Adam's bias corrections count them).
  std::uint64_t optimizer_steps() const override { return updates_; }
  void set_optimizer_steps(std::uint64_t steps) override { updates_ = steps; }

  void scatter(const Model<Net, float>& whole) override {
    for (std::size_t w = 0; w < ranks_; ++w) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[w]->device()));
      stages_[w]->copy_parameters(
          const_cast<float*>(whole.parameters().data()) + offsets_[w % stage_count_],
          cudaMemcpyHostToDevice);
      stages_[w]->copy_running_state(
          const_cast<float*>(whole.state().data()) + state_offsets_[w % stage_count_],
          cudaMemcpyHostToDevice);
    }
  }

 private:
  enum class JobKind { train, evaluate, reduce, norm, update, restore };
  using Job = ::loom::detail::EngineJob<JobKind>;

  // Hybrid: what the copies of one stage share for their reduction.
  struct StageGroup {
    DeviceBuffer<float> scratch;  // on the leader's GPU: one copy's gradients at a time
    std::unique_ptr<Event> reduced;  // the leader's stream: the sum is in its accumulator
  };

  std::size_t replica_of(std::size_t w) const { return w / stage_count_; }
  std::size_t stage_of(std::size_t w) const { return w % stage_count_; }
  // Link between stage k and k + 1 of replica r.
  std::size_t link(std::size_t r, std::size_t k) const { return r * (stage_count_ - 1) + k; }

  void make_stages(const std::vector<Device>& devices, const Model<Net, float>& initial,
                   bool allow_tf32, PipelineEngine* previous) {
    // Each replica pipelines its share of a batch.
    replica_batch_ = std::max<std::size_t>(1, batch_share(max_batch_, replicas_, 0).count);
    diagnosis_ = std::make_unique<Model<Net, float>>();
    rounded_input_.resize(max_batch_ * Net::input_shape::size);
    const std::size_t micro =
        std::max<std::size_t>(1, std::min(schedule_.micro_batches, replica_batch_));
    const std::size_t most = batch_share(replica_batch_, micro, 0).count;
    stages_.resize(ranks_);
    offsets_.resize(stage_count_);
    state_offsets_.resize(stage_count_);
    stage_squares_.assign(stage_count_, 0.0);
    with_cut<Partition>(stage_count_, [&]<class Cut>() {
      using bounds = partition_bounds<Net, Cut>;
      static_for<Cut::stages>([&](auto k) {
        constexpr std::size_t K = decltype(k)::value;
        using StageNet = stage_net_t<Net, Cut, K>;
        constexpr std::size_t offset = stage_parameter_offset<Net, Cut, K>;
        constexpr std::size_t state_at = stage_state_offset<Net, Cut, K>;
        offsets_[K] = offset;
        state_offsets_[K] = state_at;
        const auto weights = initial.parameters().subspan(offset, StageNet::parameter_count);
        const auto state = initial.state().subspan(state_at, StageNet::state_count);
        for (std::size_t r = 0; r < replicas_; ++r) {
          const std::size_t w = r * stage_count_ + K;
          const int device = devices[w].index;
          const std::size_t slots = pipeline_in_flight(schedule_.kind, stage_count_, K, micro);
          LOOM_CUDA_CHECK(cudaSetDevice(device));
          if constexpr (cuts_between_executed<Net>(bounds::bounds))
            // A range of the whole network's executed layers: every stage
            // of every cut is one type.
            stages_[w] = std::make_unique<DeviceStage<Net>>(
                device,
                LayerRange{executed_from<Net>(bounds::bounds[K]),
                           executed_from<Net>(bounds::bounds[K + 1])},
                K == 0, weights, state, optimizer_, most, slots, precision_, allow_tf32);
          else
            // A cut splits a fused pair (Conv2d or Linear or BatchNorm2d, and
            // ReLU): each stage fuses its own layers.
            stages_[w] = std::make_unique<DeviceStage<StageNet>>(
                device, LayerRange{0, StageNet::executed::size}, K == 0, weights, state,
                optimizer_, most, slots, precision_, allow_tf32);
          if (previous != nullptr) stages_[w]->copy_state_from(*previous->stages_[w]);
        }
      });
    });
    for (std::size_t r = 0; r < replicas_; ++r)
      for (std::size_t k = 0; k + 1 < stage_count_; ++k) {
        const int from = stages_[r * stage_count_ + k]->device();
        const int to = stages_[r * stage_count_ + k + 1]->device();
        enable_peer_access(from, to);
        forward_.push_back(std::make_unique<DeviceLink>(from, to));
        backward_.push_back(std::make_unique<DeviceLink>(to, from));
      }
    if (replicas_ > 1) {
      for (std::size_t w = 0; w < ranks_; ++w) {
        LOOM_CUDA_CHECK(cudaSetDevice(stages_[w]->device()));
        ready_.push_back(std::make_unique<Event>());
        pulled_.push_back(std::make_unique<Event>());
      }
      for (std::size_t k = 0; k < stage_count_; ++k) {
        DeviceStageBase& leader = *stages_[k];
        for (std::size_t r = 1; r < replicas_; ++r)
          enable_peer_access(leader.device(), stages_[r * stage_count_ + k]->device());
        LOOM_CUDA_CHECK(cudaSetDevice(leader.device()));
        groups_.push_back({DeviceBuffer<float>(leader.device_parameters(),
                                               "Hybrid's reduction of stage " + std::to_string(k)),
                           std::make_unique<Event>()});
      }
    }
  }

  // Every stage's work (and the copies between them) ends before any
  // stage's memory goes; each GPU's memory is freed with that GPU current.
  void release() noexcept {
    for (auto& stage : stages_) {
      if (!stage) continue;
      LOOM_CUDA_RELEASE(cudaSetDevice(stage->device()));
      stage->synchronize();
    }
    forward_.clear();
    backward_.clear();
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      LOOM_CUDA_RELEASE(cudaSetDevice(stages_[k]->device()));
      groups_[k] = {};
    }
    groups_.clear();
    ready_.clear();
    pulled_.clear();
    for (auto& stage : stages_) {
      if (!stage) continue;
      LOOM_CUDA_RELEASE(cudaSetDevice(stage->device()));
      stage.reset();
    }
    stages_.clear();
  }

  static void enable_peer_access(int a, int b) {
    if (a == b) return;
    for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
      int can = 0;
      LOOM_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
      if (!can) continue;  // copies then go through the host
      LOOM_CUDA_CHECK(cudaSetDevice(from));
      const cudaError_t status = cudaDeviceEnablePeerAccess(to, 0);
      // Already enabled is what we want; out of peer slots (large nodes),
      // copies still work, through the host. Either way the error is cleared.
      if (status == cudaErrorPeerAccessAlreadyEnabled || status == cudaErrorTooManyPeers)
        cudaGetLastError();
      else
        LOOM_CUDA_CHECK(status);
    }
  }

  void work(std::size_t w, const Job& job) {
    DeviceStageBase& stage = *stages_[w];
    LOOM_CUDA_CHECK(cudaSetDevice(stage.device()));
    switch (job.kind) {
      case JobKind::train:
        train(w, stage, job);
        break;
      case JobKind::evaluate:
        evaluate(w, stage, *job.dataset, job.n);
        break;
      case JobKind::reduce:
        if (replica_of(w) == 0) reduce(w, stage);
        break;
      case JobKind::norm:
        if (replica_of(w) == 0) {
          stage_squares_[stage_of(w)] =
              stage.squared_norm(job.settings.precision == Precision::fp16);
          // Hybrid: the copies take the sum as fp16's unscaling left it.
          if (replicas_ > 1) groups_[w].reduced->record(stage.stream());
        }
        break;
      case JobKind::update:
        if (replicas_ > 1 && replica_of(w) > 0) take_sum(w, stage);
        stage.update(scalars_, clip_squares_);
        break;
      case JobKind::restore:
        stage.restore_state();
        // Hybrid: a skipped step's copies take no sum, but their next
        // backward must not overwrite what their leader's reduce reads.
        if (replicas_ > 1 && replica_of(w) > 0) groups_[stage_of(w)].reduced->wait_on(stage.stream());
        break;
    }
  }

  // A non-finite step: every rank puts its running statistics back, and
  // the host looks for what to name, in the order the CPU does as far as
  // the GPUs kept it (the layers' outputs are gone): the step's last batch
  // (`images`, n samples), then the weights layer by layer, then (the loss
  // finite) the gradients in backward order.
  void skip_step(const float* images, std::size_t n, bool gradients_bad) {
    crew_.run({.kind = JobKind::restore});
    gradients_nonfinite_ = gradients_bad;
    // The input as the first stage computed with it: rounded in a reduced
    // precision (fp16 overflows past 65504, as the CPU's rounded copy does).
    constexpr std::size_t sample = Net::input_shape::size;
    const std::size_t count = n * sample;
    std::copy_n(images, count, rounded_input_.data());
    ::loom::round_to(precision_, rounded_input_.data(), count);
    const std::size_t at = ::loom::detail::first_nonfinite(rounded_input_.data(), count);
    if (at < count) {
      fault_ = {NonFiniteSpot::Where::input, 0, 0, at % sample, sample, at / sample,
                rounded_input_[at]};
      return;
    }
    gather(*diagnosis_);
    fault_ = diagnosis_->find_nonfinite_weight();
    if (!fault_ && gradients_bad) fault_ = gradient_spot();
  }

  // The first non-finite gradient of replica 0's summed ones, in backward order.
  NonFiniteSpot gradient_spot() {
    for (std::size_t k = 0; k < stage_count_; ++k) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[k]->device()));
      stages_[k]->copy_accumulator(diagnosis_->gradients().data() + offsets_[k]);
    }
    return diagnosis_->find_nonfinite_gradient();
  }

  // The leader of stage k adds its copies' accumulated gradients to its own.
  void reduce(std::size_t k, DeviceStageBase& leader) {
    const std::size_t count = leader.device_parameters();
    StageGroup& group = groups_[k];
    for (std::size_t r = 1; r < replicas_; ++r) {
      DeviceStageBase& copy = *stages_[r * stage_count_ + k];
      ready_[r * stage_count_ + k]->wait_on(leader.stream());
      LOOM_CUDA_CHECK(cudaMemcpyPeerAsync(group.scratch.data(), leader.device(), copy.accumulator(),
                                          copy.device(), count * sizeof(float), leader.stream()));
      add_into(leader.accumulator(), group.scratch.data(), count, leader.stream());
    }
    group.reduced->record(leader.stream());
  }

  // A copy takes its leader's sum before updating.
  void take_sum(std::size_t w, DeviceStageBase& copy) {
    DeviceStageBase& leader = *stages_[stage_of(w)];
    groups_[stage_of(w)].reduced->wait_on(copy.stream());
    LOOM_CUDA_CHECK(cudaMemcpyPeerAsync(copy.accumulator(), copy.device(), leader.accumulator(),
                                        leader.device(), copy.device_parameters() * sizeof(float),
                                        copy.stream()));
    pulled_[w]->record(copy.stream());
  }

  // Micro-batch `count` of a host batch into the first stage's slot (and
  // its labels into the last stage's), on the compute stream.
  void load(std::size_t w, DeviceStageBase& stage, std::size_t slot, const float* images,
            const std::int32_t* labels, std::size_t count) {
    const std::size_t r = replica_of(w), k = stage_of(w);
    // A stage of in-place layers sends from its input buffer: it waits for
    // the next stage to have copied the last micro-batch out of it.
    if (k + 1 < stage_count_ && stage.output(slot) == stage.input(slot))
      forward_[link(r, k)]->before_overwrite(stage.input(slot),
                                             k == 0 ? stage.stream() : stage.copy_stream());
    const bool first = k == 0, last = k + 1 == stage_count_;
    if (first || last) stage.staged(slot).synchronize();  // the slot's pinned memory is free
    if (first) {
      const std::size_t values = count * stage.input_size();
      std::copy_n(images, values, stage.pinned_input(slot));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(stage.input(slot), stage.pinned_input(slot),
                                      values * sizeof(float), cudaMemcpyHostToDevice,
                                      stage.stream()));
    } else {
      forward_[link(r, k - 1)]->receive(stage.input(slot), count * stage.input_size(),
                                        stage.copy_stream(), &stage.slot_done(slot),
                                        stage.stream());
    }
    if (last) {
      std::copy_n(labels, count, stage.pinned_labels(slot));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(stage.labels(slot), stage.pinned_labels(slot),
                                      count * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                      stage.stream()));
    }
    if (first || last) stage.staged(slot).record(stage.stream());
  }

  void forward_pass(std::size_t w, DeviceStageBase& stage, std::size_t slot, std::size_t count,
                    bool training = false, const DevicePass& pass = {}) {
    const std::size_t r = replica_of(w), k = stage_of(w);
    const bool sends = k + 1 < stage_count_;
    if (sends) forward_[link(r, k)]->before_overwrite(stage.output(slot), stage.stream());
    stage.forward(slot, count, training, pass);
    stage.slot_done(slot).record(stage.stream());
    if (sends)
      forward_[link(r, k)]->send(stage.output(slot), count * stage.output_size(), stage.stream());
  }

  void train(std::size_t w, DeviceStageBase& stage, const Job& job) {
    const std::size_t r = replica_of(w), k = stage_of(w);
    // This replica's share of the batch, in micro-batches.
    const auto share = batch_share(job.n, replicas_, r);
    const std::size_t micro = std::min(schedule_.micro_batches, share.count);
    // The leader overwrites its accumulator (the step's first backward)
    // only once every copy has taken the last step's sum out of it.
    const auto wait_for_copies = [&] {
      if (replicas_ > 1 && r == 0)
        for (std::size_t c = 1; c < replicas_; ++c)
          pulled_[c * stage_count_ + k]->wait_on(stage.stream());
    };
    std::vector<std::size_t> free_slots, slot_of(micro, 0);
    for (std::size_t s = pipeline_in_flight(schedule_.kind, stage_count_, k, micro); s-- > 0;)
      free_slots.push_back(s);
    bool first_backward = !job.accumulate;
    if (!job.accumulate) {
      stage.keep_state();  // before the step's forwards move it
      stage.round_weights();
      stage.set_loss_scale(job.settings.loss_scale);
    }
    const std::size_t sample = Net::input_shape::size;
    for_each_pipeline_op(schedule_.kind, stage_count_, k, micro, [&](PipelineOp op) {
      const auto piece = batch_share(share.count, micro, op.micro_batch);
      const std::size_t first_sample = share.first + piece.first;
      if (op.forward) {
        const std::size_t slot = free_slots.back();
        free_slots.pop_back();
        slot_of[op.micro_batch] = slot;
        load(w, stage, slot, job.images + first_sample * sample, job.labels + first_sample,
             piece.count);
        forward_pass(w, stage, slot, piece.count, true,
                     {.seed = job.pass.seed, .step = job.pass.step, .first_sample = first_sample});
        return;
      }
      const std::size_t slot = slot_of[op.micro_batch];
      if (k + 1 == stage_count_)
        stage.loss(slot, piece.count, job.group_samples, true);
      else
        backward_[link(r, k)]->receive(stage.output_gradient(), piece.count * stage.output_size(),
                                       stage.copy_stream(), &stage.backward_done(),
                                       stage.stream());
      if (k > 0) backward_[link(r, k - 1)]->before_overwrite(stage.input_gradient(), stage.stream());
      if (first_backward) wait_for_copies();
      stage.backward(slot, piece.count, std::exchange(first_backward, false));
      stage.backward_done().record(stage.stream());
      stage.slot_done(slot).record(stage.stream());
      if (k > 0)
        backward_[link(r, k - 1)]->send(stage.input_gradient(), piece.count * stage.input_size(),
                                        stage.stream());
      free_slots.push_back(slot);
    });
    // A replica without a sample in the step adds zeros to the sum.
    if (micro == 0 && !job.accumulate) {
      wait_for_copies();
      stage.zero_accumulator();
    }
    if (!job.last) return;
    if (replicas_ > 1) ready_[w]->record(stage.stream());
    if (k + 1 == stage_count_) totals_[r] = stage.take_totals();
  }

  // Each replica evaluates its share of the data set in pieces of up to
  // `batch` samples (at most what a replica was planned for).
  void evaluate(std::size_t w, DeviceStageBase& stage, const data::Dataset& data,
                std::size_t batch) {
    const std::size_t r = replica_of(w), k = stage_of(w);
    const auto share = batch_share(data.count, replicas_, r);
    const std::size_t piece = std::min(batch, replica_batch_);
    const std::size_t sample = data.sample_size();
    const std::size_t micro = std::min(schedule_.micro_batches, piece);
    stage.round_weights();
    for (std::size_t at = 0; at < share.count; at += piece) {
      const std::size_t n = std::min(piece, share.count - at);
      const std::size_t pieces = std::min(micro, n);
      for (std::size_t m = 0; m < pieces; ++m) {
        const auto part = batch_share(n, pieces, m);
        const std::size_t first = share.first + at + part.first;
        load(w, stage, 0, data.images.data() + first * sample, data.labels.data() + first,
             part.count);
        forward_pass(w, stage, 0, part.count);
        if (k + 1 == stage_count_) stage.loss(0, part.count, part.count, false);
      }
    }
    if (k + 1 == stage_count_) totals_[r] = stage.take_totals();
  }

  // The replicas' last stages' totals, summed, a training step's non-finite
  // batch losses included (as the CPU sums them); a bad label in any
  // replica halts the step. `replica`: whose label it is.
  LossTotals total(std::size_t* replica = nullptr) const {
    LossTotals sum{};
    for (std::size_t r = 0; r < replicas_; ++r) {
      const LossTotals& t = totals_[r];
      sum.loss += t.loss + (t.skipped == skipped_loss ? t.nonfinite_loss : 0.0);
      sum.correct += t.correct;
      sum.samples += t.samples;
      if (t.halted != halt_none && sum.halted == halt_none) {
        sum.halted = t.halted;
        sum.bad_label = t.bad_label;
        sum.bad_row = t.bad_row;
        if (replica != nullptr) *replica = r;
      }
    }
    return sum;
  }

  std::string name_;  // the policy's, for messages
  std::size_t replicas_, stage_count_, ranks_;
  PipelineSchedule schedule_;
  std::size_t max_batch_;
  DeviceOptimizer optimizer_;
  Precision precision_;
  std::uint64_t updates_ = 0;  // optimizer steps taken
  // The step's update, for the update jobs: its scalars, and the whole
  // network's squared gradient norm when clipping (else -1), summed from
  // replica 0's stages' (norm jobs) in stage order.
  UpdateScalars scalars_{};
  double clip_squares_ = -1.0;
  std::vector<double> stage_squares_;  // per stage
  std::size_t replica_batch_ = 1;  // the most samples of a batch one replica takes
  std::vector<std::unique_ptr<DeviceStageBase>> stages_;  // by rank: replica * stages + stage
  std::vector<std::size_t> offsets_;  // where each stage's slice of the whole network's weights starts
  std::vector<std::size_t> state_offsets_;  // and of its running statistics
  std::vector<std::unique_ptr<DeviceLink>> forward_, backward_;  // by link(replica, stage)
  std::vector<StageGroup> groups_;                  // Hybrid: per stage
  std::vector<std::unique_ptr<Event>> ready_, pulled_;  // Hybrid: per rank
  std::vector<LossTotals> totals_;  // per replica: its last stage's, after a step or an evaluation
  NonFiniteSpot fault_;  // the last step's, when it was not finite (skip_step)
  bool gradients_nonfinite_ = false;
  // Where skip_step looks, made with the stages (a skipped step allocates
  // nothing): the weights and gradients gathered, a batch's input rounded.
  std::unique_ptr<Model<Net, float>> diagnosis_;
  std::vector<float> rounded_input_;
  ::loom::detail::Crew<Job> crew_;  // last: its threads stop before the rest goes
};

}  // namespace loom::gpu
