// The trainer types the examples build (example_main.hpp), named once: the
// examples' host side (g++) makes them, and their CUDA side (<example>_gpu.cu,
// nvcc) registers the CUDA executor of each, so that each compiler builds
// only its own backend.
#pragma once

#include <cstddef>
#include <loom/loom.hpp>
#include <type_traits>

namespace loom::examples {

// --policy split and hybrid: R pipelines of S balanced stages (S from 2 to
// 4: each cut is a type of its own; R is a run-time value).
template <std::size_t S>
using PipelinePolicy = Hybrid<replicas_from_devices, ModelSplit<Balanced<S>>>;

// One trainer type per policy for both optimizers: AnyOptimizer runs the one
// --optimizer names.
template <class Net, class Policy>
using ExampleTrainer = Trainer<Net, Policy, AnyOptimizer>;

template <class Policy>
inline constexpr bool example_policy =
    std::is_same_v<Policy, SingleDevice> || std::is_same_v<Policy, DataParallel<>> ||
    std::is_same_v<Policy, PipelinePolicy<2>> || std::is_same_v<Policy, PipelinePolicy<3>> ||
    std::is_same_v<Policy, PipelinePolicy<4>>;

#if defined(__CUDACC__)
// In the example's CUDA translation unit: every example trainer of each
// network gets the CUDA executor.
template <class... Nets>
bool register_gpu_trainers() {
  return (gpu::register_trainers<ExampleTrainer<Nets, SingleDevice>,
                                 ExampleTrainer<Nets, DataParallel<>>,
                                 ExampleTrainer<Nets, PipelinePolicy<2>>,
                                 ExampleTrainer<Nets, PipelinePolicy<3>>,
                                 ExampleTrainer<Nets, PipelinePolicy<4>>>() &&
          ...);
}
#endif

}  // namespace loom::examples
