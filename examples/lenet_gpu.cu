// The LeNet example's CUDA side, compiled by nvcc: the CUDA executor of
// each trainer the example (compiled by the host compiler) builds.
#include "example_trainers.hpp"
#include "networks.hpp"

namespace {
const bool registered = loom::examples::register_gpu_trainers<loom::examples::LeNet>();
}  // namespace
