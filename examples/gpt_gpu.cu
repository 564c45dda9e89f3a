// The GPT example's CUDA side, compiled by nvcc: the CUDA executor of each
// trainer the example (compiled by the host compiler) builds, its weights
// tied or not, under the examples' policies and the tensor-parallel ones.
#include "example_trainers.hpp"
#include "gpt_network.hpp"

namespace {
using loom::PositionCrossEntropy;
using loom::examples::BabyGpt;
using loom::examples::BabyGptTied;
const bool registered =
    loom::examples::ExamplePolicies::register_gpu_trainers<PositionCrossEntropy, BabyGpt,
                                                           BabyGptTied>() &&
    loom::examples::TensorPolicies::register_gpu_trainers<PositionCrossEntropy, BabyGpt,
                                                          BabyGptTied>();
}  // namespace
