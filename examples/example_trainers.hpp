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
  // network, trained against Loss, gets the CUDA executor.
  template <class Loss, class... Nets>
  static bool register_gpu_trainers() {
    return (register_net<Loss, Nets>() && ...);
  }
  template <class Loss, class Net>
  static bool register_net() {
    return gpu::register_trainers<ExampleTrainer<Net, Policies, Loss>...>();
  }
#endif
};
using ExamplePolicies = PolicyList<SingleDevice, DataParallel<>, PipelinePolicy>;
// The GPT's besides (--policy tensor, --tensor T): its layers split over 2
// or 4 ranks, the rest data replicas or PipelinePolicy's pipelines.
using TensorPolicies =
    PolicyList<TensorParallel<2, DataParallel<>>, TensorParallel<4, DataParallel<>>,
               TensorParallel<2, PipelinePolicy>, TensorParallel<4, PipelinePolicy>>;

}  // namespace loom::examples
