// The CUDA executor of a Trainer: what the trainer asks of GPUs
// (detail::GpuExecutor). Every policy runs on the grid engine over GPU
// stages (gpu/stage.cuh): SingleDevice and DataParallel as the CPU's
// DataParallelEngine, ModelSplit and Hybrid as its PipelineEngine,
// TensorParallel as its TensorEngine, each with gpu::DeviceStages.
// loom.hpp includes it when nvcc compiles; a Trainer finds it by
// make_gpu_executor, so that train/ never names CUDA and the host compiler
// never sees this file.
#pragma once

#include <memory>
#include <type_traits>

#include "../train/trainer.hpp"
#include "stage.cuh"

namespace loom {
namespace gpu {

template <class Trainer>
class TrainerExecutor final : public ::loom::detail::GpuExecutor<Trainer> {
 public:
  TrainerExecutor() = default;

 private:
  using Net = typename Trainer::Net;
  using Policy = typename Trainer::Policy;
  using Optimizer = typename Trainer::Optimizer;
  using Loss = typename Trainer::Loss;

  static auto engine_type() {
    if constexpr (is_tensor_parallel<Policy>)
      return static_cast<
          ::loom::detail::TensorEngine<Net, Policy, Optimizer, Loss, DeviceStages>*>(nullptr);
    else if constexpr (is_pipelined<Policy>)
      return static_cast<::loom::detail::PipelineEngine<Net, typename Policy::partition, Optimizer,
                                                        Loss, DeviceStages>*>(nullptr);
    else
      return static_cast<
          ::loom::detail::DataParallelEngine<Net, Policy, Optimizer, Loss, DeviceStages>*>(
          nullptr);
  }
  using Engine = std::remove_pointer_t<decltype(engine_type())>;

  ::loom::detail::SplitEngine<Net>* split() const override { return engine_.get(); }

  // Made at the first fit() or evaluate() (the stages grow with the batches
  // they are given), from the trainer's model_ and optimizer_ (a fresh
  // optimizer's zeros, or a loaded checkpoint's state).
  void plan_split(Trainer& t) override {
    if (engine_) return;
    t.host_changed_ = false;
    const DeviceStages stages{.precision = t.options_.precision,
                              .allow_tf32 = t.options_.allow_tf32,
                              .synced_statistics = is_data_parallel<Policy> && Net::syncs};
    std::unique_ptr<Engine> made;
    if constexpr (is_pipelined<Policy>)
      made = std::make_unique<Engine>(t.devices_, t.processes_, t.model_, t.optimizer_.options(),
                                      t.grid_, t.options_.schedule, stages);
    else
      made = std::make_unique<Engine>(t.devices_, t.processes_, t.model_, t.optimizer_.options(),
                                      stages);
    for (std::size_t b = 0; b < t.optimizer_.buffer_count(); ++b)
      made->scatter_optimizer(b, t.optimizer_.buffer(b).data());
    made->set_optimizer_steps(t.optimizer_.steps());
    engine_ = std::move(made);
  }

  std::unique_ptr<Engine> engine_;
};

}  // namespace gpu

// Found by the Trainer's constructor (argument-dependent lookup) in a
// program nvcc compiles.
template <class Net, class Policy, class Optimizer, class Loss>
std::unique_ptr<detail::GpuExecutor<Trainer<Net, Policy, Optimizer, Loss>>> make_gpu_executor(
    Trainer<Net, Policy, Optimizer, Loss>&) {
  return std::make_unique<gpu::TrainerExecutor<Trainer<Net, Policy, Optimizer, Loss>>>();
}

namespace gpu {

// For a program whose trainers the host compiler builds: its CUDA
// translation unit (nvcc, including <loom/loom.hpp>) registers the CUDA
// executor of each trainer type the program puts on GPUs, before any is
// made, e.g. at static initialisation:
//
//   static const bool registered = loom::gpu::register_trainers<Trainer<Net>>();
//
// That unit compiles the GPU side alone (the trainers' CPU engines are not
// instantiated there). It must not construct those trainers itself: there
// the constructor finds make_gpu_executor, and would differ from the host's.
template <class... Trainers>
bool register_trainers() {
  ((::loom::detail::gpu_executor_factory<Trainers> =
        []() -> std::unique_ptr<::loom::detail::GpuExecutor<Trainers>> {
          return std::make_unique<TrainerExecutor<Trainers>>();
        }),
   ...);
  return true;
}

}  // namespace gpu
}  // namespace loom
