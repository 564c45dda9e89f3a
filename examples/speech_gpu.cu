// The speech example's CUDA side, compiled by nvcc: the CUDA executor of
// each trainer the example (compiled by the host compiler) builds, CTC's
// loss included.
#include "example_trainers.hpp"
#include "speech_network.hpp"

namespace {
using loom::examples::ExamplePolicies;
const bool registered =
    ExamplePolicies::register_gpu_trainers<loom::CTCLoss, loom::examples::DigitReader>();
}  // namespace
