// The mesh: a policy's ranks (one per device; threads of one process, MPI
// processes, or both) laid out along named axes.
//
//   data    replicas: each trains on its share of every global batch, and
//           the copies of a stage sum their gradients over this axis;
//   pipe    pipeline stages: activations go forward and gradients back
//           along it;
//   tensor  the ranks that split one layer's weights (1 until tensor
//           parallelism).
//
// A policy is a mesh shape: SingleDevice 1 x 1 x 1, DataParallel<> R x 1 x 1,
// ModelSplit<...> 1 x S x 1, Hybrid<R, ModelSplit<...>> R x S x 1.
//
// Placement (Mesh::coordinates, the one function that places ranks): rank
// w = (data * pipe_extent + pipe) * tensor_extent + tensor. The tensor axis
// is innermost, since its all-reduces run inside every layer and belong on
// neighbouring devices of one node; the pipe axis next, so a replica's
// stages are neighbours and activations cross the fastest links; the data
// axis outermost, whose one reduction a step is the most latency-tolerant
// (Megatron-LM orders its groups the same way). Under mpirun with P
// processes of T threads each, rank w is process w / T, thread w % T.
//
// Each rank has a communicator per axis (MeshGroups): the ranks that differ
// from it only along that axis, ranked by their coordinate on it. They are
// split from the mesh's world communicator (LocalComm subgroups,
// MPI_Comm_split, ncclCommSplit), so a reduction over the data axis runs
// concurrently with a pipeline's sends on the pipe axis without their
// messages meeting.
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "../comm/communicator.hpp"
#include "../comm/local_comm.hpp"
#include "../core/error.hpp"

namespace loom {

enum class MeshAxis { data, pipe, tensor };

inline constexpr std::array<MeshAxis, 3> mesh_axes{MeshAxis::data, MeshAxis::pipe,
                                                   MeshAxis::tensor};

constexpr const char* axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::data:
      return "data";
    case MeshAxis::pipe:
      return "pipe";
    case MeshAxis::tensor:
      return "tensor";
  }
  return "?";
}

// A rank's place on the mesh.
struct MeshCoordinates {
  std::size_t data = 0, pipe = 0, tensor = 0;

  constexpr std::size_t operator[](MeshAxis axis) const {
    return axis == MeshAxis::data ? data : axis == MeshAxis::pipe ? pipe : tensor;
  }
  constexpr bool operator==(const MeshCoordinates&) const = default;
};

struct Mesh {
  std::size_t data = 1, pipe = 1, tensor = 1;

  constexpr std::size_t size() const { return data * pipe * tensor; }
  constexpr std::size_t extent(MeshAxis axis) const {
    return axis == MeshAxis::data ? data : axis == MeshAxis::pipe ? pipe : tensor;
  }
  constexpr bool operator==(const Mesh&) const = default;

  // Where rank w sits (see the placement at the top of this file).
  constexpr MeshCoordinates coordinates(std::size_t rank) const {
    return {rank / (pipe * tensor), rank / tensor % pipe, rank % tensor};
  }
  constexpr std::size_t rank(MeshCoordinates at) const {
    return (at.data * pipe + at.pipe) * tensor + at.tensor;
  }

  // The group along `axis` that rank w belongs to, numbered by the other
  // two coordinates (the color of its split), and w's rank in it (the key).
  constexpr std::size_t group(std::size_t rank, MeshAxis axis) const {
    const MeshCoordinates at = coordinates(rank);
    switch (axis) {
      case MeshAxis::data:
        return at.pipe * tensor + at.tensor;
      case MeshAxis::pipe:
        return at.data * tensor + at.tensor;
      case MeshAxis::tensor:
        return at.data * pipe + at.pipe;
    }
    return 0;
  }
  constexpr std::size_t rank_in_group(std::size_t rank, MeshAxis axis) const {
    return coordinates(rank)[axis];
  }

  // "data 2 x pipe 2 x tensor 1"
  std::string describe() const {
    std::string text;
    for (const MeshAxis axis : mesh_axes)
      text += std::string(text.empty() ? "" : " x ") + axis_name(axis) + ' ' +
              std::to_string(extent(axis));
    return text;
  }
};

static_assert(Mesh{2, 3, 1}.coordinates(4) == MeshCoordinates{1, 1, 0});
static_assert(Mesh{2, 2, 2}.rank(Mesh{2, 2, 2}.coordinates(5)) == 5);
static_assert(Mesh{2, 2, 2}.group(5, MeshAxis::data) == 1 &&
              Mesh{2, 2, 2}.group(1, MeshAxis::data) == 1);

// A rank's communicators: the whole mesh, and its group along each axis
// (rank in it = its coordinate on that axis).
struct MeshGroups {
  comm::Comm world, data, pipe, tensor;

  comm::Comm& along(MeshAxis axis) {
    return axis == MeshAxis::data ? data : axis == MeshAxis::pipe ? pipe : tensor;
  }
};

// Splits `world` (rank w = mesh rank w; collective over it) into the groups
// of `mesh` along each axis. Every rank makes the same calls in the same
// order, so the splits pair up on every backend. An axis of extent 1 is a
// group of one of its own (no collective); every other axis is a
// communicator of its own, even one that spans the whole mesh, since its
// calls (a reducer thread's all-reduces, an outbox thread's sends) run
// while the rank's own thread calls the world's collectives.
inline MeshGroups split_mesh(comm::Comm world, const Mesh& mesh) {
  LOOM_CHECK(static_cast<std::size_t>(world.size()) == mesh.size(), "the mesh ", mesh.describe(),
             " has ", mesh.size(), " ranks but its communicator has ", world.size());
  const auto w = static_cast<std::size_t>(world.rank());
  MeshGroups groups;
  for (const MeshAxis axis : mesh_axes)
    groups.along(axis) =
        mesh.extent(axis) == 1
            ? comm::Comm(std::move(comm::LocalComm::create(1).front()))
            : world.split(static_cast<int>(mesh.group(w, axis)),
                          static_cast<int>(mesh.rank_in_group(w, axis)));
  groups.world = std::move(world);
  return groups;
}

}  // namespace loom
