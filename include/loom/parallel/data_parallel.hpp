// DataParallel<BucketBytes>: one replica of the network per device, each
// global batch split over them, the gradients summed so every replica takes
// the same optimizer step. The replicas are the grid engine's ranks
// (grid_engine.hpp: a grid of one stage): worker threads of one process
// (devices::cpu(n), LocalComm) or one per MPI process (MpiComm, see
// comm/mpi.hpp).
//
// Exactness: a rank holding n_r of a global batch of N samples scales its
// loss gradient by 1/N (not 1/n_r), so the summed gradient is the global
// mean whatever the split, and a rank with no samples adds zeros. (A loss
// over positions divides by the step's positions summed over the ranks:
// grid_engine.hpp.) Initial weights are rank 0's.
//
// Overlap: backward reports each layer as it finishes; a gradient bucket
// (slices of the flat gradient buffer in reverse layer order, as BucketPlan
// plans them) goes to the replica's communication thread as soon as its
// lowest layer is done, so its all-reduce runs while the layers before it
// are still back-propagating.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../comm/communicator.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/dataset.hpp"
#include "../net/model.hpp"
#include "grid_engine.hpp"

namespace loom {

template <std::size_t BucketBytes = default_bucket_bytes>
struct DataParallel {
  static constexpr std::size_t devices_needed = 0;  // any number, at least one
  static constexpr const char* name = "DataParallel";
  static constexpr std::size_t bucket_bytes = BucketBytes;
};

template <class Policy>
inline constexpr bool is_data_parallel = false;
template <std::size_t B>
inline constexpr bool is_data_parallel<DataParallel<B>> = true;

// When one replica's backward ran in a step, and each bucket's all-reduce
// (from the call, so a wait for slower ranks counts in it; empty with one
// replica).
struct StepTimeline {
  using Clock = std::chrono::steady_clock;
  Clock::time_point backward_begin, backward_end;
  std::vector<Clock::time_point> reduce_begin, reduce_end;  // per bucket, in plan order
};

namespace detail {

// check_same_program (grid_engine.hpp) for a network, policy and optimizer
// type; `policy`: its type's label and what it fixes at run time.
template <class Net, class Optimizer>
void check_same_program(comm::Comm& c, const std::string& policy) {
  check_same_program(c,
                     "network " + type_label<Net>() + ", policy " + policy + ", optimizer " +
                         type_label<Optimizer>(),
                     Net::parameter_count);
}
template <class Net, class Policy, class Optimizer>
void check_same_program(comm::Comm& c) {
  check_same_program<Net, Optimizer>(c, type_label<Policy>());
}

// SingleDevice and DataParallel: the grid engine over one stage, the whole
// network, one replica per rank; on CPU devices or processes the CPU's
// stages (StageOf<Net>, HostStages), on GPUs gpu::DeviceStages. The CPU's
// replicas' Models are reachable (model(), replica_model()); the trainer
// reaches any backend's through SplitEngine.
template <class Net, class Policy, class Optimizer, class Loss, class Stages = HostStages>
class DataParallelEngine final : public GridSplitEngine<Net> {
 public:
  using OptimizerState = typename Optimizer::template State<float>;

  // One replica per device, ranks of a LocalComm; or, with `processes` (an
  // MPI world), one replica per device of every process.
  DataParallelEngine(const std::vector<Device>& devices, comm::Comm processes, std::uint64_t seed,
                     typename Optimizer::Options options)
      : DataParallelEngine(devices, processes, Model<Net, float>(seed), options) {}
  // The replicas start from `initial`'s weights and running statistics.
  DataParallelEngine(const std::vector<Device>& devices, const comm::Comm& processes,
                     const Model<Net, float>& initial, typename Optimizer::Options options,
                     const Stages& stages = {})
      : GridSplitEngine<Net>(
            grid_net<Net, Optimizer, Loss>(1, is_data_parallel<Policy> && Net::syncs),
            [&](MeshCoordinates, const Device& device) {
              return make_stage_of<Net, Optimizer>(initial, options, bucket_bytes(), device,
                                                   Model<Net>::all_layers, stages);
            },
            devices, processes,
            {.policy = Policy::name,
             .identity = type_label<Policy>(),
             .replicas = processes ? static_cast<std::size_t>(processes.size()) * devices.size()
                                   : devices.size(),
             .bucket_bytes = bucket_bytes(),
             .schedule = {PipelineKind::one_f_one_b, 1}},
            {}) {}

  std::size_t local_replicas() const { return this->local_stages(); }
  // The CPU's stages only. Replica 0's (the first of this process); see
  // share_first_replica().
  Model<Net, float>& model() { return replica_model(0); }
  const Model<Net, float>& model() const {
    return static_cast<const Stage&>(this->stage(0)).model();
  }
  Model<Net, float>& replica_model(std::size_t i) {
    return static_cast<Stage&>(this->stage(i)).model();
  }
  OptimizerState& replica_optimizer(std::size_t i) {
    return static_cast<Stage&>(this->stage(i)).optimizer();
  }
  // When the last step's backward and reductions ran on local replica i.
  StepTimeline last_timeline(std::size_t i = 0) const {
    const auto r = this->report(i);
    return {r.backward_begin, r.backward_end, r.reduce_begin, r.reduce_end};
  }

  // One batch of an optimizer step (see GridEngine::micro_step).
  cpu::LossSums micro_step(const float* images, const Targets& targets, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last,
                           const StepSettings& settings,
                           const Pass& pass = {.training = true}) override {
    // A replica without a sample would miss the statistics' collectives.
    if constexpr (is_data_parallel<Policy> && Net::syncs)
      LOOM_CHECK(n >= static_cast<std::size_t>(this->world()), Policy::name, ": a batch of ", n,
                 " sample(s) over ", this->world(), " replicas leaves a replica without one, and "
                 "SyncBatchNorm needs every replica's statistics; use batches of at least ",
                 this->world(), " (the last batch of an epoch included)");
    return GridSplitEngine<Net>::micro_step(images, targets, n, group_samples, accumulate, last,
                                            settings, pass);
  }

 private:
  using Stage = StageOf<Net, Optimizer>;

  static constexpr std::size_t bucket_bytes() {
    if constexpr (requires { Policy::bucket_bytes; })
      return Policy::bucket_bytes;
    else
      return default_bucket_bytes;  // one replica: nothing is reduced
  }
};

}  // namespace detail
}  // namespace loom
