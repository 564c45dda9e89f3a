// Pipeline schedules: in which order a stage runs the forward and backward
// passes of a step's micro-batches.
//
//   GPipe<M>:    every forward, then every backward. Simple; a stage keeps
//                all M micro-batches' activations until their backward.
//   OneFOneB<M>: stage k (of S) runs S - k - 1 forwards to fill the pipeline,
//                then alternates one forward and one backward, then drains.
//                The same bubble as GPipe, but at most S - k micro-batches
//                are alive on stage k at once.
//
// Both run the backwards in micro-batch order, which is the order the
// gradients arrive in, and both leave the idle fraction of an ideal
// pipeline of equal stages at (S - 1) / (M + S - 1).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace loom {

enum class PipelineKind { gpipe, one_f_one_b };

inline const char* pipeline_kind_name(PipelineKind kind) {
  return kind == PipelineKind::gpipe ? "GPipe" : "1F1B";
}

// A schedule chosen at run time (TrainerOptions::schedule, the examples'
// --schedule and --micro-batches); micro_batches 0: the policy's.
struct PipelineSchedule {
  PipelineKind kind = PipelineKind::one_f_one_b;
  std::size_t micro_batches = 0;
};

template <std::size_t M>
struct GPipe {
  static_assert(M >= 1, "loom ModelSplit error: GPipe<M> needs at least one micro-batch");
  static constexpr PipelineSchedule schedule{PipelineKind::gpipe, M};
};

template <std::size_t M>
struct OneFOneB {
  static_assert(M >= 1, "loom ModelSplit error: OneFOneB<M> needs at least one micro-batch");
  static constexpr PipelineSchedule schedule{PipelineKind::one_f_one_b, M};
};

struct PipelineOp {
  bool forward = true;
  std::size_t micro_batch = 0;
};

// Calls f(PipelineOp) for each pass stage `stage` of `stages` runs over
// `micro_batches` micro-batches, in order.
template <class F>
constexpr void for_each_pipeline_op(PipelineKind kind, std::size_t stages, std::size_t stage,
                                    std::size_t micro_batches, F&& f) {
  const std::size_t m = micro_batches;
  if (kind == PipelineKind::gpipe) {
    for (std::size_t i = 0; i < m; ++i) f(PipelineOp{true, i});
    for (std::size_t i = 0; i < m; ++i) f(PipelineOp{false, i});
    return;
  }
  const std::size_t warmup = std::min(stages - stage - 1, m);
  for (std::size_t i = 0; i < warmup; ++i) f(PipelineOp{true, i});
  for (std::size_t i = 0; i + warmup < m; ++i) {
    f(PipelineOp{true, warmup + i});
    f(PipelineOp{false, i});
  }
  for (std::size_t i = m - warmup; i < m; ++i) f(PipelineOp{false, i});
}

inline std::vector<PipelineOp> pipeline_ops(PipelineKind kind, std::size_t stages,
                                            std::size_t stage, std::size_t micro_batches) {
  std::vector<PipelineOp> ops;
  ops.reserve(2 * micro_batches);
  for_each_pipeline_op(kind, stages, stage, micro_batches,
                       [&](PipelineOp op) { ops.push_back(op); });
  return ops;
}

// Micro-batches whose activations stage `stage` holds at once: GPipe all M,
// 1F1B at most S - stage.
constexpr std::size_t pipeline_in_flight(PipelineKind kind, std::size_t stages, std::size_t stage,
                                         std::size_t micro_batches) {
  return kind == PipelineKind::gpipe ? micro_batches
                                     : std::min(micro_batches, stages - stage);
}

// The idle fraction of a pipeline of equal stages with free communication.
constexpr double ideal_bubble(std::size_t stages, std::size_t micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace loom
