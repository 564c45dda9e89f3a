// The network and trainer of the split-program test: named by both its
// translation units, the host compiler's (split_program_host.cpp) and nvcc's
// (split_program_gpu.cu), which registers the trainer's CUDA executor.
#pragma once

#include <loom/loom.hpp>

namespace split_program {
using Mlp = loom::Sequential<loom::Input<1, 28, 28>, loom::Flatten, loom::Linear<64>, loom::ReLU,
                             loom::Linear<10>>;
using Registered = loom::Trainer<Mlp, loom::SingleDevice, loom::SGD>;
// Not registered: a GPU must be refused with the CUDA backend's message.
using Unregistered = loom::Trainer<Mlp, loom::DataParallel<>, loom::SGD>;
}  // namespace split_program
