// ModelSplit<Partition, Schedule>: the network's layers cut into stages
// (partition.hpp: At<...> by hand, Balanced<S> by the compile-time cost
// model), one stage per device, and each batch streamed through them in
// micro-batches (schedule.hpp: GPipe<M> or OneFOneB<M>). Activations go
// forward and their gradients back with send/recv on a communicator: worker
// threads of one process (devices::cpu(S), LocalComm) or one stage per MPI
// process (MpiComm).
//
// Exactness: every micro-batch's loss gradient is scaled by 1/(global
// batch), and each stage adds its micro-batches' gradients, so a step's
// gradient is the batch mean, as on one device (summed in another order:
// equal to rounding); a loss over positions divides by the step's positions
// instead (grid_engine.hpp). Stage k's weights are the slice of the whole
// network's flat buffer from stage_parameter_offset, initialised from the
// whole network's seeded weights.
//
// The engine is the grid engine (grid_engine.hpp), over one Model per stage:
// a range of the whole network's executed layers (Model<Net>), or, where an
// At<...> cut splits a fused pair, a Model of the stage's own network.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/dataset.hpp"
#include "../net/model.hpp"
#include "grid_engine.hpp"
#include "partition.hpp"
#include "schedule.hpp"

namespace loom {

namespace detail {

template <class Partition, class Schedule, std::size_t... I>
constexpr bool schedule_holds_for_each(std::index_sequence<I...>) {
  return (pipeline_schedule_holds<BuiltinSchedule<Schedule::schedule.kind>,
                                  Partition::stage_counts[I], Schedule::schedule.micro_batches>() &&
          ...);
}

}  // namespace detail

// Schedule's sends and receives pair up, and its pipeline completes, over
// every stage count Partition carries (schedule_check.hpp); one that does
// not fails to compile, naming the stage, transfer and micro-batch.
template <class Partition, class Schedule>
inline constexpr bool pipeline_schedule_holds_for = detail::schedule_holds_for_each<
    Partition, Schedule>(std::make_index_sequence<Partition::stage_counts.size()>{});

template <class Partition_, class Schedule_ = OneFOneB<4>>
struct ModelSplit {
  static_assert(pipeline_schedule_holds_for<Partition_, Schedule_>,
                "ModelSplit<Partition, Schedule>: the schedule fails the pipeline schedule check "
                "over one of the partition's stage counts (see the message above)");
  using partition = Partition_;
  using schedule_type = Schedule_;
  // 0: the partition carries several stage counts (Balanced<2, 3, 4>), and
  // the devices (or processes) given pick one.
  static constexpr std::size_t stages = Partition_::stages;
  static constexpr std::size_t replicas = 1;  // Hybrid<R, ModelSplit<...>> runs R pipelines
  static constexpr std::size_t devices_needed = stages;  // 0: any of the stage counts
  static constexpr PipelineSchedule schedule = Schedule_::schedule;
  static constexpr const char* name = "ModelSplit";
};

template <class Policy>
inline constexpr bool is_model_split = false;
template <class P, class S>
inline constexpr bool is_model_split<ModelSplit<P, S>> = true;

// What one stage holds to train with a given global batch.
struct StageMemory {
  std::size_t first_layer = 0, last_layer = 0;  // user layers, 1-based, inclusive
  std::size_t parameters = 0;
  std::size_t micro_batch = 0;  // the largest micro-batch's samples
  std::size_t in_flight = 0;    // micro-batches whose activations are alive at once
  // Elements of activations, their gradients and workspace (Model's arena,
  // one set of layer outputs per micro-batch in flight) plus the received
  // inputs the stage keeps until each micro-batch's backward.
  std::size_t activation_elements = 0;
};

namespace detail {

template <class Net, class Partition, std::size_t K>
constexpr StageMemory stage_memory(PipelineSchedule schedule, std::size_t batch) {
  using StageNet = stage_net_t<Net, Partition, K>;
  constexpr auto bounds = partition_bounds<Net, Partition>::bounds;
  constexpr std::size_t stages = partition_bounds<Net, Partition>::stages;
  const std::size_t micro = std::max<std::size_t>(1, std::min(schedule.micro_batches, batch));
  StageMemory m;
  m.first_layer = bounds[K] + 1;
  m.last_layer = bounds[K + 1];
  m.parameters = StageNet::parameter_count;
  m.micro_batch = batch_share(batch, micro, 0).count;
  m.in_flight = pipeline_in_flight(schedule.kind, stages, K, micro);
  m.activation_elements = Model<StageNet, float>::activation_elements(m.micro_batch, m.in_flight) +
                          (K > 0 ? m.in_flight * m.micro_batch * StageNet::input_shape::size : 0);
  return m;
}

}  // namespace detail

// The memory plan of a pipeline: per stage, for global batches of `batch`.
template <class Net, class Policy>
constexpr std::array<StageMemory, Policy::stages> pipeline_memory_plan(
    std::size_t batch, PipelineSchedule schedule = Policy::schedule) {
  static_assert(Policy::stages > 0, "pipeline_memory_plan: a policy of one stage count (for "
                "Balanced<2, 3, 4>, plan ModelSplit<Balanced<S>> for the S that runs)");
  std::array<StageMemory, Policy::stages> plan{};
  static_for<Policy::stages>([&](auto k) {
    plan[k] = detail::stage_memory<Net, typename Policy::partition, k>(schedule, batch);
  });
  return plan;
}

// A pipelined policy's grid over `ranks` devices or processes: its own
// replica count, or (Hybrid<replicas_from_devices, ...>) `replicas`, else
// ranks over its stage count (1 when its partition carries several); its
// stage count, or (Balanced<2, 3, 4>) ranks over the replicas. Named
// ModelSplit when one replica runs.
template <class Policy>
PipelineGrid pipeline_grid(std::size_t ranks, std::size_t replicas = 0) {
  using Partition = typename Policy::partition;
  PipelineGrid grid{.policy = Policy::name,
                    .identity = detail::type_label<Policy>(),
                    .replicas = Policy::replicas,
                    .stages = Policy::stages,
                    .schedule = Policy::schedule};
  // TensorParallel: a grid of replicas x stages over each tensor group.
  constexpr bool tensor_split = requires { Policy::tensor; };
  if constexpr (tensor_split) {
    grid.tensor = Policy::tensor;
    LOOM_CHECK(ranks > 0 && ranks % grid.tensor == 0, Policy::name, " splits each layer over ",
               grid.tensor, " ranks (its tensor degree): give a multiple of ", grid.tensor,
               " devices (or processes), not ", ranks);
    ranks /= grid.tensor;
  }
  if constexpr (requires { Policy::bucket_bytes; }) grid.bucket_bytes = Policy::bucket_bytes;
  LOOM_CHECK(replicas == 0 || Policy::replicas == 0 || replicas == Policy::replicas, Policy::name,
             " runs ", Policy::replicas, " replica(s), not the ", replicas, " asked for");
  if (grid.replicas == 0) {
    if (replicas > 0) {
      grid.replicas = replicas;
    } else if (grid.stages > 0) {
      LOOM_CHECK(ranks > 0 && ranks % grid.stages == 0, Policy::name,
                 "<replicas_from_devices, ...> runs pipelines of ", grid.stages,
                 " stages, one device (or process) per stage: give a multiple of ", grid.stages,
                 ", not ", ranks);
      grid.replicas = ranks / grid.stages;
    } else {
      grid.replicas = 1;
    }
    // Hybrid<1, Split> trains as Split does, bit for bit.
    if (grid.replicas == 1 && !tensor_split) grid.policy = "ModelSplit";
  }
  // The grid engine checks that a partition of one stage count fits the
  // ranks; one of several must be among them.
  if (grid.stages == 0) {
    grid.stages = ranks / grid.replicas;
    LOOM_CHECK(ranks % grid.replicas == 0 &&
                   std::ranges::find(Partition::stage_counts, grid.stages) !=
                       Partition::stage_counts.end(),
               grid.policy, " runs pipelines of ", stage_counts_text<Partition>(),
               " stages, one device (or process) per stage, ", grid.replicas,
               grid.replicas == 1 ? " pipeline" : " pipelines", ": give ",
               grid.replicas == 1 ? std::string() : std::to_string(grid.replicas) + " x ",
               "that many devices (or processes), not ", ranks);
  }
  return grid;
}

namespace detail {

// ModelSplit and Hybrid on CPU devices, GPUs or processes: the grid engine
// over the stages of Net cut by Partition (its cut into grid.stages
// stages), each made from the whole network's initial weights on its
// rank's device, as `stages` makes them (HostStages: the CPU's;
// gpu::DeviceStages).
template <class Net, class Partition, class Optimizer, class Loss, class Stages = HostStages>
class PipelineEngine final : public GridSplitEngine<Net> {
 public:
  PipelineEngine(const std::vector<Device>& devices, comm::Comm processes,
                 const Model<Net, float>& initial, typename Optimizer::Options options,
                 PipelineGrid grid, PipelineSchedule schedule, const Stages& stages = {})
      : GridSplitEngine<Net>(grid_net<Net, Optimizer, Loss>(grid.stages, false),
                             [&](MeshCoordinates at, const Device& device) {
                               return make_stage(grid.stages, at.pipe, initial, options,
                                                 grid.bucket_bytes, device, stages);
                             },
                             devices, std::move(processes), grid, schedule) {}

  // A rank's stage weights (Hybrid: the replicas' copies stay equal).
  std::span<const float> stage_parameters(std::size_t i) {
    return this->stage(i).parameters();
  }

 private:
  static std::unique_ptr<PipelineStage> make_stage(std::size_t count, std::size_t k,
                                                   const Model<Net, float>& whole,
                                                   typename Optimizer::Options options,
                                                   std::size_t bucket_bytes, const Device& device,
                                                   const Stages& stages) {
    std::unique_ptr<PipelineStage> made;
    with_cut<Partition>(count, [&]<class Cut>() {
      constexpr auto bounds = partition_bounds<Net, Cut>::bounds;
      if constexpr (cuts_between_executed<Net>(bounds)) {
        // A range of the whole network's executed layers: the same stage
        // type as every other stage (and as DataParallel's replica).
        made = make_stage_of<Net, Optimizer>(
            whole, options, bucket_bytes, device,
            {executed_from<Net>(bounds[k]), executed_from<Net>(bounds[k + 1])}, stages);
      } else {
        // A cut splits a fused pair (Linear, ReLU): each stage fuses its own layers.
        static_for<Cut::stages>([&](auto K) {
          if (K == k)
            made = make_stage_of<stage_net_t<Net, Cut, K>, Optimizer>(
                whole, options, bucket_bytes, device, Model<stage_net_t<Net, Cut, K>>::all_layers,
                stages);
        });
      }
    });
    return made;
  }
};

}  // namespace detail
}  // namespace loom
