// Hybrid<R, ModelSplit<Partition, Schedule>>: data and model parallelism at
// once. The devices form a grid of R replicas x S stages; each replica is a
// pipeline (ModelSplit's stages and schedule) that trains on its share of
// every global batch, and stage k's gradients are summed over the R copies
// of stage k only (a communicator split per stage: LocalComm::split,
// MPI_Comm_split), bucket by bucket as the stage's last backward of the step
// finishes them, as DataParallel does.
//
// Placement: rank w of the grid (device w, or MPI process w; or thread
// w % T of process w / T with T devices each) is replica w / S, stage
// w % S (Mesh::coordinates, mesh.hpp), so each replica's stages are neighbouring devices
// (on a multi-GPU node, activations cross the fastest links) and the copies
// of a stage are S apart. Trainer::placement() lists it; callbacks::Progress
// prints it when fit() begins.
//
// Exactness: as in DataParallel, every micro-batch's loss gradient is scaled
// by 1/(global batch), so the summed gradient is the global mean whatever
// the shares. Hybrid<1, Split> trains as Split does, bit for bit, and
// Hybrid<R, ModelSplit<At<>, GPipe<1>>> (one stage, one micro-batch) as
// DataParallel over R devices.
//
// Hybrid<replicas_from_devices, Split> takes its replica count at run time:
// the devices (or MPI processes) given, divided by Split's stages. Every
// grid over one stage cut is then one Trainer type, and every pipelined
// policy over one cut (ModelSplit, any Hybrid) runs one engine type: the
// replica count, schedule and bucket size are values (PipelineGrid).
#pragma once

#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "../core/device.hpp"
#include "data_parallel.hpp"
#include "mesh.hpp"
#include "model_split.hpp"

namespace loom {

inline constexpr std::size_t replicas_from_devices = 0;

namespace detail {

// Anything but a ModelSplit has no schedule to check: Hybrid says what Split must be.
template <class Split>
inline constexpr bool split_schedule_holds = true;
template <class P, class S>
inline constexpr bool split_schedule_holds<ModelSplit<P, S>> = pipeline_schedule_holds_for<P, S>;

}  // namespace detail

template <std::size_t Replicas, class Split, std::size_t BucketBytes = default_bucket_bytes>
struct Hybrid {
  static_assert(is_model_split<Split>,
                "Hybrid<R, Split>: Split must be a ModelSplit<Partition, Schedule>, the pipeline "
                "each replica runs");
  // The check ModelSplit has made (instantiated once): every replica runs its pipeline.
  static_assert(detail::split_schedule_holds<Split>,
                "Hybrid<R, Split>: Split's schedule fails the pipeline schedule check (see the "
                "message above)");
  using split = Split;
  using partition = typename Split::partition;
  using schedule_type = typename Split::schedule_type;
  static constexpr std::size_t replicas = Replicas;  // 0: replicas_from_devices
  static constexpr std::size_t stages = Split::stages;  // 0: one of the partition's, at run time
  // 0: any grid of Replicas (any count, with replicas_from_devices) x a stage count
  static constexpr std::size_t devices_needed = Replicas * stages;
  static constexpr PipelineSchedule schedule = Split::schedule;
  static constexpr std::size_t bucket_bytes = BucketBytes;
  static constexpr const char* name = "Hybrid";
};

template <class Policy>
inline constexpr bool is_hybrid = false;
template <std::size_t R, class S, std::size_t B>
inline constexpr bool is_hybrid<Hybrid<R, S, B>> = true;

// TensorParallel<T, Inner> (tensor_parallel.hpp, which specialises this).
template <class Policy>
inline constexpr bool is_tensor_parallel = false;

// The policies whose ranks run pipelines (ModelSplit is Hybrid with R = 1;
// TensorParallel runs its inner policy's grid over each tensor group).
template <class Policy>
inline constexpr bool is_pipelined =
    is_model_split<Policy> || is_hybrid<Policy> || is_tensor_parallel<Policy>;

// What one device (or process) of a policy holds.
struct Placement {
  std::size_t rank = 0;     // in the mesh (Mesh::rank of its coordinates)
  std::size_t replica = 0;  // DataParallel/Hybrid: which copy
  std::size_t stage = 0;    // ModelSplit/Hybrid: which pipeline stage
  std::size_t tensor = 0;   // TensorParallel: which share of each split layer
  std::size_t tensor_ranks = 1;  // TensorParallel: the ranks that split each layer
  std::size_t first_layer = 0, last_layer = 0;  // user layers, 1-based, inclusive
  std::string device;  // its name, or "process w" for another MPI process's
};

// The placement of Net under Policy on `devices` (or, with `processes` > 0,
// across MPI processes with `devices` each, this one `process`); rank w
// sits where Mesh::coordinates puts it, on process w / T, thread w % T (T
// devices a process). `grid_replicas`: Hybrid<replicas_from_devices,
// ...>'s replica count, as pipeline_grid takes it. `process_devices`:
// across processes of one device each, each one's device by rank, when
// known (else only this process's are named).
template <class Net, class Policy>
std::vector<Placement> placement(const std::vector<Device>& devices, std::size_t processes = 0,
                                 std::size_t process = 0, std::size_t grid_replicas = 0,
                                 const std::vector<std::string>& process_devices = {}) {
  const std::size_t ranks = processes > 0 ? processes * devices.size() : devices.size();
  Mesh mesh{.data = ranks};
  std::vector<std::size_t> starts{0, Net::layer_count};  // stage k: layers starts[k] + 1 ...
  if constexpr (is_pipelined<Policy>) {
    const auto grid = pipeline_grid<Policy>(ranks, grid_replicas);
    mesh = {.data = grid.replicas, .pipe = grid.stages, .tensor = grid.tensor};
    starts = cut_bounds<Net, typename Policy::partition>(grid.stages);
  } else if constexpr (!is_data_parallel<Policy>) {
    mesh = {};
  }
  const std::size_t threads = devices.size();
  std::vector<Placement> out;
  for (std::size_t w = 0; w < mesh.size(); ++w) {
    const MeshCoordinates at = mesh.coordinates(w);
    Placement p;
    p.rank = w;
    p.replica = at.data;
    p.stage = at.pipe;
    p.tensor = at.tensor;
    p.tensor_ranks = mesh.tensor;
    p.first_layer = starts[p.stage] + 1;
    p.last_layer = starts[p.stage + 1];
    if (processes == 0) {
      p.device = w < devices.size() ? devices[w].name() : "(missing)";
    } else if (threads > 1) {
      p.device = "process " + std::to_string(w / threads) + " thread " +
                 std::to_string(w % threads);
      if (w / threads == process) p.device += ": " + devices[w % threads].name();
    } else if (w < process_devices.size()) {
      p.device = "process " + std::to_string(w) + ": " + process_devices[w];
    } else {
      p.device = w == process ? "process " + std::to_string(w) + ": " + devices.front().name()
                              : "process " + std::to_string(w);
    }
    out.push_back(p);
  }
  return out;
}

// One line per device: "  cpu:2  replica 1  stage 0  layers 1-6" (and,
// split over tensor ranks, "  tensor 1 of 2" before the layers).
inline std::string describe_placement(const std::vector<Placement>& places) {
  std::ostringstream text;
  for (const auto& p : places) {
    text << "  " << p.device << "  replica " << p.replica << "  stage " << p.stage;
    if (p.tensor_ranks > 1) text << "  tensor " << p.tensor << " of " << p.tensor_ranks;
    text << "  layers " << p.first_layer << '-' << p.last_layer << '\n';
  }
  return text.str();
}

}  // namespace loom
