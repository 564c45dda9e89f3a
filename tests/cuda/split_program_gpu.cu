// The split-program test's CUDA side (nvcc): registers the CUDA executor of
// the one trainer type the host side puts on a GPU.
#include "split_program.hpp"

namespace {
const bool registered = loom::gpu::register_trainers<split_program::Registered>();
}  // namespace
