// ModelSplit on GPUs: each stage a DeviceStage on its GPU (several stages may
// share one GPU, each on streams of its own), driven by a host thread that
// enqueues its schedule's passes (schedule.hpp) without waiting for the GPU.
//
// Between stages, DeviceLinks carry activations forward and gradients back
// as device-to-device copies (peer copies between GPUs) on the receiving
// stage's copy stream: the copy waits for the sender's event, the receiver's
// compute stream waits for the copy, so a stage copies its next input while
// it computes. A sender that is about to overwrite a buffer it sent from
// waits (host: the receiver has enqueued the copy; device: the copy is done).
//
// The loss is the last stage's (on the device, LossTotals); at the end of an
// optimizer step the host reads it, and every stage updates, or none when it
// is not finite (fit then raises with the epoch and step). Gradients of a
// step's micro-batches are summed into an accumulator; the update reads it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../data/dataset.hpp"
#include "../../parallel/crew.hpp"
#include "../../parallel/data_parallel.hpp"
#include "../../parallel/model_split.hpp"
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
  virtual void forward(std::size_t slot, std::size_t n) = 0;
  // The last stage: loss of slot's n samples (train: its gradient too, over group samples).
  virtual void loss(std::size_t slot, std::size_t n, std::size_t group, bool train) = 0;
  // first_of_step: the step's first backward (overwrites the accumulator).
  virtual void backward(std::size_t slot, std::size_t n, bool first_of_step) = 0;
  virtual void update(float lr) = 0;
  // Waits for the stream; returns the totals since the last call and zeroes them.
  virtual LossTotals take_totals() = 0;
  virtual void copy_parameters(float* host, cudaMemcpyKind kind) = 0;
  virtual void copy_state_from(DeviceStageBase& other) = 0;
  virtual void synchronize() = 0;
  virtual float* parameters_on_device() = 0;
  virtual float* velocity_on_device() = 0;
  virtual std::size_t device_parameters() const = 0;
};

// Stage `StageNet` (stage_net_t) on one GPU: `slots` micro-batches of up to
// `max_batch` samples alive at once. Not the first stage: it also computes
// the gradient for its input.
template <class StageNet, bool First>
class DeviceStage final : public DeviceStageBase {
 public:
  using executed = typename StageNet::executed;
  using layout = detail::device_layout<executed>;
  static constexpr std::size_t layer_count = executed::size;
  static constexpr std::size_t in_size = StageNet::input_shape::size;
  static constexpr std::size_t out_size = StageNet::output_shape::size;

  // Made with `device` current.
  DeviceStage(int device, std::span<const float> weights, SGD::Options sgd,
              std::size_t max_batch, std::size_t slots, bool allow_tf32)
      : device_(device),
        max_batch_(max_batch),
        sgd_(sgd),
        plans_(context_, max_batch, allow_tf32),
        loss_(max_batch),
        totals_host_(1),
        pinned_inputs_(First ? slots * max_batch * in_size : 0),
        pinned_labels_(slots * max_batch),
        slot_done_(slots),
        staged_(slots) {
    std::size_t bytes = 4 * DeviceArena::padded_bytes<float>(layout::total) +
                        DeviceArena::padded_bytes<LossTotals>(1) +
                        2 * DeviceArena::padded_bytes<float>(max_batch * largest_activation()) +
                        DeviceArena::padded_bytes<float>(max_batch * in_size) +
                        DeviceArena::padded_bytes<unsigned char>(plans_.scratch_bytes());
    const std::size_t per_slot = slot_bytes(max_batch);
    bytes += slots * per_slot;
    arena_ = std::make_unique<DeviceArena>(
        bytes, "ModelSplit stage on cuda:" + std::to_string(device));
    params_ = arena_->take<float>(layout::total);
    grads_ = arena_->take<float>(layout::total);
    accum_ = arena_->take<float>(layout::total);
    velocity_ = arena_->take<float>(layout::total);
    totals_ = arena_->take<LossTotals>(1);
    for (auto& buffer : grad_buffers_) buffer = arena_->take<float>(max_batch * largest_activation());
    input_gradient_ = arena_->take<float>(max_batch * in_size);
    scratch_ = arena_->take<unsigned char>(plans_.scratch_bytes());
    slots_.resize(slots);
    for (auto& s : slots_) {
      s.input = arena_->take<float>(max_batch * in_size);
      s.labels = arena_->take<std::int32_t>(max_batch);
      static_for<layer_count>([&](auto i) {
        using L = type_at_t<i, executed>;
        if constexpr (!L::in_place) s.outputs[i] = arena_->take<float>(max_batch * L::output_shape::size);
        if constexpr (detail::writes_relu_mask<executed, i>())
          s.masks[i] = arena_->take<unsigned char>(relu_mask_bytes(max_batch, L::output_shape::size));
      });
    }
    for (float* buffer : {params_, grads_, accum_, velocity_})
      LOOM_CUDA_CHECK(cudaMemsetAsync(buffer, 0, layout::total * sizeof(float), stream()));
    LOOM_CUDA_CHECK(cudaMemsetAsync(totals_, 0, sizeof(LossTotals), stream()));
    copy_parameters(const_cast<float*>(weights.data()), cudaMemcpyHostToDevice);
    // The host slice may go when this returns.
    context_.stream.synchronize();
  }
  ~DeviceStage() override { synchronize(); }

  // Waits for both streams (the copies read other stages' memory).
  void synchronize() override {
    LOOM_CUDA_RELEASE(cudaStreamSynchronize(copy_stream_.get()));
    LOOM_CUDA_RELEASE(cudaStreamSynchronize(context_.stream.get()));
  }

  int device() const override { return device_; }
  std::size_t max_batch() const override { return max_batch_; }
  std::size_t input_size() const override { return in_size; }
  std::size_t output_size() const override { return out_size; }
  cudaStream_t stream() const override { return context_.stream.get(); }
  cudaStream_t copy_stream() const override { return copy_stream_.get(); }
  float* input(std::size_t slot) override { return slots_[slot].input; }
  const float* output(std::size_t slot) const override { return output_of<layer_count - 1>(slots_[slot]); }
  std::int32_t* labels(std::size_t slot) override { return slots_[slot].labels; }
  float* output_gradient() override { return grad_buffers_[0]; }
  float* input_gradient() override { return input_gradient_; }
  Event& slot_done(std::size_t slot) override { return slot_done_[slot]; }
  float* pinned_input(std::size_t slot) override {
    LOOM_CHECK(First, "ModelSplit: only the first stage takes images from the host");
    return pinned_inputs_.data() + slot * max_batch_ * in_size;
  }
  std::int32_t* pinned_labels(std::size_t slot) override {
    return pinned_labels_.data() + slot * max_batch_;
  }
  Event& staged(std::size_t slot) override { return staged_[slot]; }
  Event& backward_done() override { return backward_done_; }

  void forward(std::size_t slot, std::size_t n) override {
    check_batch(n);
    auto& plan = plans_.get(n);
    static_for<layer_count>([&](auto i) { std::get<i>(plan).forward(call<i>(slots_[slot])); });
  }

  void loss(std::size_t slot, std::size_t n, std::size_t group, bool train) override {
    check_batch(n);
    softmax_xent_async(output(slot), slots_[slot].labels, n, out_size, group,
                       train ? grad_buffers_[0] : nullptr, loss_, stream());
    accumulate_loss(loss_, slots_[slot].labels, n, train, totals_, stream());
  }

  void backward(std::size_t slot, std::size_t n, bool first_of_step) override {
    check_batch(n);
    auto& plan = plans_.get(n);
    const Slot& s = slots_[slot];
    int current = 0;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      detail::LayerCall c = call<i>(s);
      c.dy = grad_buffers_[current];
      // Layers with nothing before them to train pass no gradient back
      // (their runners plan none), except to the stage before.
      if constexpr (i > 0 && (!First || detail::needs_input_gradient<executed, i>()))
        c.dx = grad_buffers_[1 - current];
      else if constexpr (i == 0 && !First)
        c.dx = input_gradient_;
      std::get<i>(plan).backward(c);
      if (!L::in_place) current = 1 - current;
    });
    // An in-place first layer (Flatten) passes the gradient through.
    if constexpr (!First && type_at_t<0, executed>::in_place)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(input_gradient_, grad_buffers_[current],
                                      n * in_size * sizeof(float), cudaMemcpyDeviceToDevice,
                                      stream()));
    if (first_of_step)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(accum_, grads_, layout::total * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream()));
    else
      add_into(accum_, grads_, layout::total, stream());
  }

  void update(float lr) override {
    sgd_update(params_, accum_, velocity_, layout::total, lr, sgd_.momentum, sgd_.weight_decay,
               sgd_.nesterov, stream());
  }

  LossTotals take_totals() override {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(totals_host_.data(), totals_, sizeof(LossTotals),
                                    cudaMemcpyDeviceToHost, stream()));
    LOOM_CUDA_CHECK(cudaMemsetAsync(totals_, 0, sizeof(LossTotals), stream()));
    context_.stream.synchronize();
    return totals_host_.data()[0];
  }

  // Host flat slice (the CPU Model's order) to or from the padded device
  // layout; waits for the stream.
  void copy_parameters(float* host, cudaMemcpyKind kind) override {
    detail::copy_parameters<executed>(params_, host, kind, stream());
    context_.stream.synchronize();
  }

  void copy_state_from(DeviceStageBase& other) override {
    LOOM_CHECK(other.device_parameters() == layout::total,
               "ModelSplit: a stage takes the state of the same stage only");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(other.stream()));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(params_, other.parameters_on_device(),
                                    layout::total * sizeof(float), cudaMemcpyDefault, stream()));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(velocity_, other.velocity_on_device(),
                                    layout::total * sizeof(float), cudaMemcpyDefault, stream()));
    context_.stream.synchronize();  // `other` may go when this returns
  }
  float* parameters_on_device() override { return params_; }
  float* velocity_on_device() override { return velocity_; }
  std::size_t device_parameters() const override { return layout::total; }

 private:
  struct Slot {
    float* input = nullptr;
    std::int32_t* labels = nullptr;
    std::array<float*, layer_count> outputs{};
    std::array<void*, layer_count> masks{};
  };

  static constexpr std::size_t largest_activation() {
    return ::loom::detail::list_info<executed>::largest_activation;
  }

  static std::size_t slot_bytes(std::size_t max_batch) {
    std::size_t bytes = DeviceArena::padded_bytes<float>(max_batch * in_size) +
                        DeviceArena::padded_bytes<std::int32_t>(max_batch);
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!L::in_place)
        bytes += DeviceArena::padded_bytes<float>(max_batch * L::output_shape::size);
      if constexpr (detail::writes_relu_mask<executed, i>())
        bytes += DeviceArena::padded_bytes<unsigned char>(
            relu_mask_bytes(max_batch, L::output_shape::size));
    });
    return bytes;
  }

  void check_batch(std::size_t n) const {
    LOOM_CHECK(n >= 1 && n <= max_batch_, "ModelSplit stage on cuda:", device_, ": a micro-batch of ",
               n, " samples; it was planned for 1 to ", max_batch_);
  }

  template <std::size_t I>
  static const float* input_of(const Slot& s) {
    if constexpr (I == 0)
      return s.input;
    else
      return output_of<I - 1>(s);
  }
  template <std::size_t I>
  static float* output_of(const Slot& s) {
    constexpr int owner = ::loom::detail::list_info<executed>::output_owner[I];
    if constexpr (owner < 0)
      return s.input;
    else
      return s.outputs[owner];
  }

  template <std::size_t I>
  detail::LayerCall call(const Slot& s) const {
    detail::LayerCall c;
    c.weights = params_ + layout::offsets.weight[I];
    c.bias = params_ + layout::offsets.bias[I];
    c.dweights = grads_ + layout::offsets.weight[I];
    c.dbias = grads_ + layout::offsets.bias[I];
    c.x = input_of<I>(s);
    c.y = output_of<I>(s);
    c.mask = s.masks[I];
    if constexpr (I > 0) {
      c.previous_mask = s.masks[I - 1];
      c.previous_dbias = grads_ + layout::offsets.bias[I - 1];
    }
    c.scratch = scratch_;
    c.scratch_bytes = plans_.scratch_bytes();
    c.stream = stream();
    return c;
  }

  int device_;
  std::size_t max_batch_;
  SGD::Options sgd_;
  DeviceContext context_;
  Stream copy_stream_;
  detail::PlanCache<executed, !First> plans_;
  SoftmaxXentWorkspace loss_;
  PinnedBuffer<LossTotals> totals_host_;
  PinnedBuffer<float> pinned_inputs_;         // per slot (the first stage)
  PinnedBuffer<std::int32_t> pinned_labels_;  // per slot (the last stage's are read)
  std::unique_ptr<DeviceArena> arena_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  float* accum_ = nullptr;  // the step's micro-batches' gradients, summed
  float* velocity_ = nullptr;
  LossTotals* totals_ = nullptr;
  std::array<float*, 2> grad_buffers_{};
  float* input_gradient_ = nullptr;
  unsigned char* scratch_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<Event> slot_done_;  // the last pass that used each slot
  std::vector<Event> staged_;     // each slot's last copy from pinned memory
  Event backward_done_;           // the last backward (it read output_gradient())
};

// The pipeline of one process's GPUs: stage k on devices[k] (a GPU may hold
// several stages). SGD only, like the rest of the CUDA backend.
template <class Net, class Policy>
class PipelineEngine {
 public:
  using Partition = typename Policy::partition;
  static constexpr std::size_t stages = Policy::stages;
  static constexpr std::size_t classes = Net::output_shape::size;

  // Planned for global batches of up to max_batch samples; `previous` (same
  // network and devices, planned smaller) hands over weights and momentum.
  PipelineEngine(const std::vector<Device>& devices, const Model<Net, float>& initial,
                 SGD::Options sgd, PipelineSchedule schedule, bool allow_tf32,
                 std::size_t max_batch, PipelineEngine* previous = nullptr)
      : schedule_(schedule),
        max_batch_(max_batch),
        crew_(Policy::name, devices::hardware_threads()) {
    if (schedule_.micro_batches == 0) schedule_.micro_batches = Policy::schedule.micro_batches;
    LOOM_CHECK(devices.size() == stages, Policy::name, " has ", stages, " stages but ",
               devices.size(), " GPUs were given (a GPU may be named more than once)");
    try {
      make_stages(devices, initial, sgd, allow_tf32, previous);
    } catch (...) {
      release();  // no destructor runs for a constructor that throws
      throw;
    }
    crew_.start(
        stages, [this](std::size_t k, const Job& job) { work(k, job); },
        [this](std::size_t, const std::string& why) {
          for (auto& link : forward_) link->cancel(why);
          for (auto& link : backward_) link->cancel(why);
        });
  }
  PipelineEngine(const PipelineEngine&) = delete;
  PipelineEngine& operator=(const PipelineEngine&) = delete;
  ~PipelineEngine() {
    crew_.stop();
    release();
  }

  std::size_t max_batch() const { return max_batch_; }
  bool all_local() const { return true; }
  std::size_t local_stages() const { return stages; }

  cpu::LossSums micro_step(const float* images, const std::int32_t* labels, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last, float lr) {
    LOOM_CHECK(n <= max_batch_, Policy::name, ": a batch of ", n, " samples; planned for ",
               max_batch_);
    crew_.run({.kind = JobKind::train,
               .images = images,
               .labels = labels,
               .n = n,
               .group_samples = group_samples,
               .accumulate = accumulate,
               .last = last});
    if (!last) return {};
    const LossTotals& t = totals_;
    if (t.halted == halt_bad_label)
      LOOM_FAIL("label ", t.bad_label, " of sample ", t.bad_row, " of a micro-batch is outside the network's ",
                classes, " classes");
    if (t.halted == halt_nonfinite_loss) return {t.halt_loss, 0};  // no stage updates
    crew_.run({.kind = JobKind::update, .lr = lr});
    return {t.loss, static_cast<std::size_t>(t.correct)};
  }

  cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch) {
    crew_.run({.kind = JobKind::evaluate, .n = std::min(batch, max_batch_), .dataset = &dataset});
    if (totals_.halted == halt_bad_label)
      LOOM_FAIL("evaluate: dataset '", dataset.name, "': label ", totals_.bad_label,
                " of a sample is outside the network's ", classes, " classes");
    return {totals_.loss, static_cast<std::size_t>(totals_.correct)};
  }

  void gather(Model<Net, float>& whole) {
    for (std::size_t k = 0; k < stages; ++k) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[k]->device()));
      stages_[k]->copy_parameters(whole.parameters().data() + offsets_[k], cudaMemcpyDeviceToHost);
    }
  }
  void scatter(const Model<Net, float>& whole) {
    for (std::size_t k = 0; k < stages; ++k) {
      LOOM_CUDA_CHECK(cudaSetDevice(stages_[k]->device()));
      stages_[k]->copy_parameters(const_cast<float*>(whole.parameters().data()) + offsets_[k],
                                  cudaMemcpyHostToDevice);
    }
  }

 private:
  enum class JobKind { train, evaluate, update };
  using Job = ::loom::detail::EngineJob<JobKind>;

  void make_stages(const std::vector<Device>& devices, const Model<Net, float>& initial,
                   SGD::Options sgd, bool allow_tf32, PipelineEngine* previous) {
    const std::size_t micro = std::max<std::size_t>(1, std::min(schedule_.micro_batches, max_batch_));
    const std::size_t most = batch_share(max_batch_, micro, 0).count;
    static_for<stages>([&](auto k) {
      constexpr std::size_t K = decltype(k)::value;
      using StageNet = stage_net_t<Net, Partition, K>;
      constexpr std::size_t offset = stage_parameter_offset<Net, Partition, K>;
      const int device = devices[K].index;
      LOOM_CUDA_CHECK(cudaSetDevice(device));
      stages_.push_back(std::make_unique<DeviceStage<StageNet, K == 0>>(
          device, initial.parameters().subspan(offset, StageNet::parameter_count), sgd, most,
          pipeline_in_flight(schedule_.kind, stages, K, micro), allow_tf32));
      offsets_.push_back(offset);
      if (previous != nullptr) stages_.back()->copy_state_from(*previous->stages_[K]);
    });
    for (std::size_t k = 0; k + 1 < stages; ++k) {
      enable_peer_access(stages_[k]->device(), stages_[k + 1]->device());
      forward_.push_back(std::make_unique<DeviceLink>(stages_[k]->device(), stages_[k + 1]->device()));
      backward_.push_back(std::make_unique<DeviceLink>(stages_[k + 1]->device(), stages_[k]->device()));
    }
  }


  // Every stage's work (and the copies between them) ends before any
  // stage's memory goes; each stage is freed with its own GPU current.
  void release() noexcept {
    for (auto& stage : stages_) {
      LOOM_CUDA_RELEASE(cudaSetDevice(stage->device()));
      stage->synchronize();
    }
    forward_.clear();
    backward_.clear();
    for (auto& stage : stages_) {
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
      if (status == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError();  // clears it: already enabled is what we want
      else
        LOOM_CUDA_CHECK(status);
    }
  }

  void work(std::size_t k, const Job& job) {
    DeviceStageBase& stage = *stages_[k];
    LOOM_CUDA_CHECK(cudaSetDevice(stage.device()));
    if (job.kind == JobKind::update) {
      stage.update(job.lr);
      return;
    }
    if (job.kind == JobKind::evaluate) {
      evaluate(k, stage, *job.dataset, job.n);
      return;
    }
    train(k, stage, job);
  }

  // Micro-batch `share` of a host batch into the first stage's slot (and
  // its labels into the last stage's), on the compute stream.
  void load(std::size_t k, DeviceStageBase& stage, std::size_t slot, const float* images,
            const std::int32_t* labels, std::size_t count) {
    // A stage of in-place layers sends from its input buffer: it waits for
    // the next stage to have copied the last micro-batch out of it.
    if (k + 1 < stages && stage.output(slot) == stage.input(slot))
      forward_[k]->before_overwrite(stage.input(slot), k == 0 ? stage.stream() : stage.copy_stream());
    const bool first = k == 0, last = k + 1 == stages;
    if (first || last) stage.staged(slot).synchronize();  // the slot's pinned memory is free
    if (first) {
      const std::size_t values = count * stage.input_size();
      std::copy_n(images, values, stage.pinned_input(slot));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(stage.input(slot), stage.pinned_input(slot),
                                      values * sizeof(float), cudaMemcpyHostToDevice,
                                      stage.stream()));
    } else {
      receive_input(k, stage, slot, count);
    }
    if (last) {
      std::copy_n(labels, count, stage.pinned_labels(slot));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(stage.labels(slot), stage.pinned_labels(slot),
                                      count * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                      stage.stream()));
    }
    if (first || last) stage.staged(slot).record(stage.stream());
  }

  void receive_input(std::size_t k, DeviceStageBase& stage, std::size_t slot, std::size_t count) {
    forward_[k - 1]->receive(stage.input(slot), count * stage.input_size(), stage.copy_stream(),
                             &stage.slot_done(slot), stage.stream());
  }

  void forward_pass(std::size_t k, DeviceStageBase& stage, std::size_t slot, std::size_t count) {
    const bool sends = k + 1 < stages;
    if (sends) forward_[k]->before_overwrite(stage.output(slot), stage.stream());
    stage.forward(slot, count);
    stage.slot_done(slot).record(stage.stream());
    if (sends) forward_[k]->send(stage.output(slot), count * stage.output_size(), stage.stream());
  }

  void train(std::size_t k, DeviceStageBase& stage, const Job& job) {
    const std::size_t micro = std::min(schedule_.micro_batches, job.n);
    std::vector<std::size_t> free_slots, slot_of(micro, 0);
    for (std::size_t s = pipeline_in_flight(schedule_.kind, stages, k, micro); s-- > 0;)
      free_slots.push_back(s);
    bool first_backward = !job.accumulate;
    const std::size_t sample = Net::input_shape::size;
    for_each_pipeline_op(schedule_.kind, stages, k, micro, [&](PipelineOp op) {
      const auto share = batch_share(job.n, micro, op.micro_batch);
      if (op.forward) {
        const std::size_t slot = free_slots.back();
        free_slots.pop_back();
        slot_of[op.micro_batch] = slot;
        load(k, stage, slot, job.images + share.first * sample, job.labels + share.first,
             share.count);
        forward_pass(k, stage, slot, share.count);
        return;
      }
      const std::size_t slot = slot_of[op.micro_batch];
      if (k + 1 == stages)
        stage.loss(slot, share.count, job.group_samples, true);
      else
        backward_[k]->receive(stage.output_gradient(), share.count * stage.output_size(),
                              stage.copy_stream(), &stage.backward_done(), stage.stream());
      if (k > 0) backward_[k - 1]->before_overwrite(stage.input_gradient(), stage.stream());
      stage.backward(slot, share.count, std::exchange(first_backward, false));
      stage.backward_done().record(stage.stream());
      stage.slot_done(slot).record(stage.stream());
      if (k > 0)
        backward_[k - 1]->send(stage.input_gradient(), share.count * stage.input_size(),
                               stage.stream());
      free_slots.push_back(slot);
    });
    if (job.last && k + 1 == stages) totals_ = stage.take_totals();
  }

  void evaluate(std::size_t k, DeviceStageBase& stage, const data::Dataset& data,
                std::size_t piece) {
    const std::size_t sample = data.sample_size();
    const std::size_t micro = std::min(schedule_.micro_batches, piece);
    for (std::size_t at = 0; at < data.count; at += piece) {
      const std::size_t n = std::min(piece, data.count - at);
      const std::size_t pieces = std::min(micro, n);
      for (std::size_t m = 0; m < pieces; ++m) {
        const auto share = batch_share(n, pieces, m);
        const std::size_t first = at + share.first;
        load(k, stage, 0, data.images.data() + first * sample, data.labels.data() + first,
             share.count);
        forward_pass(k, stage, 0, share.count);
        if (k + 1 == stages) stage.loss(0, share.count, share.count, false);
      }
    }
    if (k + 1 == stages) totals_ = stage.take_totals();
  }

  PipelineSchedule schedule_;
  std::size_t max_batch_;
  std::vector<std::unique_ptr<DeviceStageBase>> stages_;
  std::vector<std::size_t> offsets_;  // where each stage's slice of the whole network's weights starts
  std::vector<std::unique_ptr<DeviceLink>> forward_, backward_;  // link k: stage k and k + 1
  LossTotals totals_{};  // the last stage's, after an optimizer step or an evaluation
  ::loom::detail::Crew<Job> crew_;  // last: its threads stop before the rest goes
};

}  // namespace loom::gpu
