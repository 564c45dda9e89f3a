// The trainer types the examples build (example_main.hpp), named once: the
// examples' host side (g++) makes them, and their CUDA side (<example>_gpu.cu,
// nvcc) registers the CUDA executor of each, so that each compiler builds
// only its own backend.
#pragma once

#include <cstddef>
#include <loom/loom.hpp>
#include <type_traits>

namespace loom::examples {

// --policy split and hybrid: R pipelines of S balanced stages, one trainer
// type for every grid: the three cuts (S from 2 to 4) are made at compile
// time, and R and S are run-time values (TrainerOptions::replicas, the
// devices or processes given).
using PipelinePolicy = Hybrid<replicas_from_devices, ModelSplit<Balanced<2, 3, 4>>>;

// One trainer type per policy (and loss) for both optimizers: AnyOptimizer
// runs the one --optimizer names.
template <class Net, class Policy, class Loss = SoftmaxCrossEntropy>
using ExampleTrainer = Trainer<Net, Policy, AnyOptimizer, Loss>;

// The examples' policies, listed once for both sides.
template <class... Policies>
struct PolicyList {
  template <class Policy>
  static constexpr bool contains = (std::is_same_v<Policy, Policies> || ...);
#if defined(__CUDACC__)
  // In the example's CUDA translation unit: every example trainer of each
  // network gets the CUDA executor.
  template <class... Nets>
  static bool register_gpu_trainers() {
    return (register_net<Nets>() && ...);
  }
  template <class Net>
  static bool register_net() {
    return gpu::register_trainers<ExampleTrainer<Net, Policies>...>();
  }
#endif
};
using ExamplePolicies = PolicyList<SingleDevice, DataParallel<>, PipelinePolicy>;

}  // namespace loom::examples
