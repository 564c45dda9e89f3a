// A callback that ends Trainer::fit after optimizer step k (Trainer::stop),
// as a preempted run would: the tests of checkpoints and resume use it.
#pragma once

#include <cstdint>
#include <loom/train/trainer.hpp>

namespace loom::test {

struct StopAfter {
  std::uint64_t k;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() == k) trainer.stop();
  }
};

}  // namespace loom::test
