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
//
// Every schedule is checked (schedule_check.hpp): ModelSplit and Hybrid
// assert their own at compile time, and check_pipeline_schedule refuses
// one chosen at run time that would deadlock.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "../core/error.hpp"
#include "schedule_check.hpp"

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

// The built-in schedules as generators (schedule_check.hpp).
template <PipelineKind Kind>
struct BuiltinSchedule {
  template <class F>
  static constexpr void for_each_op(std::size_t stages, std::size_t stage,
                                    std::size_t micro_batches, F&& f) {
    const std::size_t m = micro_batches;
    if constexpr (Kind == PipelineKind::gpipe) {
      for (std::size_t i = 0; i < m; ++i) f(PipelineOp{true, i});
      for (std::size_t i = 0; i < m; ++i) f(PipelineOp{false, i});
    } else {
      const std::size_t warmup = std::min(stages - stage - 1, m);
      for (std::size_t i = 0; i < warmup; ++i) f(PipelineOp{true, i});
      for (std::size_t i = 0; i + warmup < m; ++i) {
        f(PipelineOp{true, warmup + i});
        f(PipelineOp{false, i});
      }
      for (std::size_t i = m - warmup; i < m; ++i) f(PipelineOp{false, i});
    }
  }
};

// Calls f(PipelineOp) for each pass stage `stage` of `stages` runs over
// `micro_batches` micro-batches, in order.
template <class F>
constexpr void for_each_pipeline_op(PipelineKind kind, std::size_t stages, std::size_t stage,
                                    std::size_t micro_batches, F&& f) {
  if (kind == PipelineKind::gpipe)
    BuiltinSchedule<PipelineKind::gpipe>::for_each_op(stages, stage, micro_batches, f);
  else
    BuiltinSchedule<PipelineKind::one_f_one_b>::for_each_op(stages, stage, micro_batches, f);
}

// A schedule chosen at run time: a loom::Error unless its sends and
// receives pair up and the pipeline completes (schedule_check.hpp).
inline void check_pipeline_schedule(PipelineKind kind, std::size_t stages,
                                    std::size_t micro_batches) {
  LOOM_CHECK(stages >= 1 && micro_batches >= 1, "a ", pipeline_kind_name(kind),
             " pipeline needs at least one stage and one micro-batch, not ", stages,
             " stage(s) and ", micro_batches, " micro-batch(es)");
  const auto result =
      kind == PipelineKind::gpipe
          ? pipeline_schedule_check<BuiltinSchedule<PipelineKind::gpipe>>(stages, micro_batches)
          : pipeline_schedule_check<BuiltinSchedule<PipelineKind::one_f_one_b>>(stages,
                                                                                micro_batches);
  LOOM_CHECK(result.ok(), "the ", pipeline_kind_name(kind), " schedule over ", stages,
             " stages and ", micro_batches, " micro-batches ", describe(result));
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
