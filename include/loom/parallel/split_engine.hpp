// What a trainer asks of a grid engine whose stages hold the weights, away
// from the trainer's Model: ModelSplit and Hybrid (PipelineEngine,
// model_split.hpp) on every backend, and every policy on GPUs
// (DataParallelEngine over gpu::DeviceStages too), on worker threads, MPI
// processes or both. One interface per network, so the trainer's step,
// checkpoint and evaluation code is written once for every backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../backend/cpu/loss_sums.hpp"
#include "../core/precision.hpp"
#include "../data/dataset.hpp"
#include "../layers/layer.hpp"
#include "../net/model.hpp"
#include "crew.hpp"

namespace loom::detail {

template <class Net>
class SplitEngine {
 public:
  virtual ~SplitEngine() = default;

  // Every rank of the grid is in this process.
  virtual bool all_local() const = 0;
  // One batch of an optimizer step: the step's loss and correct-count sums
  // when `last`; a non-finite loss skips the update on every rank (the
  // caller checks).
  virtual cpu::LossSums micro_step(const float* images, const Targets& targets,
                                   std::size_t n, std::size_t group_samples, bool accumulate,
                                   bool last, const StepSettings& settings,
                                   const Pass& pass) = 0;
  // After a step that every rank skipped as non-finite: where first, when
  // the engine looked.
  virtual const NonFiniteSpot& fault() const = 0;
  virtual cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch,
                                 Precision precision) = 0;
  // The stages' weights and running statistics into the whole network, and
  // back; optimizer buffer b likewise; the optimizer's step count.
  virtual void gather(Model<Net, float>& whole) = 0;
  virtual void scatter(const Model<Net, float>& whole) = 0;
  virtual void gather_optimizer(std::size_t b, float* whole) = 0;
  virtual void scatter_optimizer(std::size_t b, const float* whole) = 0;
  virtual std::uint64_t optimizer_steps() const = 0;
  virtual void set_optimizer_steps(std::uint64_t steps) = 0;
  // Collectives over the processes (GridEngine's): the sum of `value`, and
  // every process's row.
  virtual double sum_over_ranks(double value) = 0;
  virtual std::vector<double> gather_rows(std::span<const double> row) = 0;
  // Each local rank's time in the last optimizer step.
  virtual std::vector<double> step_seconds() const = 0;
};

}  // namespace loom::detail
