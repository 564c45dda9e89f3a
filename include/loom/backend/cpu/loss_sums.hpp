// What every loss sums over a batch's samples, whatever the loss: the
// engines add these up over replicas and micro-batches, the trainer turns
// them into the means and rates it reports.
#pragma once

#include <cstddef>

namespace loom::cpu {

// What a loss sums over samples; the trainer divides by the samples for the
// means it reports.
struct LossSums {
  double loss = 0.0;        // sum over the samples of each one's loss (softmax: -log p[label])
  std::size_t correct = 0;  // samples predicted exactly (softmax: arg-max is the label, first max wins)
  // An error rate's sums where the loss defines one (CTC: edits of the
  // greedy decoding, and the reference labels); references 0: none.
  double errors = 0.0;
  double references = 0.0;
  bool overflowed = false;  // a training step's: its scaled gradients overflowed, it was skipped
};

}  // namespace loom::cpu
