// The LeNet example's CUDA side, compiled by nvcc: the CUDA executor of
// each trainer the example (compiled by the host compiler) builds.
#include "example_trainers.hpp"
#include "networks.hpp"

namespace {
using loom::examples::ExamplePolicies;
const bool registered =
    ExamplePolicies::register_gpu_trainers<loom::SoftmaxCrossEntropy, loom::examples::LeNet>();
}  // namespace
