// The grid engine of the CPU's policies: SingleDevice, DataParallel,
// ModelSplit and Hybrid are meshes of R replicas x S stages of one network
// (mesh.hpp: data x pipe, the tensor axis 1), run by one engine written
// once, without the network's type. Rank w of the mesh is replica w / S,
// stage w % S (Mesh::coordinates); its stage (a type-erased PipelineStage,
// made by the policy's typed engine: data_parallel.hpp, model_split.hpp)
// runs on a worker thread of its own (devices::cpu(n), ranks of a
// LocalComm), or is this MPI process's one rank (MpiComm). Each rank talks
// over its mesh groups: activations and gradients along the pipe axis,
// gradient buckets along the data axis, loss totals and agreement over the
// world.
//
// Exactness: every micro-batch's loss gradient is scaled by 1/(global
// batch), and each stage adds its micro-batches' gradients, so a step's
// gradient is the batch mean, as on one device; a rank with no samples adds
// zeros. A loss whose mean is over something else (Denominator::positions)
// has its gradients summed unscaled and divided, on every rank, by the
// step's denominator summed over its batches and the grid before the step's
// update (see train()). The copies of a stage take copy 0's weights at the start and its
// running statistics before each step (as PyTorch's
// DistributedDataParallel broadcasts its buffers).
//
// Overlap: the step's last backward hands each gradient bucket (slices of
// the stage's flat gradient buffer in reverse layer order) to the rank's
// communication thread as soon as its lowest layer is done, so its
// all-reduce over the stage's copies runs while the layers before it are
// still back-propagating; a stage never waits to send an activation or
// gradient (see Outbox), only to receive what its next pass needs.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../comm/local_comm.hpp"
#include "../comm/mixed_comm.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../core/linkage.hpp"
#include "../core/stop_signals.hpp"
#include "../data/dataset.hpp"
#include "../loss/loss.hpp"
#include "../net/model.hpp"
#include "../optim/clip.hpp"
#include "../optim/loss_scaler.hpp"
#include "buckets.hpp"
#include "crew.hpp"
#include "mesh.hpp"
#include "reducer.hpp"
#include "schedule.hpp"
#include "split_engine.hpp"
#include "step_protocol.hpp"

#if defined(LOOM_WITH_MPI)
#include <mpi.h>
#endif

namespace loom {

// 64 KiB, measured (benchmarks/data_parallel_bench, LeNet, batch 256, 2
// workers; benchmarks/RESULTS.md): LeNet's gradients go in three buckets
// (both Linears, conv2, conv1) and 96-97 % of the all-reduce time is hidden
// under backward, against 84-91 % with 1 MiB (two buckets: conv2 waits for
// the end) and 0 % with 4 MiB (one bucket), at the same step time.
inline constexpr std::size_t default_bucket_bytes = std::size_t{64} << 10;

// The samples of a global batch of n that rank r of `ranks` takes:
// contiguous, and the first n % ranks ranks take one more than the others.
struct BatchShare {
  std::size_t first = 0;
  std::size_t count = 0;
};
constexpr BatchShare batch_share(std::size_t n, std::size_t ranks, std::size_t rank) {
  const std::size_t base = n / ranks, extra = n % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

// What a rank of the grid measured in its last step (the CPU's engines).
struct StageReport {
  std::size_t stage = 0;
  std::size_t replica = 0;              // which copy of the stage (0 for ModelSplit)
  std::size_t tensor = 0;               // which share of its split layers (TensorParallel)
  std::size_t peak_in_flight = 0;       // since the engine started
  std::size_t activation_elements = 0;  // held now: Model's arena plus kept inputs
  double busy_seconds = 0.0;            // forward, loss and backward passes, last step
  std::chrono::steady_clock::time_point begin, end;  // the last step's passes
  // The last step's last backward (the one that posts the buckets).
  std::chrono::steady_clock::time_point backward_begin, backward_end;
  // With several replicas: when each gradient bucket went to the rank's
  // communication thread in the last step, and when its all-reduce over
  // the stage's copies began and ended (empty with one replica).
  std::vector<std::chrono::steady_clock::time_point> reduce_posted, reduce_begin, reduce_end;
};

// What a policy's engine takes at run time: the replica and stage counts,
// schedule and bucket size are values, so ModelSplit and every Hybrid grid
// over one partition share one engine type (DataParallel's is a grid of one
// stage).
struct PipelineGrid {
  const char* policy = "ModelSplit";  // its name, for messages (a literal: it outlives the trainer)
  std::string identity;               // its type, which every process must share
  std::size_t replicas = 1;
  std::size_t stages = 1;  // one of the partition's stage counts
  std::size_t tensor = 1;  // TensorParallel: the ranks that split each stage's layers
  std::size_t bucket_bytes = default_bucket_bytes;  // several replicas: gradient buckets
  PipelineSchedule schedule{PipelineKind::one_f_one_b, 4};  // the policy's own
};

namespace detail {

// Every rank of `c` checks that all run the same network, policy and
// optimizer (`identity`, their type names and what the policy fixes at run
// time), before any other collective: ranks built from different programs
// get this error, not a hang.
inline void check_same_program(comm::Comm& c, const std::string& identity,
                               std::size_t parameter_count) {
  const auto ranks = static_cast<std::size_t>(c.size());
  std::vector<std::uint64_t> hashes(ranks, 0);
  const std::uint64_t mine = fnv1a(identity, parameter_count);
  hashes[static_cast<std::size_t>(c.rank())] = mine;
  c.all_reduce(std::span<std::uint64_t>(hashes), comm::ReduceOp::sum);
  for (std::size_t r = 0; r < ranks; ++r)
    LOOM_CHECK(hashes[r] == mine, "rank ", r, " of ", ranks,
               " trains a different network, policy or optimizer than rank ", c.rank(),
               " (identity hash ", hashes[r], " vs ", mine, "); rank ", c.rank(), " runs ",
               identity, ". Start every rank from the same program");
}

// A step's loss sums as the engines keep them (Rank::stats), for the caller.
template <std::size_t N>
cpu::LossSums loss_sums(const std::array<double, N>& stats) {
  return {.loss = stats[0],
          .correct = static_cast<std::size_t>(stats[1]),
          .errors = stats[2],
          .references = stats[3],
          .denominator = stats[5]};
}

// The memory a stage's buffers live in: the host's (the CPU's stages) or a
// GPU's. An Outbox keeps a message in it until the message is sent.
class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  virtual std::shared_ptr<float[]> allocate(std::size_t n) const = 0;
  // Copies n floats, `from` as the stage's last call left them.
  virtual void copy(float* to, const float* from, std::size_t n) const = 0;
};

class HostMemory final : public MemorySpace {
 public:
  std::shared_ptr<float[]> allocate(std::size_t n) const override {
    return std::make_shared<float[]>(n);
  }
  void copy(float* to, const float* from, std::size_t n) const override {
    std::copy_n(from, n, to);
  }
};

// One direction between a stage and a neighbour: the communicator and the
// neighbour's rank in it.
struct Link {
  comm::Comm comm;
  int peer = 0;
};

// What a rank moves its stage's memory over: activations and gradients to
// and from its neighbours in the pipeline, and gradient buckets and weights
// over the stage's copies (the data axis). The CPU's are the rank's mesh
// groups (host_links); a GPU stage makes its own (NCCL, or staged through
// the host groups where ranks share a GPU). Loss sums, agreement and
// checkpoints go over the host groups whatever the stage's memory.
struct StageLinks {
  Link to_next, from_next, to_previous, from_previous;
  comm::Comm data;
  // Communicators the stage's layers call on their own (a GPU's
  // SyncBatchNorm sums over its copies, TensorParallel's over its tensor
  // group): the engine only cancels them.
  std::vector<comm::Comm> layers;
  // Made by the stage: their sends may wait for the receive (NCCL's), as
  // MPI's do, so the outboxes send from threads of their own.
  bool own = false;
};

// The mesh groups themselves, for stage `stage` of a pipeline.
inline StageLinks host_links(const MeshGroups& groups, std::size_t stage) {
  const int previous = static_cast<int>(stage) - 1, next = static_cast<int>(stage) + 1;
  return {.to_next = {groups.pipe, next},
          .from_next = {groups.pipe, next},
          .to_previous = {groups.pipe, previous},
          .from_previous = {groups.pipe, previous},
          .data = groups.data,
          .layers = {}};
}

// Links of a stage's own, split from `world` (a communicator over every rank
// of the mesh that carries the stage's memory: NCCL's, say): the stage's
// copies (data), and for each direction between neighbouring stages a
// communicator of that pair alone, so that a rank's outbox thread, which
// sends, and its own thread, which receives, never share one (an NCCL
// communicator takes calls from one thread at a time, in the same order on
// every rank). A collective over `world`.
inline StageLinks split_links(comm::Comm world, const Mesh& mesh, std::size_t rank) {
  const auto group = [&](MeshAxis axis) {
    return world.split(static_cast<int>(mesh.group(rank, axis)),
                       static_cast<int>(mesh.rank_in_group(rank, axis)));
  };
  comm::Comm data = group(MeshAxis::data);
  comm::Comm pipe = group(MeshAxis::pipe);
  // Pairs (0, 1), (2, 3), ... (shift 0) and (1, 2), (3, 4), ... (shift 1):
  // every rank is in one of each (alone at an end), ranked by stage, and
  // each is split twice, once per direction.
  const std::size_t stage = mesh.coordinates(rank).pipe;
  const auto pair = [&](std::size_t shift) {
    return pipe.split(static_cast<int>((stage + shift) / 2), static_cast<int>(stage));
  };
  comm::Comm forward0 = pair(0), backward0 = pair(0), forward1 = pair(1), backward1 = pair(1);
  // An even stage's pair with the next is of shift 0, with the previous of
  // shift 1; an odd stage's the other way round. The lower stage is rank 0.
  const bool even = stage % 2 == 0;
  return {.to_next = {even ? forward0 : forward1, 1},
          .from_next = {even ? backward0 : backward1, 1},
          .to_previous = {even ? backward1 : backward0, 0},
          .from_previous = {even ? forward1 : forward0, 0},
          .data = std::move(data),
          .layers = {},
          .own = true};
}

// A run of a tensor-parallel rank's parameters in the whole network's:
// `count` of them at `whole` there, at `local` in the rank's own. A split
// run is this rank's alone; a run that is not is held by every rank of the
// tensor group, equal (the rank at tensor coordinate 0 speaks for it).
struct ParamSegment {
  std::size_t whole = 0, local = 0, count = 0;
  bool split = false;
  bool tied_copy = false;  // a TiedLinear's copy: left out of the clipping norm
};

// A TensorParallel rank's part of the clipping norm's squares per layer
// (`starts`: the whole network's layers' first parameters): its split runs
// on every rank, the runs its tensor group holds alike on tensor rank 0
// alone, a tied copy on none (its source counts). `grads`: the rank's own,
// at the runs' `local` offsets.
inline void add_segment_squares(std::span<const float> grads, std::span<const ParamSegment> runs,
                                std::size_t tensor_rank, std::span<const std::size_t> starts,
                                std::span<double> squares) {
  for (const ParamSegment& s : runs) {
    if ((!s.split && tensor_rank != 0) || s.tied_copy) continue;
    const auto layer = std::ranges::upper_bound(starts, s.whole) - starts.begin() - 1;
    double sum = 0.0;
    for (std::size_t j = s.local; j < s.local + s.count; ++j)
      sum += static_cast<double>(grads[j]) * static_cast<double>(grads[j]);
    squares[static_cast<std::size_t>(layer)] += sum;
  }
}

// A rank's own parameters (or optimizer buffer), cut by its runs from the
// whole network's.
inline void cut_own(std::span<const ParamSegment> runs, const float* whole, std::span<float> own) {
  for (const ParamSegment& s : runs)
    std::copy_n(whole + s.whole, s.count, own.begin() + static_cast<std::ptrdiff_t>(s.local));
}

// One stage's network and optimizer state behind a type-erased face, so the
// engine's code is written once for stages of different types and
// backends. Buffers handed out as pointers or spans are in the stage's
// memory (memory(): the host's, or its GPU's), for its links; the engine
// reads and writes them on the host only through read() and write(). A
// call returns with its work done (a GPU stage waits for its stream).
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Room for micro-batches of up to `micro_batch` samples, `slots` at
  // once; `receives`: the stage takes its input from the stage before
  // (input_slot, input_gradient).
  virtual void reserve(std::size_t micro_batch, std::size_t slots, bool receives) = 0;
  // Where slot's input from the stage before is received.
  virtual float* input_slot(std::size_t slot) = 0;
  // Where backward leaves the gradient of the stage's input.
  virtual float* input_gradient() = 0;
  // input: the batch's samples in host memory (the first stage) or
  // input_slot(slot). Returns the slot's output.
  virtual const float* forward(const float* input, std::size_t n, std::size_t slot,
                               const Pass& pass) = 0;
  virtual float* output_gradient() = 0;
  // Sequences: the samples' lengths at the stage's output for the slot's
  // last forward (host memory), or null when its pass gave none.
  virtual const std::int32_t* output_frames(std::size_t slot) const = 0;
  // The last stage: the loss of slot's last forward (n samples), and with
  // `train` its gradient, scaled by `scale`, into output_gradient().
  virtual cpu::LossSums loss(const LossOps& ops, std::size_t slot, std::size_t n,
                             const Targets& targets, float scale, bool train) = 0;
  // Where slot's last forward output (n samples) is first non-finite, if it is.
  virtual NonFiniteSpot check_output(std::size_t slot, std::size_t n, bool first) = 0;
  // input_gradient: input_gradient(), or null (the first stage).
  virtual void backward(std::size_t slot, bool accumulate, float* input_gradient) = 0;
  // The same, calling done(i) as each executed layer's gradients become final.
  virtual void backward(std::size_t slot, bool accumulate, float* input_gradient,
                        const std::function<void(std::size_t)>& done) = 0;
  virtual void update(float lr) = 0;
  // Before a step's or an evaluation's first forward.
  virtual void set_precision(Precision precision) = 0;
  // Its layers' squared gradient norms into their entries of the whole
  // network's (see optim/clip.hpp).
  virtual void add_layer_squares(std::span<const std::size_t> starts,
                                 std::span<double> squares) const = 0;
  // Divides the gradients by the loss scale; whether all are finite.
  virtual bool unscale(float loss_scale) = 0;
  virtual void scale_gradients(float factor) = 0;
  virtual void zero_gradients() = 0;
  // In the stage's memory, for its links (a GPU's may hold gaps).
  virtual std::span<float> parameters() = 0;
  virtual std::span<float> gradients() = 0;
  virtual std::span<float> state() = 0;
  // The stage's slice of the whole network's weights, running statistics or
  // optimizer buffer `b` (in the Model's order: parameter_size or
  // state_size floats), to or from the host.
  enum class Buffer { parameters, state, optimizer };
  virtual void read(Buffer what, std::size_t b, std::span<float> host) = 0;
  virtual void write(Buffer what, std::size_t b, std::span<const float> host) = 0;
  virtual void keep_state() = 0;
  virtual void restore_state() = 0;
  // Weight tying: gradients at the stage's offsets `at` (its slice of the
  // Model's order; a run within one layer's weights), to or from the host,
  // or the runs at `a` and `b` both set to a + b (in that order).
  virtual void read_gradients(std::size_t at, std::span<float> host) {
    std::ranges::copy(gradients().subspan(at, host.size()), host.begin());
  }
  virtual void write_gradients(std::size_t at, std::span<const float> host) {
    std::ranges::copy(host, gradients().subspan(at, host.size()).begin());
  }
  virtual void sum_gradients(std::size_t a, std::size_t b, std::size_t count) {
    float* g = gradients().data();
    for (std::size_t k = 0; k < count; ++k) g[b + k] = g[a + k] = g[a + k] + g[b + k];
  }
  // A non-finite step's diagnosis (see Model).
  virtual bool gradients_finite() const = 0;
  virtual NonFiniteSpot find_nonfinite_output(std::size_t slot, bool input) = 0;
  virtual NonFiniteSpot find_nonfinite_gradient() = 0;
  // Activations held now: the layers' and the input slots'.
  virtual std::size_t arena_elements() const = 0;
  // The optimizer's per-parameter buffers (momentum, moments) and step count.
  virtual std::size_t optimizer_buffers() const = 0;
  virtual std::uint64_t optimizer_steps() const = 0;
  virtual void set_optimizer_steps(std::uint64_t steps) = 0;
  virtual const MemorySpace& memory() const = 0;
  // This rank's links, from its mesh groups (a collective over
  // groups.world where a stage makes communicators of its own).
  virtual StageLinks links(const MeshGroups& groups, const Mesh& mesh, std::size_t rank) {
    return host_links(groups, mesh.coordinates(rank).pipe);
  }
  std::size_t input_size = 0, output_size = 0;
  // Where its slices start in the whole network's buffers, and their sizes.
  std::size_t parameter_offset = 0, state_offset = 0, parameter_size = 0, state_size = 0;
  // TensorParallel: where its parameters (parameter_size of them) lie in
  // the whole network's, which are then no one slice; empty otherwise.
  std::vector<ParamSegment> segments;
  std::size_t tensor_rank = 0;  // its coordinate on the mesh's tensor axis
  std::vector<GradientBucket> buckets;  // the stage's gradients, reduced over its copies

 protected:
  // Where its slice lies (`offset`, `state_at`) and its sizes, from the
  // range's host Model, which takes the slice's initial weights and
  // running statistics.
  template <class StageNet>
  void take_slice(Model<StageNet, float>& model, std::span<const float> weights,
                  std::span<const float> state, std::size_t offset, std::size_t state_at) {
    input_size = model.range_input_size();
    output_size = model.range_output_size();
    parameter_offset = offset;
    state_offset = state_at;
    parameter_size = model.parameters().size();
    state_size = model.state().size();
    LOOM_CHECK(weights.size() == parameter_size && state.size() == state_size,
               "a pipeline stage given ", weights.size(), " weights and ", state.size(),
               " running statistics for its ", parameter_size, " and ", state_size);
    std::ranges::copy(weights, model.parameters().begin());
    std::ranges::copy(state, model.state().begin());
  }
  // add_layer_squares over `grads`, the stage's gradients in the Model's
  // order (host memory), of its layers `range` of StageNet.
  template <class StageNet>
  void add_squares_of(std::span<const float> grads, LayerRange range,
                      std::span<const std::size_t> starts, std::span<double> squares) const {
    if (!segments.empty())
      add_segment_squares(grads, segments, tensor_rank, starts, squares);
    else
      detail::add_layer_squares<StageNet>(grads, parameter_offset, starts, squares, range);
  }
};

// A stage: the layers `range` of StageNet's executed list (all of them, or
// a pipeline stage's share of the whole network's, whose cuts fall between
// executed layers: then every stage of every cut is one type), with its
// slice of the network's weights and running statistics.
template <class StageNet, class Optimizer>
class StageOf : public PipelineStage {
 public:
  StageOf(std::span<const float> weights, std::span<const float> state,
          typename Optimizer::Options options, std::size_t offset, std::size_t state_at,
          LayerRange range)
      : model_(range), optimizer_(options, model_.parameters().size()) {
    take_slice(model_, weights, state, offset, state_at);
  }
  void reserve(std::size_t micro_batch, std::size_t slots, bool receives) override {
    model_.reserve(micro_batch, slots);
    // Only ever grown: a step allocates nothing once its sizes were seen.
    if (slots > outputs_.size()) outputs_.resize(slots);
    if (slots > inputs_.size()) inputs_.resize(slots);
    const std::size_t inputs = receives ? micro_batch * input_size : 0;
    for (auto& buffer : inputs_)
      if (buffer.size() < inputs) buffer.resize(inputs);
    if (input_gradient_.size() < inputs) input_gradient_.resize(inputs);
  }
  float* input_slot(std::size_t slot) override { return inputs_.at(slot).data(); }
  float* input_gradient() override { return input_gradient_.data(); }
  const float* forward(const float* input, std::size_t n, std::size_t slot,
                       const Pass& pass) override {
    return outputs_.at(slot) = model_.forward(input, n, slot, pass);
  }
  float* output_gradient() override { return model_.output_gradient(); }
  const std::int32_t* output_frames(std::size_t slot) const override {
    return model_.output_frames(slot);
  }
  cpu::LossSums loss(const LossOps& ops, std::size_t slot, std::size_t n, const Targets& targets,
                     float scale, bool train) override {
    return ops.compute(outputs_.at(slot), n, targets, scale,
                       train ? model_.output_gradient() : nullptr);
  }
  NonFiniteSpot check_output(std::size_t slot, std::size_t n, bool first) override {
    if (all_finite(outputs_.at(slot), n * output_size)) return {};
    return model_.find_nonfinite_output(slot, first);
  }
  void backward(std::size_t slot, bool accumulate, float* input_gradient) override {
    // Through the overload below: each stage's network compiles one
    // backward, not two (a call per layer is all the no-op costs).
    static const std::function<void(std::size_t)> nothing = [](std::size_t) {};
    model_.backward(slot, accumulate, input_gradient, nothing);
  }
  void backward(std::size_t slot, bool accumulate, float* input_gradient,
                const std::function<void(std::size_t)>& done) override {
    model_.backward(slot, accumulate, input_gradient, done);
  }
  void update(float lr) override {
    if (optimizer_.options().lr != lr) optimizer_.set_lr(lr);
    optimizer_.step(model_.parameters(), model_.gradients());
  }
  void set_precision(Precision precision) override { model_.set_precision(precision); }
  void add_layer_squares(std::span<const std::size_t> starts,
                         std::span<double> squares) const override {
    add_squares_of<StageNet>(model_.gradients(), model_.range(), starts, squares);
  }
  bool unscale(float loss_scale) override {
    return unscale_gradients(model_.gradients(), loss_scale);
  }
  void scale_gradients(float factor) override {
    for (float& g : model_.gradients()) g *= factor;
  }
  void zero_gradients() override { std::ranges::fill(model_.gradients(), 0.0f); }
  std::span<float> parameters() override { return model_.parameters(); }
  std::span<float> gradients() override { return model_.gradients(); }
  std::span<float> state() override { return model_.state(); }
  void read(Buffer what, std::size_t b, std::span<float> host) override {
    const auto mine = buffer(what, b);
    std::copy(mine.begin(), mine.end(), host.begin());
  }
  void write(Buffer what, std::size_t b, std::span<const float> host) override {
    std::copy(host.begin(), host.end(), buffer(what, b).begin());
  }
  Model<StageNet, float>& model() { return model_; }
  const Model<StageNet, float>& model() const { return model_; }
  typename Optimizer::template State<float>& optimizer() { return optimizer_; }
  void keep_state() override { model_.keep_state(); }
  void restore_state() override { model_.restore_state(); }
  bool gradients_finite() const override { return model_.gradients_finite(); }
  NonFiniteSpot find_nonfinite_output(std::size_t slot, bool input) override {
    return model_.find_nonfinite_output(slot, input);
  }
  NonFiniteSpot find_nonfinite_gradient() override { return model_.find_nonfinite_gradient(); }
  std::size_t arena_elements() const override {
    std::size_t inputs = 0;
    for (const auto& buffer : inputs_) inputs += buffer.size();
    return model_.arena_elements() + inputs;
  }
  std::size_t optimizer_buffers() const override { return optimizer_.buffer_count(); }
  std::uint64_t optimizer_steps() const override { return optimizer_.steps(); }
  void set_optimizer_steps(std::uint64_t steps) override { optimizer_.set_steps(steps); }
  const MemorySpace& memory() const override {
    static const HostMemory host;
    return host;
  }

 private:
  std::span<float> buffer(Buffer what, std::size_t b) {
    switch (what) {
      case Buffer::parameters:
        return model_.parameters();
      case Buffer::state:
        return model_.state();
      case Buffer::optimizer:
        break;
    }
    return optimizer_.buffer(b);
  }

  Model<StageNet, float> model_;
  typename Optimizer::template State<float> optimizer_;
  std::vector<std::vector<float>> inputs_;  // per slot: the received activations
  std::vector<float> input_gradient_;       // the backward's, for the stage before
  std::vector<const float*> outputs_;       // per slot: the last forward's output
};

// Sends a stage's messages to one neighbour without making the stage wait:
// on a communicator whose sends are buffered (LocalComm) straight from the
// calling thread; otherwise (MPI, whose large sends wait for the matching
// receive, and NCCL) from a thread of its own, in the order sent, the data
// copied first into a reused buffer of the stage's memory.
class Outbox {
 public:
  Outbox(Link link, const MemorySpace& memory, bool threaded)
      : comm_(std::move(link.comm)), peer_(link.peer), memory_(memory) {
    if (threaded) thread_ = start_quiet_thread("loom-outbox", [this] { run(); });
  }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;
  ~Outbox() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void send(std::span<const float> data);

  // Waits until everything posted is sent; raises the send's error if one failed.
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return sent_ == posted_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  struct Message {
    std::shared_ptr<float[]> data;
    std::size_t capacity = 0, size = 0;
  };

  void run();

  comm::Comm comm_;
  int peer_;
  const MemorySpace& memory_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Message> queue_;
  std::vector<Message> free_;
  std::size_t posted_ = 0, sent_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

// What the grid engine knows of the network, from the policy's typed engine.
struct GridNet {
  std::string network, optimizer;  // type names, for the processes' identity check
  std::size_t parameter_count = 0, state_count = 0;
  std::size_t input_size = 0;  // per sample
  const LossOps* loss = nullptr;  // the trainer's (loss/loss.hpp)
  std::size_t stages = 1;
  // Where each layer with parameters begins in the flat buffer (clipping's
  // per-layer norms, summed over the stages).
  std::span<const std::size_t> norm_segments;
  // SyncBatchNorm (one stage only: DataParallel): its statistics are
  // summed over the replicas, on a communicator of their own.
  bool syncs = false;
  // Weights held twice (TiedLinear), in whole-network offsets: their
  // gradients are summed into both before every update.
  std::span<const TieRun> ties;
};

// Makes the stage of the rank at `at` (its stage on the pipe axis, its share
// on the tensor axis) on its device, with its part of the initial weights.
using StageMaker =
    std::function<std::unique_ptr<PipelineStage>(MeshCoordinates at, const Device& device)>;

// The CPU's stages (StageOf). A backend's stage type comes in a maker like
// this one (gpu::DeviceStages), which a policy's typed engine takes.
struct HostStages {
  template <class StageNet, class Optimizer>
  std::unique_ptr<PipelineStage> make(std::span<const float> weights, std::span<const float> state,
                                      typename Optimizer::Options options, std::size_t offset,
                                      std::size_t state_at, LayerRange range,
                                      const Device&) const {
    return std::make_unique<StageOf<StageNet, Optimizer>>(weights, state, options, offset,
                                                          state_at, range);
  }
};

template <class Net, class Optimizer, class Loss>
GridNet grid_net(std::size_t stages, bool syncs) {
  return {.network = type_label<Net>() + " trained with " + Loss::name,
          .optimizer = type_label<Optimizer>(),
          .parameter_count = Net::parameter_count,
          .state_count = Net::state_count,
          .input_size = Net::input_shape::size,
          .loss = &loss_ops<Loss, typename Net::output_shape>(),
          .stages = stages,
          .norm_segments = norm_segments<Net>,
          .syncs = syncs,
          .ties = std::span<const TieRun>(Net::ties)};
}

// A stage of the executed layers `range` of StageNet (all by default) from
// the whole network's weights and running statistics (`initial`), its
// gradients in buckets of about `bucket_bytes` (as BucketPlan plans them,
// for a size known at run time), on `device` as `stages` makes them.
template <class StageNet, class Optimizer, class Net, class Stages = HostStages>
std::unique_ptr<PipelineStage> make_stage_of(const Model<Net, float>& initial,
                                             typename Optimizer::Options options,
                                             std::size_t bucket_bytes, const Device& device,
                                             LayerRange range = Model<StageNet>::all_layers,
                                             const Stages& stages = {}) {
  using offsets = list_info<typename StageNet::executed>;
  LOOM_CHECK(initial.range().first == 0 && initial.range().last == Model<Net>::layer_count,
             "make_stage_of: the initial weights come from the whole network's Model, not a "
             "range's");
  // StageNet's first layer in Net (its layers keep their numbers there);
  // the range's lies further by its first layer's offset in StageNet.
  using whole = list_info<typename Net::layers>;
  constexpr std::size_t first = type_at_t<0, typename StageNet::layers>::index -
                                type_at_t<0, typename Net::layers>::index;
  const std::size_t offset = whole::param_offsets[first] + offsets::param_offsets[range.first];
  const std::size_t state_at = whole::state_offsets[first] + offsets::state_offsets[range.first];
  const std::size_t size = offsets::param_offsets[range.last] - offsets::param_offsets[range.first];
  const std::size_t state_size =
      offsets::state_offsets[range.last] - offsets::state_offsets[range.first];
  auto made = stages.template make<StageNet, Optimizer>(
      initial.parameters().subspan(offset, size), initial.state().subspan(state_at, state_size),
      options, offset, state_at, range, device);
  // The range's layers, numbered from its first as its backward's hooks are.
  std::vector<std::size_t> starts(offsets::param_offsets.begin() + range.first,
                                  offsets::param_offsets.begin() + range.last + 1);
  for (std::size_t& start : starts) start -= offsets::param_offsets[range.first];
  plan_buckets(std::span<const std::size_t>(starts),
               std::max<std::size_t>(1, bucket_bytes / sizeof(float)),
               [&](const GradientBucket& b) { made->buckets.push_back(b); });
  return made;
}

// Runs a policy's grid of net.stages stages x grid.replicas replicas: each
// replica streams its share of every global batch through its stages, in
// the schedule's micro-batches; stage k of every replica sums its gradients
// with the other replicas' stage k.
class GridEngine {
 public:
  // One rank per device, ranks of a LocalComm; or, with `processes` (an MPI
  // world of R x S ranks), the rank of this process on its one device.
  // `schedule`: the one to run (micro_batches 0: the grid's).
  GridEngine(GridNet net, const StageMaker& make_stage, const std::vector<Device>& devices,
             comm::Comm processes, PipelineGrid grid, PipelineSchedule schedule);

  GridEngine(const GridEngine&) = delete;
  GridEngine& operator=(const GridEngine&) = delete;
  ~GridEngine() { crew_.stop(); }

  const PipelineSchedule& schedule() const { return schedule_; }
  const PipelineGrid& grid() const { return grid_; }
  std::size_t replicas() const { return grid_.replicas; }
  // The policy's shape: replicas x stages x tensor.
  const Mesh& mesh() const { return mesh_; }
  int world() const { return ranks_.front()->groups.world.size(); }
  // This process's ranks, in grid order (replica-major), and their stages.
  std::size_t local_stages() const { return ranks_.size(); }
  PipelineStage& stage(std::size_t i) { return *ranks_.at(i)->net; }
  const PipelineStage& stage(std::size_t i) const { return *ranks_.at(i)->net; }
  // Every rank of the grid is here (worker devices), or only this process's.
  bool all_local() const { return ranks_.size() == mesh_.size(); }

  // One batch of an optimizer step. group_samples: the samples of all the
  // step's batches (a per-sample loss is their mean; another loss's
  // denominator is summed over the batches); accumulate: add to the
  // gradients of earlier batches; last: reduce and update. Returns the
  // step's global loss and correct-count sums when `last`; a non-finite
  // loss or gradient skips the update on every rank (the caller checks
  // fault()), as does an fp16 overflow (LossSums::overflowed).
  cpu::LossSums micro_step(const float* images, const Targets& targets, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last,
                           const StepSettings& settings, const Pass& pass);

  // After a step whose loss or gradients went non-finite (and which every
  // rank skipped): where it happened first, over every stage and replica.
  const NonFiniteSpot& fault() const { return ranks_.front()->fault; }

  // Loss and correct-count sums over a data set: each replica takes its
  // share, in pieces of `batch` samples, each streamed through its stages
  // in micro-batches.
  cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch, Precision precision);

  // Every process's `row` (all of one size), process p's as row p (a
  // collective: the trainer's agreement before a fit or a load).
  std::vector<double> gather_rows(std::span<const double> row) {
    std::vector<double> rows;
    crew_.run({.kind = JobKind::agree, .row = row, .rows = &rows});
    return rows;
  }

  // The sum of `value` over the processes (a collective: a checkpoint that
  // one process could not write or read stops them all).
  double sum_over_ranks(double value) {
    crew_.run({.kind = JobKind::agree, .value = value});
    return ranks_.front()->stats[0];
  }

  // Every stage's weights and running statistics into the whole network's
  // (collective across processes: every rank gets all of them).
  void gather(float* parameters, float* state) {
    crew_.run({.kind = JobKind::gather, .whole = parameters});
    if (net_.state_count > 0) crew_.run({.kind = JobKind::gather_state, .whole = state});
  }
  // Each stage takes its slices of the whole network's.
  void scatter(const float* parameters, const float* state) {
    crew_.run({.kind = JobKind::scatter, .whole = const_cast<float*>(parameters)});
    if (net_.state_count > 0)
      crew_.run({.kind = JobKind::scatter_state, .whole = const_cast<float*>(state)});
  }
  // Weights or running statistics were changed through copy 0 of a stage:
  // every copy takes them, as at the start.
  void share_first_replica() { crew_.run({.kind = JobKind::share}); }

  // Optimizer buffer i of every stage into `whole` (the whole network's
  // size), or each stage's slice from it; as gather() and scatter().
  void gather_optimizer(std::size_t i, float* whole) {
    crew_.run({.kind = JobKind::gather_buffer, .n = i, .whole = whole});
  }
  void scatter_optimizer(std::size_t i, const float* whole) {
    crew_.run({.kind = JobKind::scatter_buffer, .n = i, .whole = const_cast<float*>(whole)});
  }
  // Every stage takes the same number of optimizer steps.
  std::uint64_t optimizer_steps() const { return ranks_.front()->net->optimizer_steps(); }
  void set_optimizer_steps(std::uint64_t steps) {
    for (auto& r : ranks_) r->net->set_optimizer_steps(steps);
  }

  // Sizes each rank for its share of global batches of up to `batch`.
  void reserve(std::size_t batch) { crew_.run({.kind = JobKind::reserve, .n = batch}); }

  // i: this process's ranks in grid order (replica-major).
  StageReport report(std::size_t i) const;

  // Each local rank's time in the last optimizer step, in grid order.
  std::vector<double> step_seconds() const;

 private:
  using Clock = std::chrono::steady_clock;

  enum class JobKind {
    start,
    train,
    evaluate,
    gather,
    scatter,
    gather_state,
    scatter_state,
    gather_buffer,
    scatter_buffer,
    share,
    reserve,
    agree
  };
  using Job = EngineJob<JobKind>;

  // SyncBatchNorm's sums, on a communicator of their own: the reducer's
  // thread all-reduces gradient buckets on the stage's copies meanwhile.
  struct StatisticsSum final : ReplicaSum {
    comm::Comm comm;
    void sum(std::span<double> values) override { comm.all_reduce(values, comm::ReduceOp::sum); }
  };

  // The split layers' sums and gathers (TensorParallel), on the rank's
  // tensor group: its own thread's, while the reducer's thread all-reduces
  // gradient buckets on the data group.
  struct TensorSum final : TensorGroup {
    comm::Comm* comm = nullptr;
    void sum(std::span<float> values) override { comm->all_reduce(values, comm::ReduceOp::sum); }
    void sum(std::span<double> values) override { comm->all_reduce(values, comm::ReduceOp::sum); }
    void gather(std::span<const float> mine, std::span<float> all) override {
      comm->all_gather(mine, all);
    }
    void gather(std::span<const double> mine, std::span<double> all) override {
      comm->all_gather(mine, all);
    }
  };

  struct Rank {
    std::size_t rank = 0;  // in the mesh's world
    std::size_t replica = 0, stage = 0, tensor = 0;  // its data, pipe and tensor coordinates
    std::unique_ptr<PipelineStage> net;
    // Its communicators: world, every rank of the grid; pipe, this
    // replica's stages (rank = stage); data, the copies of this stage (rank
    // = replica), which the reducer's thread uses (mesh.hpp).
    MeshGroups groups;
    StageLinks links;                              // what moves the stage's memory
    StatisticsSum statistics;                      // SyncBatchNorm's, over the stage's copies
    TensorSum tensor_sum;                          // TensorParallel's layers', over groups.tensor
    std::unique_ptr<Reducer> reducer;              // several replicas: over this stage's copies
    std::unique_ptr<Outbox> to_next, to_previous;  // destroyed first
    std::vector<std::size_t> free_slots, slot_of;  // slot_of: per micro-batch
    std::size_t slots = 0, in_flight = 0, peak_in_flight = 0;
    std::size_t next_bucket = 0;  // the next gradient bucket to reduce this step
    // The loss's sums (loss, correct, errors, references: cpu::LossSums),
    // (training) how many stages' gradients are not finite, and the loss's
    // denominator.
    std::array<double, 6> stats{};
    std::vector<double> squares;  // clipping's, per layer with parameters (kept: no allocation)
    std::vector<float> tie_sum;   // a tied weight's summed gradient (kept: no allocation)
    std::vector<float> tie_part;  // one copy's, read from the stage
    double busy = 0.0;
    double step_seconds = 0.0;  // the last optimizer step's jobs, end to end
    bool overflowed = false;    // the last step's scaled gradients were not finite
    NonFiniteSpot fault;        // the step's first non-finite value (agreed by the ranks)
    Clock::time_point begin, end, backward_begin, backward_end;
  };

  std::string layout() const;

  bool first(const Rank& r) const { return r.stage == 0; }
  bool last(const Rank& r) const { return r.stage + 1 == stages_; }
  // A micro-batch's targets for the loss, with its samples' lengths at the
  // network's output (the layers may have changed them).
  static Targets loss_targets(const Rank& r, const Targets& batch, std::size_t first_sample,
                              std::size_t slot) {
    Targets targets = batch.from(first_sample);
    if (targets.frames != nullptr) targets.frames = r.net->output_frames(slot);
    return targets;
  }
  // The ranks of a tensor group compute the same loss: the first speaks for it.
  static void add_sums(Rank& r, const cpu::LossSums& sums) {
    if (r.tensor != 0) return;
    r.stats[0] += sums.loss;
    r.stats[1] += static_cast<double>(sums.correct);
    r.stats[2] += sums.errors;
    r.stats[3] += sums.references;
    r.stats[5] += sums.denominator;
  }

  // A failing rank wakes every group it belongs to, so no rank waits for it.
  void cancel(Rank& r, const std::string& why) {
    r.groups.world.cancel(why);
    if (r.groups.pipe) r.groups.pipe.cancel(why);
    if (r.groups.tensor) r.groups.tensor.cancel(why);
    if (r.reducer) r.reducer->comm().cancel(why);
    // A stage's own links (a GPU's), once made.
    for (auto* link : {&r.links.to_next, &r.links.from_next, &r.links.to_previous,
                       &r.links.from_previous})
      if (started_ && link->comm) link->comm.cancel(why);
    // Made by the start job: read only once every rank has made it.
    if (started_ && r.statistics.comm) r.statistics.comm.cancel(why);
    if (started_)
      for (comm::Comm& layers : r.links.layers) layers.cancel(why);
  }

  void work(Rank& r, const Job& job);

  // Checks every rank runs this program, then makes the grid's groups:
  // each replica's pipeline, and (several replicas) each stage's copies,
  // which take copy 0's weights.
  void start(Rank& r);

  // Room for micro-batches of up to `micro_batch` samples, `slots` at once;
  // made before a step's passes (growing the arena mid-step would move the
  // activations of micro-batches in flight).
  void prepare(Rank& r, std::size_t micro_batch, std::size_t slots);

  // The input of a micro-batch of n samples: the batch's own (stage 0), or
  // received from the stage before into the slot's buffer.
  const float* receive_input(Rank& r, const float* images, std::size_t n, std::size_t slot) {
    if (first(r)) return images;
    float* buffer = r.net->input_slot(slot);
    r.links.from_previous.comm.recv(std::span<float>(buffer, n * r.net->input_size),
                                    r.links.from_previous.peer);
    return buffer;
  }

  void send_output(Rank& r, const float* output, std::size_t n) {
    r.to_next->send(std::span<const float>(output, n * r.net->output_size));
  }

  // Hands the reducer every bucket that executed layer `layer` completes
  // (all that are left, with no layer).
  static void post_ready(Rank& r, std::optional<std::size_t> layer) {
    // Stamped before the last buckets are posted: once posted, the
    // communication thread may take this thread's core.
    if (layer == 0) r.backward_end = Clock::now();
    const auto& buckets = r.net->buckets;
    while (r.next_bucket < buckets.size() &&
           (!layer || buckets[r.next_bucket].ready_after == *layer)) {
      const auto& bucket = buckets[r.next_bucket];
      r.reducer->post(r.net->gradients().subspan(bucket.begin, bucket.size()), r.next_bucket++);
    }
  }

  void train(Rank& r, const Job& job);

  // Where whole-network parameters [whole, whole + count) lie in this
  // rank's slice (its offset), or nothing when it holds none of them (a
  // run held alike by a tensor group counts as held).
  static std::optional<std::size_t> gradients_at(Rank& r, std::size_t whole, std::size_t count) {
    if (r.net->segments.empty())
      return whole >= r.net->parameter_offset &&
                     whole + count <= r.net->parameter_offset + r.net->parameter_size
                 ? std::optional<std::size_t>(whole - r.net->parameter_offset)
                 : std::nullopt;
    for (const ParamSegment& s : r.net->segments)
      if (whole >= s.whole && whole + count <= s.whole + s.count)
        return s.local + (whole - s.whole);
    return std::nullopt;
  }

  // Weight tying: each tied pair's two gradients (reduced over the
  // replicas) summed into both, so the copies take the same update and
  // stay equal bit for bit. Where one stage holds both, in its own memory
  // (on a GPU, on the device). Else summed over the pipe group on the
  // host (across stages the embedding is on the first, the head on the
  // last), the stages that hold neither adding zeros, which changes no
  // value.
  void tie_gradients(Rank& r) {
    for (const TieRun& tie : net_.ties) {
      const auto source = gradients_at(r, tie.source, tie.count);
      const auto copy = gradients_at(r, tie.copy, tie.count);
      if (source && copy && r.groups.pipe.size() == 1) {
        r.net->sum_gradients(*source, *copy, tie.count);
        continue;
      }
      r.tie_sum.assign(tie.count, 0.0f);
      for (const auto& part : {source, copy})
        if (part) {
          r.tie_part.resize(tie.count);
          r.net->read_gradients(*part, r.tie_part);
          for (std::size_t k = 0; k < tie.count; ++k) r.tie_sum[k] += r.tie_part[k];
        }
      r.groups.pipe.all_reduce(std::span<float>(r.tie_sum), comm::ReduceOp::sum);
      for (const auto& part : {source, copy})
        if (part) r.net->write_gradients(*part, r.tie_sum);
    }
  }

  // A rank's executor: its answers are the grid's (the sums all-reduced
  // before, the overflow and the norm over the stages).
  struct RankExecutor {
    GridEngine& engine;
    Rank& r;
    std::size_t micro;  // the step's last batch's micro-batches on this replica

    bool loss_finite() const { return std::isfinite(r.stats[0]); }
    bool gradients_finite() const { return r.stats[4] == 0.0; }
    // Unscales the stage's gradients; whether no stage's overflowed (the
    // replicas' copies hold the same reduced gradients).
    bool unscale(float loss_scale) {
      std::array<double, 1> bad{r.net->unscale(loss_scale) ? 0.0 : 1.0};
      r.groups.pipe.all_reduce(std::span<double>(bad), comm::ReduceOp::sum);
      r.groups.tensor.all_reduce(std::span<double>(bad), comm::ReduceOp::sum);
      return bad[0] == 0.0;
    }
    // This rank's first non-finite value (the outputs its slots still
    // hold, else its gradients), then the grid's; its running statistics
    // put back.
    void skip_nonfinite(bool) {
      std::vector<bool> seen(r.slots, false);
      for (std::size_t m = micro; m-- > 0 && !r.fault;) {
        const std::size_t slot = r.slot_of[m];
        if (seen[slot]) continue;
        seen[slot] = true;
        r.fault = r.net->find_nonfinite_output(slot, r.stage == 0);
      }
      if (!r.fault) r.fault = r.net->find_nonfinite_gradient();
      r.fault = agree_on_spot(r.groups.world, r.fault);
      r.net->restore_state();
    }
    // Every rank learned of the overflow (summed over the pipeline, whose
    // replicas hold the same reduced gradients): all agree on where.
    void skip_overflow(bool name_spot) {
      if (name_spot) r.fault = agree_on_spot(r.groups.world, r.net->find_nonfinite_gradient());
      r.net->restore_state();
    }
    // The norm is the whole pipeline's: each stage gives its layers'
    // squares (a tensor group's ranks, their own parts).
    void clip(float max_norm) {
      auto& squares = r.squares;
      squares.assign(engine.net_.norm_segments.size(), 0.0);
      r.net->add_layer_squares(engine.net_.norm_segments, squares);
      r.groups.pipe.all_reduce(std::span<double>(squares), comm::ReduceOp::sum);
      r.groups.tensor.all_reduce(std::span<double>(squares), comm::ReduceOp::sum);
      const float factor = clip_factor(global_norm(squares), max_norm);
      if (factor != 1.0f) r.net->scale_gradients(factor);
    }
    void update(float lr) { r.net->update(lr); }
  };

  // Several replicas: a stage's copies take copy 0's running statistics
  // (as DataParallel's replicas do) before each step and evaluation.
  static void share_state(Rank& r) {
    if (r.reducer && r.net->state_size > 0) r.reducer->comm().broadcast(r.net->state(), 0);
  }
  static void share_weights(Rank& r) {
    if (!r.reducer) return;
    r.reducer->comm().broadcast(r.net->parameters(), 0);
    share_state(r);
  }

  void evaluate(Rank& r, const Job& job);

  // Replica 0's slices (weights, running statistics or optimizer buffer b)
  // into `whole` (the replicas' copies are equal).
  void gather(Rank& r, PipelineStage::Buffer what, std::size_t b, float* whole);
  // Each stage's slice from `whole`.
  static void scatter(Rank& r, PipelineStage::Buffer what, std::size_t b, const float* whole) {
    const bool state = what == PipelineStage::Buffer::state;
    if (!state && !r.net->segments.empty()) {
      std::vector<float> own(r.net->parameter_size);
      cut_own(r.net->segments, whole, own);
      r.net->write(what, b, own);
      return;
    }
    const std::size_t offset = state ? r.net->state_offset : r.net->parameter_offset;
    const std::size_t size = state ? r.net->state_size : r.net->parameter_size;
    r.net->write(what, b, std::span<const float>(whole + offset, size));
  }

  static void drain(Rank& r) {
    if (r.to_next) r.to_next->drain();
    if (r.to_previous) r.to_previous->drain();
  }

  static double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  GridNet net_;
  PipelineGrid grid_;
  PipelineSchedule schedule_;
  std::size_t stages_;
  Mesh mesh_;  // grid_.replicas x stages_ x grid_.tensor
  bool local_ = true;
  std::size_t threads_per_process_ = 1;  // ranks in this process: process p holds p*T ... p*T+T-1
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<bool> started_ = false;  // every rank's groups exist
  Crew<Job> crew_;  // after ranks_: its threads stop before the ranks go
};

// A GridEngine behind the trainer's interface (SplitEngine): what
// DataParallelEngine and PipelineEngine answer alike.
template <class Net>
class GridSplitEngine : public SplitEngine<Net>, public GridEngine {
 public:
  using GridEngine::GridEngine;

  bool all_local() const override { return GridEngine::all_local(); }
  cpu::LossSums micro_step(const float* images, const Targets& targets, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last,
                           const StepSettings& settings,
                           const Pass& pass = {.training = true}) override {
    return GridEngine::micro_step(images, targets, n, group_samples, accumulate, last, settings,
                                  pass);
  }
  const NonFiniteSpot& fault() const override { return GridEngine::fault(); }
  cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch,
                         Precision precision = Precision::fp32) override {
    return GridEngine::evaluate(dataset, batch, precision);
  }
  void gather(Model<Net, float>& whole) override {
    GridEngine::gather(whole.parameters().data(), whole.state().data());
  }
  void scatter(const Model<Net, float>& whole) override {
    GridEngine::scatter(whole.parameters().data(), whole.state().data());
  }
  void gather_optimizer(std::size_t b, float* whole) override {
    GridEngine::gather_optimizer(b, whole);
  }
  void scatter_optimizer(std::size_t b, const float* whole) override {
    GridEngine::scatter_optimizer(b, whole);
  }
  std::uint64_t optimizer_steps() const override { return GridEngine::optimizer_steps(); }
  void set_optimizer_steps(std::uint64_t steps) override {
    GridEngine::set_optimizer_steps(steps);
  }
  double sum_over_ranks(double value) override { return GridEngine::sum_over_ranks(value); }
  std::vector<double> gather_rows(std::span<const double> row) override {
    return GridEngine::gather_rows(row);
  }
  std::vector<double> step_seconds() const override { return GridEngine::step_seconds(); }
};

#if LOOM_IMPLEMENT
LOOM_DECL void Outbox::send(std::span<const float> data) {
  if (!thread_.joinable()) {
    comm_.send(data, peer_);
    return;
  }
  Message message;
  {
    std::lock_guard lock(mutex_);
    if (!free_.empty()) {
      message = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (message.capacity < data.size()) {
    message.data = memory_.allocate(data.size());
    message.capacity = data.size();
  }
  memory_.copy(message.data.get(), data.data(), data.size());
  message.size = data.size();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(message));
    ++posted_;
  }
  changed_.notify_all();
}

LOOM_DECL void Outbox::run() {
  for (;;) {
    Message message;
    bool skip = false;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      message = std::move(queue_.front());
      queue_.pop_front();
      skip = error_ != nullptr || stop_;
    }
    if (!skip) {
      try {
        comm_.send(std::span<const float>(message.data.get(), message.size), peer_);
      } catch (const std::exception& error) {
        comm_.cancel(error.what());
        std::lock_guard lock(mutex_);
        error_ = std::current_exception();
      }
    }
    {
      std::lock_guard lock(mutex_);
      free_.push_back(std::move(message));
      ++sent_;
    }
    changed_.notify_all();
  }
}

LOOM_DECL GridEngine::GridEngine(GridNet net, const StageMaker& make_stage,
                                 const std::vector<Device>& devices, comm::Comm processes,
                                 PipelineGrid grid, PipelineSchedule schedule)
    : net_(std::move(net)),
      grid_(std::move(grid)),
      schedule_(schedule.micro_batches == 0 ? grid_.schedule : schedule),
      stages_(net_.stages),
      mesh_{.data = grid_.replicas, .pipe = stages_, .tensor = grid_.tensor},
      crew_(grid_.policy, devices.front().threads) {
  LOOM_CHECK(grid_.replicas >= 1, grid_.policy, " needs at least one replica");
  // A schedule chosen at run time gets the check the policy's own had at
  // compile time: its sends and receives pair up and it cannot deadlock.
  check_pipeline_schedule(schedule_.kind, stages_,
                          std::max<std::size_t>(1, schedule_.micro_batches));
  std::vector<comm::Comm> comms;
  local_ = !processes;  // LocalComm: buffered sends
  const char* name = grid_.policy;
  const std::size_t ranks = mesh_.size();
  if (processes) {
    const std::size_t threads = devices.size();
    const std::size_t process_count = static_cast<std::size_t>(processes.size());
    if (threads == 1)
      LOOM_CHECK(process_count == ranks, name, " has ", layout(), ", one per process, but ",
                 process_count, " processes were started; start ", ranks, " (mpirun -np ", ranks,
                 ")");
    else
      LOOM_CHECK(process_count * threads == ranks, name, " has ", layout(),
                 ", one per device, but ", process_count, " processes with ", threads,
                 " devices each make ", process_count * threads, "; start processes x devices = ",
                 ranks);
#if defined(LOOM_WITH_MPI)
    // A stage's outboxes send while its compute thread receives; a
    // process's threads call MPI at once.
    int initialized = 0, level = MPI_THREAD_SINGLE;
    MPI_Initialized(&initialized);
    if (initialized) MPI_Query_thread(&level);
    LOOM_CHECK((stages_ == 1 && grid_.tensor == 1 && threads == 1) || !initialized ||
                   level == MPI_THREAD_MULTIPLE,
               name, " over MPI processes sends and receives from several threads at once and "
               "needs MPI_THREAD_MULTIPLE; this MPI library provides thread level ",
               level);
#endif
    threads_per_process_ = threads;
    if (threads == 1) {
      comms.push_back(std::move(processes));
    } else {
      // Ranks are threads of several processes: a group over both (the
      // ranks of a process reduce among themselves first, deterministically).
      for (auto& mixed : comm::MixedComm::create(processes, static_cast<int>(threads)))
        comms.emplace_back(std::move(mixed));
    }
  } else {
    LOOM_CHECK(devices.size() == ranks, name, " has ", layout(), " and needs ", ranks,
               " devices, one each, but ", devices.size(), " were given");
    threads_per_process_ = ranks;
    for (auto& local : comm::LocalComm::create(static_cast<int>(ranks)))
      comms.emplace_back(std::move(local));
  }
  for (std::size_t i = 0; i < comms.size(); ++i) {
    auto& c = comms[i];
    auto rank = std::make_unique<Rank>();
    const auto w = static_cast<std::size_t>(c.rank());
    const MeshCoordinates at = mesh_.coordinates(w);
    rank->rank = w;
    rank->replica = at.data;
    rank->stage = at.pipe;
    rank->tensor = at.tensor;
    // This process's ranks, in order, on its devices (one, under MPI alone).
    rank->net = make_stage(at, devices[std::min(i, devices.size() - 1)]);
    rank->groups.world = std::move(c);
    ranks_.push_back(std::move(rank));
  }
  if (ranks == 1) crew_.set_alone();
  crew_.start(
      ranks_.size(), [this](std::size_t i, const Job& job) { work(*ranks_[i], job); },
      [this](std::size_t i, const std::string& why) { cancel(*ranks_[i], why); });
  try {
    crew_.run({.kind = JobKind::start});
    started_ = true;
  } catch (...) {
    crew_.stop();  // no destructor runs for a constructor that throws
    throw;
  }
}

LOOM_DECL cpu::LossSums GridEngine::micro_step(const float* images, const Targets& targets,
                                               std::size_t n, std::size_t group_samples,
                                               bool accumulate, bool last,
                                               const StepSettings& settings, const Pass& pass) {
  crew_.run({.kind = JobKind::train,
             .images = images,
             .labels = targets.labels,
             .targets = targets,
             .n = n,
             .group_samples = group_samples,
             .accumulate = accumulate,
             .last = last,
             .settings = settings,
             .pass = pass});
  auto sums = loss_sums(ranks_.front()->stats);
  sums.overflowed = ranks_.front()->overflowed;
  return sums;
}

LOOM_DECL cpu::LossSums GridEngine::evaluate(const data::Dataset& dataset, std::size_t batch,
                                             Precision precision) {
  crew_.run({.kind = JobKind::evaluate, .n = batch, .precision = precision, .dataset = &dataset});
  return loss_sums(ranks_.front()->stats);
}

LOOM_DECL StageReport GridEngine::report(std::size_t i) const {
  const Rank& r = *ranks_.at(i);
  StageReport report;
  report.stage = r.stage;
  report.replica = r.replica;
  report.tensor = r.tensor;
  report.peak_in_flight = r.peak_in_flight;
  report.activation_elements = r.net->arena_elements();
  report.busy_seconds = r.busy;
  report.begin = r.begin;
  report.end = r.end;
  report.backward_begin = r.backward_begin;
  report.backward_end = r.backward_end;
  if (r.reducer) {
    report.reduce_posted = r.reducer->posted();
    report.reduce_begin = r.reducer->begun();
    report.reduce_end = r.reducer->ended();
  }
  return report;
}

LOOM_DECL std::vector<double> GridEngine::step_seconds() const {
  std::vector<double> seconds;
  for (const auto& r : ranks_) seconds.push_back(r->step_seconds);
  return seconds;
}

LOOM_DECL std::string GridEngine::layout() const {
  std::string text = std::to_string(stages_) + " stage" + (stages_ == 1 ? "" : "s");
  if (stages_ == 1)
    text = std::to_string(grid_.replicas) + " replica" + (grid_.replicas == 1 ? "" : "s");
  else if (grid_.replicas > 1)
    text = std::to_string(grid_.replicas) + " replicas x " + text + " = " +
           std::to_string(grid_.replicas * stages_) + " ranks";
  if (grid_.tensor > 1)
    text = mesh_.describe() + " = " + std::to_string(mesh_.size()) + " ranks";
  return text;
}

LOOM_DECL void GridEngine::work(Rank& r, const Job& job) {
  switch (job.kind) {
    case JobKind::start:
      start(r);
      break;
    case JobKind::train: {
      const auto began = Clock::now();
      if (!job.accumulate) r.step_seconds = 0.0;
      train(r, job);
      r.step_seconds += seconds_since(began);
      break;
    }
    case JobKind::evaluate:
      evaluate(r, job);
      break;
    case JobKind::gather:
      gather(r, PipelineStage::Buffer::parameters, 0, job.whole);
      break;
    case JobKind::gather_state:
      gather(r, PipelineStage::Buffer::state, 0, job.whole);
      break;
    case JobKind::scatter:
      scatter(r, PipelineStage::Buffer::parameters, 0, job.whole);
      break;
    case JobKind::scatter_state:
      scatter(r, PipelineStage::Buffer::state, 0, job.whole);
      break;
    case JobKind::gather_buffer:
      gather(r, PipelineStage::Buffer::optimizer, job.n, job.whole);
      break;
    case JobKind::scatter_buffer:
      scatter(r, PipelineStage::Buffer::optimizer, job.n, job.whole);
      break;
    case JobKind::share:
      share_weights(r);
      break;
    case JobKind::reserve: {
      const auto share = batch_share(job.n, grid_.replicas, 0);
      const std::size_t micro =
          std::max<std::size_t>(1, std::min(schedule_.micro_batches, share.count));
      prepare(r, std::max<std::size_t>(1, batch_share(share.count, micro, 0).count),
              pipeline_in_flight(schedule_.kind, stages_, r.stage, micro));
      break;
    }
    case JobKind::agree:
      // Across processes: one row, one value, per process, which its first
      // rank gives (its other ranks' rows are the same, their values 0).
      if (job.rows != nullptr) {
        auto all = comm::gather_rows(r.groups.world, job.row);
        if (&r == ranks_.front().get()) {
          job.rows->clear();
          const std::size_t width = job.row.size();
          for (std::size_t w = 0; w * width < all.size(); w += threads_per_process_)
            job.rows->insert(job.rows->end(), all.begin() + static_cast<std::ptrdiff_t>(w * width),
                             all.begin() + static_cast<std::ptrdiff_t>((w + 1) * width));
        }
        break;
      }
      r.stats = {&r == ranks_.front().get() ? job.value : 0.0, 0.0};
      r.groups.world.all_reduce(std::span<double>(r.stats), comm::ReduceOp::sum);
      break;
  }
}

LOOM_DECL void GridEngine::start(Rank& r) {
  check_same_program(r.groups.world,
                     "network " + net_.network + ", policy " + grid_.identity + " (" +
                         std::to_string(grid_.replicas) + " replicas, tensor " +
                         std::to_string(grid_.tensor) + "), optimizer " + net_.optimizer,
                     net_.parameter_count);
  r.groups = split_mesh(std::move(r.groups.world), mesh_);
  r.tensor_sum.comm = &r.groups.tensor;
  r.tensor_sum.rank = r.tensor;
  r.tensor_sum.size = mesh_.tensor;
  r.links = r.net->links(r.groups, mesh_, r.rank);
  if (grid_.replicas > 1) {
    r.reducer = std::make_unique<Reducer>(r.links.data, r.net->buckets.size());
    r.reducer->comm().broadcast(r.net->parameters(), 0);
  }
  // SyncBatchNorm's sums go over the data axis too, on a communicator of
  // their own (see StatisticsSum).
  if (net_.syncs)
    r.statistics.comm = r.groups.world.split(
        static_cast<int>(mesh_.group(r.rank, MeshAxis::data)),
        static_cast<int>(mesh_.rank_in_group(r.rank, MeshAxis::data)));
  const bool threaded = !local_ || r.links.own;
  if (!last(r)) r.to_next = std::make_unique<Outbox>(r.links.to_next, r.net->memory(), threaded);
  if (!first(r))
    r.to_previous = std::make_unique<Outbox>(r.links.to_previous, r.net->memory(), threaded);
}

LOOM_DECL void GridEngine::prepare(Rank& r, std::size_t micro_batch, std::size_t slots) {
  r.net->reserve(micro_batch, slots, !first(r));
  r.slots = std::max(r.slots, slots);
  r.free_slots.clear();
  for (std::size_t s = slots; s-- > 0;) r.free_slots.push_back(s);
}

LOOM_DECL void GridEngine::train(Rank& r, const Job& job) {
  share_state(r);
  // This replica's share of the global batch, in micro-batches.
  const auto share = batch_share(job.n, grid_.replicas, r.replica);
  const std::size_t micro = std::min(schedule_.micro_batches, share.count);
  if (micro > 0)
    prepare(r, batch_share(share.count, micro, 0).count,
            pipeline_in_flight(schedule_.kind, stages_, r.stage, micro));
  r.slot_of.assign(micro, 0);
  if (!job.accumulate) {
    r.stats = {};
    r.overflowed = false;
    r.fault = {};
    r.net->keep_state();
  }
  r.net->set_precision(job.settings.precision);
  bool accumulate = job.accumulate;
  // A per-sample loss's gradient is scaled by 1/(the step's samples) as it
  // is made; any other denominator's total is known only at the step's end.
  const bool per_sample = net_.loss->denominator() == Denominator::samples;
  const float grad_scale =
      per_sample ? job.settings.loss_scale / static_cast<float>(job.group_samples)
                 : job.settings.loss_scale;
  // Several replicas: the step's last backward hands each bucket to the
  // reducer as soon as its layers are done. SyncBatchNorm's backward
  // calls collectives of its own: the buckets then wait for the
  // backward's end, so that no two threads of a rank are in MPI at once
  // (MPI_THREAD_SERIALIZED).
  const bool reduce = r.reducer != nullptr && job.last;
  const bool overlap = reduce && !net_.syncs;
  std::size_t backwards = 0;
  r.next_bucket = 0;
  r.busy = 0.0;
  r.begin = Clock::now();
  for_each_pipeline_op(schedule_.kind, stages_, r.stage, micro, [&](PipelineOp op) {
    const auto piece = batch_share(share.count, micro, op.micro_batch);
    const std::size_t first_sample = share.first + piece.first;
    if (op.forward) {
      const std::size_t slot = r.free_slots.back();
      r.free_slots.pop_back();
      r.slot_of[op.micro_batch] = slot;
      r.peak_in_flight = std::max(r.peak_in_flight, ++r.in_flight);
      const float* input =
          receive_input(r, job.images + first_sample * net_.input_size, piece.count, slot);
      const auto started = Clock::now();
      Pass pass = job.pass;
      pass.first_sample = first_sample;
      if (job.targets.frames != nullptr) pass.frames = job.targets.frames + first_sample;
      if (net_.syncs) pass.replicas = &r.statistics;
      pass.tensor = &r.tensor_sum;  // a group of one too (TensorParallel<1>)
      const float* output = r.net->forward(input, piece.count, slot, pass);
      r.busy += seconds_since(started);
      if (!last(r)) {
        // Looked at now: by the step's end a later micro-batch may hold the slot.
        if (!r.fault) r.fault = r.net->check_output(slot, piece.count, first(r));
        send_output(r, output, piece.count);
      }
    } else {
      const std::size_t slot = r.slot_of[op.micro_batch];
      float* dy = r.net->output_gradient();
      if (!last(r))
        r.links.from_next.comm.recv(std::span<float>(dy, piece.count * r.net->output_size),
                                    r.links.from_next.peer);
      const auto started = Clock::now();
      if (last(r)) {
        const auto sums =
            r.net->loss(*net_.loss, slot, piece.count,
                        loss_targets(r, job.targets, first_sample, slot), grad_scale, true);
        add_sums(r, sums);
        if (!std::isfinite(sums.loss) && !r.fault)
          r.fault = r.net->find_nonfinite_output(slot, first(r));
      }
      float* input_gradient = first(r) ? nullptr : r.net->input_gradient();
      const bool final_backward = ++backwards == micro;
      if (final_backward) r.backward_begin = Clock::now();
      // The capture is one pointer: std::function holds it without allocating.
      if (overlap && final_backward) {
        r.net->backward(slot, accumulate, input_gradient,
                        [rank = &r](std::size_t layer) { post_ready(*rank, layer); });
      } else {
        r.net->backward(slot, accumulate, input_gradient);
        if (final_backward) r.backward_end = Clock::now();
      }
      r.busy += seconds_since(started);
      if (!first(r))
        r.to_previous->send(
            std::span<const float>(input_gradient, piece.count * r.net->input_size));
      accumulate = true;
      r.free_slots.push_back(slot);
      --r.in_flight;
    }
  });
  r.end = Clock::now();
  // A replica with no sample of the step adds zeros to the sums.
  if (micro == 0 && !job.accumulate) r.net->zero_gradients();
  if (!job.last) return;
  if (reduce) post_ready(r, std::nullopt);
  drain(r);
  if (reduce) r.reducer->drain();
  tie_gradients(r);
  // Only the last stages have the loss, and each stage its gradients (the
  // reduced ones with several replicas); every rank learns the sums, so
  // all skip a non-finite step or all take it. (fp16 checks its gradients
  // when it unscales them: non-finite there is an overflow.)
  const bool fp16 = job.settings.precision == Precision::fp16;
  r.stats[4] = fp16 || r.net->gradients_finite() ? 0.0 : 1.0;
  r.groups.world.all_reduce(std::span<double>(r.stats), comm::ReduceOp::sum);
  if (!per_sample) {
    // The step's denominator over every batch and rank: each stage's
    // summed gradients become the mean's before fp16's unscale, clipping
    // and the update, on every rank alike. A step with nothing counted
    // (no position anywhere) has no mean: every rank skips its update and
    // puts its running statistics back; its sums report a denominator of 0.
    const double total = r.stats[5];
    if (total == 0.0) {
      r.net->restore_state();
      return;
    }
    r.net->scale_gradients(static_cast<float>(1.0 / total));
  }
  RankExecutor executor{*this, r, micro};
  r.overflowed = step_protocol(executor, job.settings) == StepEnd::overflowed;
}

LOOM_DECL void GridEngine::evaluate(Rank& r, const Job& job) {
  share_state(r);
  r.net->set_precision(job.precision);
  const auto& data = *job.dataset;
  const Targets targets = data::targets_of(data);
  const std::size_t sample = data.sample_size();
  const auto share = batch_share(data.count, grid_.replicas, r.replica);
  const std::size_t micro = std::min(schedule_.micro_batches, job.n);
  prepare(r, batch_share(job.n, micro, 0).count, std::max<std::size_t>(1, r.slots));
  r.stats = {};
  for (std::size_t at = 0; at < share.count; at += job.n) {
    const std::size_t n = std::min(job.n, share.count - at);
    const std::size_t pieces = std::min(micro, n);
    for (std::size_t m = 0; m < pieces; ++m) {
      const auto piece = batch_share(n, pieces, m);
      const std::size_t first_sample = share.first + at + piece.first;
      const float* input =
          receive_input(r, data.images.data() + first_sample * sample, piece.count, 0);
      Pass pass;
      if (targets.frames != nullptr) pass.frames = targets.frames + first_sample;
      pass.tensor = &r.tensor_sum;
      const float* output = r.net->forward(input, piece.count, 0, pass);
      if (last(r)) {
        add_sums(r, r.net->loss(*net_.loss, 0, piece.count,
                                loss_targets(r, targets, first_sample, 0), 1.0f, false));
      } else {
        send_output(r, output, piece.count);
      }
    }
  }
  drain(r);
  r.groups.world.all_reduce(std::span<double>(r.stats), comm::ReduceOp::sum);
}

LOOM_DECL void GridEngine::gather(Rank& r, PipelineStage::Buffer what, std::size_t b,
                                  float* whole) {
  const bool state = what == PipelineStage::Buffer::state;
  const std::size_t offset = state ? r.net->state_offset : r.net->parameter_offset;
  const std::size_t size = state ? r.net->state_size : r.net->parameter_size;
  // Replica 0's ranks write their parts: a whole slice each, or (split
  // layers) their own runs, and the first of each tensor group the runs
  // its group holds alike (running statistics included).
  const auto place = [&](float* into) {
    if (r.replica != 0) return;
    if (state || r.net->segments.empty()) {
      if (r.tensor == 0) r.net->read(what, b, std::span<float>(into + offset, size));
      return;
    }
    std::vector<float> own(r.net->parameter_size);
    r.net->read(what, b, own);
    for (const ParamSegment& s : r.net->segments)
      if (s.split || r.tensor == 0)
        std::copy_n(own.begin() + static_cast<std::ptrdiff_t>(s.local), s.count, into + s.whole);
  };
  if (all_local()) {
    place(whole);
    return;
  }
  // Each part is added into zeros: the sum is every part, exactly.
  std::vector<float> all(state ? net_.state_count : net_.parameter_count, 0.0f);
  place(all.data());
  r.groups.world.all_reduce(std::span<float>(all), comm::ReduceOp::sum);
  if (&r == ranks_.front().get()) std::copy(all.begin(), all.end(), whole);
}

#endif  // LOOM_IMPLEMENT

}  // namespace detail
}  // namespace loom
