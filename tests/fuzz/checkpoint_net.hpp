// The network whose checkpoints fuzz_checkpoint.cpp loads and make_seeds.cpp
// writes: LeNet's layer kinds (with a BatchNorm2d for running statistics), on
// few channels so that a checkpoint, with SGD's momentum, stays a few KB.
#pragma once

#include <loom/loom.hpp>

namespace loom::fuzz {

using CheckpointNet = Sequential<Input<1, 28, 28>, Conv2d<1, 5>, BatchNorm2d, ReLU, MaxPool2d<2>,
                                 Conv2d<2, 5>, ReLU, MaxPool2d<2>, Flatten, Linear<10>>;
using CheckpointTrainer = Trainer<CheckpointNet, SingleDevice, SGD>;

inline CheckpointTrainer make_checkpoint_trainer() {
  return CheckpointTrainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f});
}

}  // namespace loom::fuzz
