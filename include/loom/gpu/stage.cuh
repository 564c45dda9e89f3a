// The CUDA backend's stage of the grid engine (parallel/grid_engine.hpp):
// gpu::DeviceStage runs the layers `range` of a stage's network on one GPU
// (DeviceLayers, device_layers.cuh), behind the engine's
// type-erased PipelineStage, so every policy on GPUs runs on the same
// engine, schedules and step protocol as on CPUs. gpu::DeviceStages
// is the maker a policy's typed engine takes (like detail::HostStages).
//
// Correctness first: every call enqueues its work on the stage's stream and
// waits for it before returning (the engine is host-driven, and the links
// read and write the stage's memory from other threads). A forward, and a
// backward without a hook, run as CUDA graphs (StepGraphs): each
// (slot, samples, training or accumulating, lengths) runs directly the
// first time, which sets up what cuDNN, cuBLASLt and NCCL (SyncBatchNorm's
// sums) make on first use, is captured the second time and replayed after;
// the scalars they read (Dropout's pass, the lengths) are written to device
// memory before the launch. A backward with a hook waits layer by layer,
// and a batch with lengths that cuDNN's RNN plans from the host runs
// directly (cudnn_rnn.cuh). The engine calls a rank's stage from that
// rank's own thread, and several ranks may share a GPU (then every call is
// launched directly, see links()): every call makes the stage's device
// current first.
//
// Buffers handed to the engine are the device's: parameters() and
// gradients() are DeviceLayers' padded layout (gaps of zeros between the
// layers' blocks), so the gradient buckets, planned in the CPU Model's
// packed order, are moved onto that layout once (reserve()). The engine's
// host reads and writes (read/write, diagnosis, TensorParallel's clipping
// squares) go through a host Model of the range, which also holds the
// initial weights until the layers are built; the other clipping squares
// are summed on the device (add_layer_squares).
//
// Between stages and over a stage's copies, links() gives NCCL
// communicators where every rank of the grid has a GPU of its own, and the
// host's groups staged through host memory (comm::HostStagedComm) where
// ranks share a GPU (NCCL refuses two ranks on one device).
#pragma once

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../backend/cuda/graph.hpp"
#include "../backend/cuda/launch.hpp"
#include "../backend/cuda/memory.hpp"
#include "../backend/cuda/softmax_xent.cuh"
#include "../backend/cuda/staging.hpp"
#include "../backend/cuda/stream.hpp"
#include "../comm/nccl_comm.hpp"
#include "../comm/staged_comm.hpp"
#include "../loss/loss.hpp"
#include "../parallel/grid_engine.hpp"
#include "device_layers.cuh"

namespace loom::gpu {

namespace kernels {

// values *= factor, one product each (the CPU's scale_gradients, and its
// unscale_gradients with factor = 1.0f / scale).
inline __global__ void scale_values(float* values, std::size_t count, float factor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    values[i] *= factor;
}

// Weight tying: both runs set to a + b, the CPU's sum.
inline __global__ void sum_runs(float* a, float* b, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    b[i] = a[i] = a[i] + b[i];
}

// *found = 1 when some value is NaN or infinite (every writer writes 1).
inline __global__ void find_nonfinite(const float* values, std::size_t count, int* found) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    if (!isfinite(values[i])) {
      *found = 1;
      return;
    }
}

// sums[r] = the sum of the squares of values[bounds[2r], bounds[2r + 1]), in
// double (the CPU's clipping norm sums a layer's squares in double): a block
// per range (a chunk of a layer), each summed in the same order every time.
inline __global__ void range_squares(const float* values, const std::size_t* bounds, double* sums) {
  using Reduce = cub::BlockReduce<double, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const std::size_t end = bounds[2 * blockIdx.x + 1];
  double sum = 0.0;
  for (std::size_t i = bounds[2 * blockIdx.x] + threadIdx.x; i < end; i += blockDim.x)
    sum += Square{}(values[i]);
  sum = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

}  // namespace kernels

// One GPU's memory, for the engine's outboxes: a message is copied there
// (on a stream of its own, waited for) until its link has sent it.
class DeviceMemory final : public ::loom::detail::MemorySpace {
 public:
  // Made with `device` current (its stream is that device's).
  explicit DeviceMemory(int device) : device_(device) {}

  std::shared_ptr<float[]> allocate(std::size_t n) const override {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    void* raw = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&raw, std::max<std::size_t>(n, 1) * sizeof(float)));
    return std::shared_ptr<float[]>(static_cast<float*>(raw),
                                    [](float* p) { LOOM_CUDA_RELEASE(cudaFree(p)); });
  }
  void copy(float* to, const float* from, std::size_t n) const override {
    if (n == 0) return;
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    copy_async(to, from, n, cudaMemcpyDeviceToDevice, stream_.get());
    stream_.synchronize();
  }

 private:
  int device_;
  Stream stream_;
};

// TensorParallel's group where every rank of the mesh has a GPU of its
// own: NCCL's sums and gathers, enqueued on the layer's stream (and so
// captured with the pass's graph).
class NcclTensorGroup final : public DeviceTensorGroup {
 public:
  explicit NcclTensorGroup(comm::NcclComm comm) : comm_(std::move(comm)) {
    rank = static_cast<std::size_t>(comm_.rank());
    size = static_cast<std::size_t>(comm_.size());
  }
  void sum(float* values, std::size_t count, cudaStream_t stream) override {
    comm_.all_reduce_async(values, count, comm::ReduceOp::sum, stream);
  }
  void gather(const float* mine, float* all, std::size_t count, cudaStream_t stream) override {
    comm_.all_gather_async(mine, all, count, stream);
  }

 private:
  comm::NcclComm comm_;
};

// TensorParallel's group where ranks share a GPU (NCCL refuses two ranks on
// one device): the host's tensor group, each call staged through host
// memory (comm::HostStagedComm) once the layer's stream has made its
// values. The stage runs no graph there (its links() turns capture off).
class StagedTensorGroup final : public DeviceTensorGroup {
 public:
  explicit StagedTensorGroup(comm::Comm comm) : comm_(std::move(comm)) {
    rank = static_cast<std::size_t>(comm_.rank());
    size = static_cast<std::size_t>(comm_.size());
  }
  void sum(float* values, std::size_t count, cudaStream_t stream) override {
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    comm_.all_reduce(std::span<float>(values, count), comm::ReduceOp::sum);
  }
  void gather(const float* mine, float* all, std::size_t count, cudaStream_t stream) override {
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    comm_.all_gather(std::span<const float>(mine, count), std::span<float>(all, count * size));
  }

 private:
  comm::Comm comm_;
};

// A stage: the layers `range` of StageNet's executed list on CUDA device
// `device`, with its slice of the whole network's weights and running
// statistics, updated by Optimizer's rule on the device.
template <class StageNet, class Optimizer>
class DeviceStage final : public ::loom::detail::PipelineStage {
  using Layers = DeviceLayers<StageNet>;
  using executed = typename StageNet::executed;
  using info = ::loom::detail::list_info<executed>;

 public:
  // synced_statistics: SyncBatchNorm sums its statistics over the stage's
  // copies (DataParallel's replicas), as the CPU's grid engine does only
  // there; elsewhere it normalises over the rank's samples.
  DeviceStage(std::span<const float> weights, std::span<const float> state,
              typename Optimizer::Options options, std::size_t offset, std::size_t state_at,
              LayerRange range, int device, Precision precision, bool allow_tf32,
              bool synced_statistics = false, bool graphs = true)
      : device_(entered(device)),
        precision_(precision),
        allow_tf32_(allow_tf32),
        synced_(synced_statistics && range_syncs(range)),
        capture_(graphs),
        optimizer_(device_optimizer(options)),
        range_(range),
        host_(range),
        update_(1, "a pipeline stage's update scalars"),
        memory_(device) {
    sends_ = range.first > 0;
    take_slice(host_, weights, state, offset, state_at);
  }
  DeviceStage(const DeviceStage&) = delete;
  DeviceStage& operator=(const DeviceStage&) = delete;
  // The links' copies and the stream's work end before the memory goes.
  ~DeviceStage() override {
    LOOM_CUDA_RELEASE(cudaSetDevice(device_));
    LOOM_CUDA_RELEASE(cudaStreamSynchronize(stream()));
  }

  void reserve(std::size_t micro_batch, std::size_t slots, bool receives) override {
    on_device();
    place_buckets();
    const bool sends = sends_ || receives;
    if (layers_ && micro_batch <= layers_->max_batch() && slots <= slot_count_ && sends == sends_)
      return;
    build(std::max(micro_batch, layers_ ? layers_->max_batch() : 1), std::max(slots, slot_count_),
          sends);
  }
  float* input_slot(std::size_t slot) override { return inputs_.at(slot).data(); }
  float* input_gradient() override { return layers().input_gradient(); }

  const float* forward(const float* input, std::size_t n, std::size_t slot,
                       const Pass& pass) override {
    on_device();
    Layers& l = built();
    float* x = inputs_.at(slot).data();
    // The first stage: the batch's samples, from the host.
    if (input != x) {
      l.check_input(input, n);
      copy_in(x, input, n * input_size);
    }
    l.set_frames(slot, pass.frames, n);
    if (pass.training && pass.frames != nullptr) l.check_training_frames(slot, n);
    if (pass.training && l.contextual())
      scalars_.copy(
          l.pass(slot),
          DevicePass{.seed = pass.seed, .step = pass.step, .first_sample = pass.first_sample},
          stream());
    l.bind(slot, x, pass.training);
    run_graph({false, slot, n, pass.training, l.frames_count(slot) > 0}, slot, n,
              [&] { l.forward(slot, x, n, pass.training); });
    slots_.at(slot) = {n, pass.first_sample};
    synchronize();
    return l.output(slot);
  }
  float* output_gradient() override { return layers().output_gradient(); }
  const std::int32_t* output_frames(std::size_t slot) const override {
    return layers_ ? layers_->output_frames(slot) : nullptr;
  }

  // A loss whose arithmetic is a softmax over classes against a label, a
  // sample's scores or each position's (LossOps::softmax_rows), runs on the
  // device (softmax_xent.cuh: the CPU's formulas, within ULPs): the labels
  // go over, three sums come back. Any other loss runs on the host
  // (LossOps, loss/loss.hpp) over the output copied back (CTC: a device
  // loss of its own is a later speed-up), and so do a batch of sequences
  // with lengths and a batch holding a label outside the classes (or an
  // ignored position's), so that its error is the CPU's, word for word.
  cpu::LossSums loss(const ::loom::detail::LossOps& ops, std::size_t slot, std::size_t n,
                     const Targets& targets, float scale, bool train) override {
    on_device();
    Layers& l = built();
    if (const std::size_t rows = ops.softmax_rows())
      if (const auto sums = device_softmax_loss(slot, n, rows, targets, scale, train))
        return *sums;
    const std::size_t count = n * output_size;
    const float* output = output_on_host(slot, n);
    float* gradient = train ? room(host_gradient_, count) : nullptr;
    const cpu::LossSums sums = ops.compute(output, n, targets, scale, gradient);
    if (train) {
      copy_async(l.output_gradient(), gradient, count, cudaMemcpyHostToDevice, stream());
      // Rounded as the CPU's emulation rounds its loss gradient (fp16: after the
      // scale, which `scale` carries).
      round_values(precision_, l.output_gradient(), count, stream());
      synchronize();
    }
    return sums;
  }

  NonFiniteSpot check_output(std::size_t slot, std::size_t n, bool first) override {
    if (::loom::detail::all_finite(output_on_host(slot, n), n * output_size)) return {};
    return find_nonfinite_output(slot, first);
  }

  // Without a hook (every backward but a step's last): the layers'
  // gradients are added into the step's accumulator at once, after the
  // whole backward (DeviceLayers overwrites its gradients).
  void backward(std::size_t slot, bool accumulate, float* input_gradient) override {
    on_device();
    Layers& l = built();
    check_input_gradient(input_gradient);
    const std::size_t n = slots_.at(slot).samples;
    run_graph({true, slot, n, accumulate, l.frames_count(slot) > 0}, slot, n, [&] {
      l.backward(slot, n);
      take_gradients(0, l.parameters(), accumulate);
    });
    synchronize();
  }
  // With a hook (the step's last backward, whose buckets the reducer thread
  // all-reduces over the stage's copies): each layer's block is added into
  // the accumulator as soon as the layer's backward is enqueued, and once
  // the stream has run it, done(i) hands its buckets over, so that their
  // all-reduce runs while the layers below still back-propagate. A layer's
  // block is final then: the bias gradient a Linear's DRELU_BGRAD epilogue
  // sums for the layer below lies in that layer's block, final at its own
  // done. The wait per layer costs the GPU the host's time to enqueue the
  // next layer.
  void backward(std::size_t slot, bool accumulate, float* input_gradient,
                const std::function<void(std::size_t)>& done) override {
    on_device();
    Layers& l = built();
    check_input_gradient(input_gradient);
    using layout = typename Layers::layout;
    const std::size_t base = layout::starts[range_.first];
    l.backward(slot, slots_.at(slot).samples, [&](std::size_t i) {
      const std::size_t layer = range_.first + i;
      take_gradients(layout::starts[layer] - base, layout::sizes[layer], accumulate);
      synchronize();
      done(i);
    });
    synchronize();
  }
  void update(float lr) override {
    on_device();
    Layers& l = built();
    ++steps_;
    // Clipping scaled the accumulator already (scale_gradients): no bound here.
    scalars_.copy(update_.data(), update_scalars(optimizer_, lr, steps_, 0.0f), stream());
    optimizer_update(optimizer_, l.params(), accumulator_.data(), l.moment(0), l.moment(1),
                     l.parameters(), update_.data(), nullptr, nullptr, stream());
    synchronize();
  }

  // The layers were planned for the maker's precision: another is refused.
  // A reduced precision's weights are rounded again from the master
  // weights (an update, a scatter or a load changed them).
  void set_precision(Precision precision) override {
    on_device();
    LOOM_CHECK(precision == precision_, owner(), " was made for ", precision_name(precision_),
               " and cannot run a ", precision_name(precision),
               " step or evaluation; make the stages with gpu::DeviceStages{.precision = ",
               precision_name(precision), "}");
    layers().round_weights();
    synchronize();
  }

  // Each layer's squares summed on the device, over its block of the
  // accumulator (the gaps are zeros) in chunks that as many blocks of
  // threads sum at once: only the chunks' sums come back, added per layer
  // in order (the same sums, to the last bit, on every policy but
  // TensorParallel; within rounding of the CPU's, which adds one value at a
  // time). TensorParallel's runs, which may cut a layer, are summed on the
  // host.
  void add_layer_squares(std::span<const std::size_t> starts,
                         std::span<double> squares) const override {
    if (!segments.empty()) {
      gradients_to_host();
      add_squares_of<StageNet>(host_.gradients(), range_, starts, squares);
      return;
    }
    on_device();
    built();
    if (!norm_planned_) plan_norm();
    const std::size_t chunks = norm_host_.size();
    if (chunks == 0) return;
    kernels::range_squares<<<static_cast<unsigned>(chunks), block_threads, 0, stream()>>>(
        accumulator_.data(), norm_bounds_.data(), norm_sums_.data());
    LOOM_CUDA_LAUNCH_CHECK("range_squares");
    copy_async(norm_host_.data(), norm_sums_.data(), chunks, cudaMemcpyDeviceToHost, stream());
    synchronize();
    // As detail::add_layer_squares places them: by the layer's first parameter.
    const double* sums = norm_host_.data();
    for (const NormLayer& layer : norm_layers_) {
      double sum = 0.0;
      for (std::size_t c = 0; c < layer.chunks; ++c) sum += *sums++;
      squares[static_cast<std::size_t>(std::ranges::lower_bound(starts, layer.offset) -
                                       starts.begin())] = sum;
    }
  }
  bool unscale(float loss_scale) override {
    scale(1.0f / loss_scale);
    return gradients_finite();
  }
  void scale_gradients(float factor) override { scale(factor); }
  void zero_gradients() override {
    on_device();
    built();
    LOOM_CUDA_CHECK(
        cudaMemsetAsync(accumulator_.data(), 0, accumulator_.size() * sizeof(float), stream()));
    synchronize();
  }

  std::span<float> parameters() override {
    Layers& l = layers();
    return {l.params(), l.parameters()};
  }
  std::span<float> gradients() override {
    layers();
    return {accumulator_.data(), accumulator_.size()};
  }
  std::span<float> state() override { return {layers().state(), state_size}; }

  void read(Buffer what, std::size_t b, std::span<float> host) override {
    on_device();
    check_host_slice(what, b, host.size());
    if (!layers_) {
      const auto mine = host_buffer(what, b);
      std::ranges::copy(mine, host.begin());
      return;
    }
    copy_buffer(what, b, host.data(), cudaMemcpyDeviceToHost);
  }
  void write(Buffer what, std::size_t b, std::span<const float> host) override {
    on_device();
    check_host_slice(what, b, host.size());
    if (!layers_) {
      std::ranges::copy(host, host_buffer(what, b).begin());
      return;
    }
    copy_buffer(what, b, const_cast<float*>(host.data()), cudaMemcpyHostToDevice);
  }

  // Weight tying's runs (PipelineStage): in the accumulator, at the
  // device layout's offsets.
  void read_gradients(std::size_t at, std::span<float> host) override {
    on_device();
    const float* run = accumulator_.data() + layers().device_offset(at, host.size());
    copy_async(host.data(), run, host.size(), cudaMemcpyDeviceToHost, stream());
    synchronize();
  }
  void write_gradients(std::size_t at, std::span<const float> host) override {
    on_device();
    float* run = accumulator_.data() + layers().device_offset(at, host.size());
    copy_async(run, host.data(), host.size(), cudaMemcpyHostToDevice, stream());
    synchronize();
  }
  void sum_gradients(std::size_t a, std::size_t b, std::size_t count) override {
    on_device();
    Layers& l = layers();
    float* first = accumulator_.data() + l.device_offset(a, count);
    float* second = accumulator_.data() + l.device_offset(b, count);
    kernels::sum_runs<<<grid_blocks(count), block_threads, 0, stream()>>>(first, second, count);
    LOOM_CUDA_LAUNCH_CHECK("sum_runs");
    synchronize();
  }

  void keep_state() override {
    on_device();
    layers().keep_state();
    synchronize();
  }
  void restore_state() override {
    on_device();
    layers().restore_state();
    synchronize();
  }

  // On the device, over the accumulator (its gaps are zeros): one flag
  // comes back. Where a value is not finite, find_nonfinite_gradient
  // copies them to the host to name it.
  bool gradients_finite() const override {
    on_device();
    built();
    const std::size_t count = accumulator_.size();
    if (count == 0) return true;
    LOOM_CUDA_CHECK(cudaMemsetAsync(found_.data(), 0, sizeof(int), stream()));
    kernels::find_nonfinite<<<grid_blocks(count), block_threads, 0, stream()>>>(
        accumulator_.data(), count, found_.data());
    LOOM_CUDA_LAUNCH_CHECK("find_nonfinite");
    int found = 0;
    LOOM_CUDA_CHECK(
        cudaMemcpyAsync(&found, found_.data(), sizeof found, cudaMemcpyDeviceToHost, stream()));
    synchronize();
    return found == 0;
  }

  // The CPU looks at every layer's output in turn; here only the slot's
  // input (with `input`), the weights layer by layer, then the range's
  // output (named as its last layer's) are looked at: the layers' own
  // outputs stay inside DeviceLayers.
  NonFiniteSpot find_nonfinite_output(std::size_t slot, bool input) override {
    on_device();
    const SlotUse& use = slots_.at(slot);
    if (use.samples == 0 || !layers_) return {};
    const auto look = [&](NonFiniteSpot::Where where, std::size_t layer, const float* values,
                          std::size_t per_sample) -> NonFiniteSpot {
      const std::size_t count = use.samples * per_sample;
      const std::size_t at = ::loom::detail::first_nonfinite(values, count);
      if (at == count) return {};
      return {where,           layer,      layer,
              at % per_sample, per_sample, use.first_sample + at / per_sample,
              values[at]};
    };
    if (input) {
      const float* x = to_host(inputs_.at(slot).data(), use.samples * input_size, host_input_);
      if (auto spot = look(NonFiniteSpot::Where::input, 0, x, input_size)) return spot;
    }
    layers_->copy_parameters(layers_->params(), host_.parameters().data(), cudaMemcpyDeviceToHost);
    synchronize();
    if (auto spot = host_.find_nonfinite_weight()) return spot;
    return look(NonFiniteSpot::Where::output, last_layer_index(range_),
                output_on_host(slot, use.samples), output_size);
  }
  NonFiniteSpot find_nonfinite_gradient() override {
    gradients_to_host();
    return host_.find_nonfinite_gradient();
  }

  // The input slots and the layers' outputs (their ReLU masks, saved
  // tensors and workspace are not counted).
  std::size_t arena_elements() const override {
    if (!layers_) return 0;
    std::size_t per_sample = 0;
    static_for<executed::size>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!L::in_place)
        if (i >= range_.first && i < range_.last) per_sample += L::output_shape::size;
    });
    std::size_t inputs = 0;
    for (const auto& buffer : inputs_) inputs += buffer.size();
    return inputs + slot_count_ * layers_->max_batch() * per_sample;
  }
  // As the CPU's optimizer counts them (SGD without momentum keeps none,
  // though the device update reads one).
  std::size_t optimizer_buffers() const override {
    const bool plain_sgd =
        optimizer_.rule == DeviceOptimizer::Rule::sgd && optimizer_.momentum == 0.0f;
    return plain_sgd ? 0 : optimizer_.buffers();
  }
  std::uint64_t optimizer_steps() const override { return steps_; }
  void set_optimizer_steps(std::uint64_t steps) override { steps_ = steps; }
  const ::loom::detail::MemorySpace& memory() const override { return memory_; }

  // NCCL where every rank of the grid has a GPU of its own, else the host
  // groups staged through host memory (see the file comment). Ranks that
  // share a GPU launch their kernels directly: one rank's capture would
  // share the device with the others' allocations and frees.
  ::loom::detail::StageLinks links(const MeshGroups& groups, const Mesh& mesh,
                                   std::size_t rank) override {
    on_device();
    if (!distinct_devices(groups.world)) {
      capture_ = false;
      if (mesh.tensor > 1)
        set_tensor(std::make_unique<StagedTensorGroup>(
            comm::Comm(comm::HostStagedComm(groups.tensor, device_))));
      return staged_links(groups, mesh.coordinates(rank).pipe);
    }
    return nccl_links(groups, mesh, rank);
  }

  // The forwards and backwards captured as graphs so far (for tests).
  std::size_t graphs() const { return graphs_ ? graphs_->graphs() : 0; }

  // The accumulated gradients into `host` (the range's slice of the
  // Model's order), for tests and the host-side checks.
  void read_gradients(std::span<float> host) const {
    on_device();
    built();
    LOOM_CHECK(host.size() == parameter_size, owner(), ": its gradients are ", parameter_size,
               " floats, not ", host.size());
    // Read only: the copy goes from the device.
    layers_->copy_parameters(const_cast<float*>(accumulator_.data()), host.data(),
                             cudaMemcpyDeviceToHost);
    synchronize();
  }

 private:
  struct SlotUse {
    std::size_t samples = 0;       // of its last forward
    std::size_t first_sample = 0;  // that forward's first, in the step's batch
  };
  // What a captured call depends on: backward (or forward), the slot, its
  // samples, accumulating (backward) or training (forward), lengths given.
  using GraphKey = std::tuple<bool, std::size_t, std::size_t, bool, bool>;

  // Enqueues work (a forward or backward of n samples in slot) directly or
  // through its graph (see the file comment). The plans are made first:
  // planning may run kernels, which a capture must not take.
  template <class Work>
  void run_graph(const GraphKey& key, std::size_t slot, std::size_t n, Work&& work) {
    layers_->prepare(n);
    if (!capture_ || (layers_->frames_count(slot) > 0 && Layers::lengths_on_host))
      work();
    else
      graphs_->run(key, stream(), [&](cudaStream_t) { work(); });
  }

  static int entered(int device) {
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    return device;
  }
  void on_device() const { LOOM_CUDA_CHECK(cudaSetDevice(device_)); }
  cudaStream_t stream() const { return context_.stream.get(); }
  void synchronize() const { context_.stream.synchronize(); }
  std::string owner() const {
    return "pipeline stage on cuda:" + std::to_string(device_) + " (executed layers " +
           std::to_string(range_.first) + " to " + std::to_string(range_.last - 1) + ")";
  }

  static bool range_syncs(LayerRange range) {
    bool syncs = false;
    static_for<executed::size>([&](auto i) {
      if constexpr (type_at_t<i, executed>::syncs)
        syncs = syncs || (i >= range.first && i < range.last);
    });
    return syncs;
  }

  static std::size_t last_layer_index(LayerRange range) {
    std::size_t index = 0;
    static_for<executed::size>([&](auto i) {
      if (i + 1 == range.last) index = type_at_t<i, executed>::index;
    });
    return index;
  }

  // The layers, built for one sample and slot if reserve() has not come yet
  // (the engine's start broadcasts the weights before any step).
  Layers& layers() {
    on_device();
    if (!layers_) build(1, std::max<std::size_t>(1, slot_count_), sends_);
    return *layers_;
  }
  Layers& built() const {
    LOOM_CHECK(layers_ != nullptr, owner(), ": reserve() comes before a pass");
    return *layers_;
  }

  // (Re)builds the layers for `batch` samples in `slots` slots, carrying
  // weights, optimizer buffers and running statistics over (the initial
  // ones from the host the first time); the accumulator is the stage's own
  // and stays.
  void build(std::size_t batch, std::size_t slots, bool sends) {
    auto made =
        std::make_unique<Layers>(context_, range_, batch, slots, optimizer_.buffers(), precision_,
                                 tensor_math(precision_, allow_tf32_), owner(), sends);
    const std::size_t total = made->parameters();
    if (layers_) {
      carry(made->params(), layers_->params(), total);
      for (std::size_t b = 0; b < optimizer_.buffers(); ++b)
        carry(made->moment(b), layers_->moment(b), total);
      carry(made->state(), layers_->state(), made->state_count());
      carry(made->kept_state(), layers_->kept_state(), made->state_count());
    } else {
      made->copy_parameters(made->params(), host_.parameters().data(), cudaMemcpyHostToDevice);
      made->copy_running_state(host_.state().data(), cudaMemcpyHostToDevice);
      for (std::size_t b = 0; b < pending_optimizer_.size(); ++b)
        if (!pending_optimizer_[b].empty())
          made->copy_parameters(made->moment(b), pending_optimizer_[b].data(),
                                cudaMemcpyHostToDevice);
      accumulator_ = DeviceBuffer<float>(total, owner() + "'s gradient accumulator");
      LOOM_CUDA_CHECK(cudaMemsetAsync(accumulator_.data(), 0, total * sizeof(float), stream()));
    }
    inputs_.resize(slots);
    for (auto& buffer : inputs_)
      if (buffer.size() < batch * input_size)
        buffer = DeviceBuffer<float>(batch * input_size, owner() + "'s input slot");
    slots_.resize(slots);
    made->set_replicas(statistics_.get());
    made->set_tensor(tensor_.get());
    synchronize();
    // The graphs captured the old layers' and slots' pointers.
    graphs_ = std::make_unique<StepGraphs<GraphKey>>();
    layers_ = std::move(made);
    pending_optimizer_.clear();
    slot_count_ = slots;
    sends_ = sends;
  }

  void set_tensor(std::unique_ptr<DeviceTensorGroup> tensor) {
    tensor_ = std::move(tensor);
    if (layers_) layers_->set_tensor(tensor_.get());
  }

  void check_input_gradient(const float* input_gradient) const {
    LOOM_CHECK(input_gradient == nullptr || input_gradient == layers_->input_gradient(), owner(),
               ": backward leaves its input's gradient in input_gradient(), not elsewhere");
  }
  // The layers' gradients [at, at + count) into the accumulator: added to
  // the step's earlier micro-batches', or in their place (enqueued).
  void take_gradients(std::size_t at, std::size_t count, bool accumulate) {
    if (count == 0) return;
    float* to = accumulator_.data() + at;
    const float* from = layers_->grads() + at;
    if (accumulate)
      add_into(to, from, count, stream());
    else
      carry(to, from, count);
  }

  void carry(float* to, const float* from, std::size_t count) {
    copy_async(to, from, count, cudaMemcpyDeviceToDevice, stream());
  }

  // The buckets (make_stage_of planned them on the Model's packed order,
  // after making the stage) onto the device's padded layout: each begins
  // at its lowest layer's block and ends where the layer after its highest
  // begins, so it spans the gaps (zeros) between them too.
  void place_buckets() {
    if (buckets_placed_) return;
    buckets_placed_ = true;
    using layout = typename Layers::layout;
    const std::size_t host_base = info::param_offsets[range_.first];
    const std::size_t base = layout::starts[range_.first];
    for (auto& bucket : buckets) {
      const std::size_t lowest = range_.first + bucket.ready_after;
      std::size_t after = lowest + 1;
      while (after < range_.last && info::param_offsets[after] - host_base != bucket.end) ++after;
      bucket.begin = layout::starts[lowest] - base;
      bucket.end = layout::starts[after] - base;
    }
  }

  void copy_in(float* device, const float* host, std::size_t count) {
    float* pinned = room(host_input_, count);
    std::copy_n(host, count, pinned);
    copy_async(device, pinned, count, cudaMemcpyHostToDevice, stream());
  }
  // count floats at `device` in `pinned` (waits).
  const float* to_host(const float* device, std::size_t count, PinnedBuffer<float>& pinned) const {
    float* host = room(pinned, count);
    copy_async(host, device, count, cudaMemcpyDeviceToHost, stream());
    synchronize();
    return host;
  }
  const float* output_on_host(std::size_t slot, std::size_t n) {
    on_device();
    return to_host(built().output(slot), n * output_size, host_output_);
  }
  // Pinned room for count values (grown, never shrunk).
  template <class T>
  static T* room(PinnedBuffer<T>& buffer, std::size_t count) {
    if (buffer.size() < count) buffer = PinnedBuffer<T>(count);
    return buffer.data();
  }

  // The softmax loss of slot's last forward on the device, over `rows`
  // rows per sample (1: the sample's scores against targets.labels; more:
  // each position's against targets.sequences), and with `train` its
  // gradient (times scale, as the host's), rounded for the precision;
  // nothing when the host must compute it (see loss()).
  std::optional<cpu::LossSums> device_softmax_loss(std::size_t slot, std::size_t n,
                                                   std::size_t rows, const Targets& targets,
                                                   float scale, bool train) {
    if (n == 0) return std::nullopt;  // a rank without samples: the host's empty sums
    // Positions past a sample's length count for nothing, and targets of
    // another shape get the loss's message: the host's.
    if (rows > 1 && (targets.frames != nullptr || targets.sequences == nullptr ||
                     targets.max_target != rows))
      return std::nullopt;
    Layers& l = *layers_;
    const std::size_t count = n * rows;
    if (!softmax_ || softmax_->max_batch() < count) {
      softmax_ = std::make_unique<SoftmaxXentWorkspace>(l.max_batch() * rows);
      labels_ = DeviceBuffer<std::int32_t>(l.max_batch() * rows, owner() + "'s labels");
    }
    std::copy_n(rows == 1 ? targets.labels : targets.sequences, count, room(host_labels_, count));
    copy_async(labels_.data(), host_labels_.data(), count, cudaMemcpyHostToDevice, stream());
    // The gradient is (softmax - one-hot) x scale: the kernel's global
    // batch of 1 and loss scale `scale` give that factor.
    scalars_.copy(loss_scale_.data(), scale, stream());
    softmax_xent_async(l.output(slot), labels_.data(), count, output_size / rows, 1,
                       train ? l.output_gradient() : nullptr, *softmax_, stream(),
                       loss_scale_.data());
    if (train) round_values(precision_, l.output_gradient(), n * output_size, stream());
    const SoftmaxXentSums back = read_sums(*softmax_, stream());
    if (back.bad_row != ~0ull) return std::nullopt;
    cpu::LossSums sums;
    sums.loss = back.loss;
    sums.correct = static_cast<std::size_t>(back.correct);
    sums.denominator = static_cast<double>(count);
    return sums;
  }

  void gradients_to_host() const { read_gradients(host_.gradients()); }

  // The clipping norm's layers (those with parameters, a tied copy left
  // out, as detail::add_layer_squares): each one's block of the device
  // layout cut into chunks, and where its parameters begin in the whole
  // network's.
  void plan_norm() const {
    using layout = typename Layers::layout;
    constexpr std::size_t chunk = std::size_t{1} << 16;  // floats a block of threads sums
    const std::size_t base = layout::starts[range_.first];
    std::vector<std::size_t> bounds;
    std::vector<NormLayer> layers;
    static_for<executed::size>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (L::param_count > 0 && !::loom::detail::TiesWeight<L>)
        if (i >= range_.first && i < range_.last) {
          NormLayer& layer = layers.emplace_back(NormLayer{
              parameter_offset + info::param_offsets[i] - info::param_offsets[range_.first], 0});
          for (std::size_t at = layout::starts[i]; at < layout::starts[i + 1]; at += chunk) {
            bounds.push_back(at - base);
            bounds.push_back(std::min<std::size_t>(at + chunk, layout::starts[i + 1]) - base);
            ++layer.chunks;
          }
        }
    });
    DeviceBuffer<std::size_t> device_bounds(bounds.size(), owner() + "'s clipping chunks");
    copy_async(device_bounds.data(), bounds.data(), bounds.size(), cudaMemcpyHostToDevice,
               stream());
    DeviceBuffer<double> sums(bounds.size() / 2, owner() + "'s clipping squares");
    PinnedBuffer<double> host(bounds.size() / 2);
    norm_bounds_ = std::move(device_bounds);
    norm_sums_ = std::move(sums);
    norm_host_ = std::move(host);
    norm_layers_ = std::move(layers);
    norm_planned_ = true;
  }

  void scale(float factor) {
    on_device();
    built();
    if (accumulator_.size() == 0) return;
    kernels::scale_values<<<grid_blocks(accumulator_.size()), block_threads, 0, stream()>>>(
        accumulator_.data(), accumulator_.size(), factor);
    LOOM_CUDA_LAUNCH_CHECK("scale_values");
    synchronize();
  }

  void check_host_slice(Buffer what, std::size_t b, std::size_t size) const {
    const std::size_t expected = what == Buffer::state ? state_size : parameter_size;
    LOOM_CHECK(size == expected, owner(), ": a host slice of ", size, " floats for one of ",
               expected);
    if (what == Buffer::optimizer)
      LOOM_CHECK(b < optimizer_buffers(), owner(), ": ", optimizer_.name(), " keeps ",
                 optimizer_buffers(), " buffer(s) per parameter, not ", b + 1);
  }
  // Before the layers are built: the host's copy.
  std::span<float> host_buffer(Buffer what, std::size_t b) {
    if (what == Buffer::parameters) return host_.parameters();
    if (what == Buffer::state) return host_.state();
    if (pending_optimizer_.size() <= b) pending_optimizer_.resize(b + 1);
    if (pending_optimizer_[b].empty()) pending_optimizer_[b].assign(parameter_size, 0.0f);
    return pending_optimizer_[b];
  }
  void copy_buffer(Buffer what, std::size_t b, float* host, cudaMemcpyKind kind) {
    switch (what) {
      case Buffer::parameters:
        layers_->copy_parameters(layers_->params(), host, kind);
        break;
      case Buffer::state:
        layers_->copy_running_state(host, kind);
        break;
      case Buffer::optimizer:
        layers_->copy_parameters(layers_->moment(b), host, kind);
        break;
    }
    synchronize();
  }

  // Whether every rank of `world` runs on a GPU of its own: each gives a
  // hash of its host name and its device's PCI bus id, and all compare.
  bool distinct_devices(comm::Comm world) const {
    char bus[32] = {};
    LOOM_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device_));
    char host[256] = {};
    LOOM_CHECK(gethostname(host, sizeof host - 1) == 0, owner(),
               ": gethostname failed, so its GPU cannot be told from the other ranks'");
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(world.size()), 0);
    ids[static_cast<std::size_t>(world.rank())] =
        ::loom::detail::fnv1a(std::string(host) + "/" + bus);
    world.all_reduce(std::span<std::uint64_t>(ids), comm::ReduceOp::sum);
    std::ranges::sort(ids);
    return std::ranges::adjacent_find(ids) == ids.end();
  }

  ::loom::detail::StageLinks staged_links(const MeshGroups& groups, std::size_t stage) const {
    LOOM_CHECK(!synced_, owner(), ": SyncBatchNorm sums its statistics over the replicas with "
               "NCCL, which needs a GPU per rank, and ranks here share one; give each replica a "
               "GPU of its own, or use BatchNorm");
    auto links = ::loom::detail::host_links(groups, stage);
    // One staged communicator per link: each has its staging buffers, and
    // the outbox threads and the rank's thread call them at once.
    for (auto* link : {&links.to_next, &links.from_next, &links.to_previous, &links.from_previous})
      if (link->comm) link->comm = comm::Comm(comm::HostStagedComm(link->comm, device_));
    if (links.data) links.data = comm::Comm(comm::HostStagedComm(links.data, device_));
    links.own = true;
    return links;
  }

  // An NCCL world over groups.world, split as detail::split_links splits
  // it (the stage's copies, and a communicator per direction and pair of
  // neighbouring stages), its parts not sharing resources
  // (NcclComm::set_share_on_split); and, for SyncBatchNorm, one more over
  // the stage's copies, which the layers' forward and backward sum on
  // their stream while the reducer's thread drives the data link. A
  // collective over groups.world.
  ::loom::detail::StageLinks nccl_links(const MeshGroups& groups, const Mesh& mesh,
                                        std::size_t rank) {
    comm::Comm bootstrap = groups.world;
    comm::NcclComm world = comm::NcclComm::create(bootstrap, device_);
    world.set_share_on_split(false);
    comm::NcclComm* statistics = nullptr;
    if (synced_) {
      statistics_ = std::make_unique<comm::NcclComm>(
          world.split(static_cast<int>(mesh.group(rank, MeshAxis::data)),
                      static_cast<int>(mesh.rank_in_group(rank, MeshAxis::data))));
      statistics = statistics_.get();
      if (layers_) layers_->set_replicas(statistics);
    }
    // TensorParallel's split layers' sums and gathers, over the rank's
    // tensor group (every rank splits: ncclCommSplit is a collective).
    std::optional<comm::NcclComm> tensor;
    if (mesh.tensor > 1) {
      tensor = world.split(static_cast<int>(mesh.group(rank, MeshAxis::tensor)),
                           static_cast<int>(mesh.rank_in_group(rank, MeshAxis::tensor)));
      set_tensor(std::make_unique<NcclTensorGroup>(*tensor));
    }
    auto links = ::loom::detail::split_links(comm::Comm(std::move(world)), mesh, rank);
    // Copies of the same communicators (NcclComm's state is shared): a
    // failing rank's cancel aborts them too, so no rank waits in its sums.
    if (statistics != nullptr) links.layers.push_back(comm::Comm(*statistics));
    if (tensor) links.layers.push_back(comm::Comm(*tensor));
    return links;
  }

  int device_;
  Precision precision_;
  bool allow_tf32_;
  bool synced_;  // SyncBatchNorm in the range sums over the stage's copies
  bool capture_;  // forwards and backwards run as CUDA graphs (not where ranks share the GPU)
  DeviceOptimizer optimizer_;
  LayerRange range_;
  DeviceContext context_;  // made with device_ current; before the layers, which use it
  // The range on the host: the weights and statistics until the layers
  // are built, then where the host's checks read the device's.
  mutable Model<StageNet, float> host_;
  std::vector<std::vector<float>> pending_optimizer_;  // written before the layers were built
  std::unique_ptr<Layers> layers_;
  // Declared after the layers: destroyed first (each graph holds their pointers).
  std::unique_ptr<StepGraphs<GraphKey>> graphs_;
  std::size_t slot_count_ = 0;
  bool sends_ = false;  // the layers pass their input's gradient back
  bool buckets_placed_ = false;
  DeviceBuffer<float> accumulator_;          // the step's micro-batches' gradients, summed
  std::vector<DeviceBuffer<float>> inputs_;  // per slot
  std::vector<SlotUse> slots_;
  DeviceBuffer<UpdateScalars> update_;
  std::uint64_t steps_ = 0;  // optimizer steps taken
  mutable PinnedBuffer<float> host_input_, host_output_, host_gradient_;
  // The device softmax loss's workspace and labels.
  std::unique_ptr<SoftmaxXentWorkspace> softmax_;
  DeviceBuffer<std::int32_t> labels_;
  DeviceBuffer<float> loss_scale_{1, "a stage's loss gradient scale"};
  mutable DeviceBuffer<int> found_{1, "a stage's non-finite gradient flag"};
  // The clipping norm's layers and their chunks (plan_norm).
  struct NormLayer {
    std::size_t offset = 0;  // its first parameter's in the whole network
    std::size_t chunks = 0;
  };
  mutable bool norm_planned_ = false;
  mutable std::vector<NormLayer> norm_layers_;
  mutable DeviceBuffer<std::size_t> norm_bounds_;
  mutable DeviceBuffer<double> norm_sums_;
  mutable PinnedBuffer<double> norm_host_;
  PinnedBuffer<std::int32_t> host_labels_;
  ScalarStager scalars_;
  DeviceMemory memory_;
  // SyncBatchNorm's sums over the stage's copies (synced_ on NCCL links),
  // and TensorParallel's group (tensor_: NCCL's, or staged where ranks share
  // the GPU; null without a split); declared last, so destroyed first,
  // before the layers' stream they are used on.
  std::unique_ptr<comm::NcclComm> statistics_;
  std::unique_ptr<DeviceTensorGroup> tensor_;
};

// The GPU's stages, for a policy's typed engine (as detail::HostStages
// makes the CPU's): every stage in `precision`, TF32 as allowed.
struct DeviceStages {
  Precision precision = Precision::fp32;
  bool allow_tf32 = false;
  // DataParallel's: SyncBatchNorm sums over the replicas (see DeviceStage).
  bool synced_statistics = false;
  // Forwards and backwards replayed from CUDA graphs (off: launched
  // directly, for debugging and to compare).
  bool graphs = true;

  template <class StageNet, class Optimizer>
  std::unique_ptr<::loom::detail::PipelineStage> make(std::span<const float> weights,
                                                      std::span<const float> state,
                                                      typename Optimizer::Options options,
                                                      std::size_t offset, std::size_t state_at,
                                                      LayerRange range,
                                                      const Device& device) const {
    LOOM_CHECK(device.kind == Device::Kind::cuda, "gpu::DeviceStages makes stages on GPUs; ",
               device.name(), " is not one (the CPU's stages are detail::HostStages)");
    return std::make_unique<DeviceStage<StageNet, Optimizer>>(
        weights, state, options, offset, state_at, range, device.index, precision, allow_tf32,
        synced_statistics, graphs);
  }
};

}  // namespace loom::gpu
