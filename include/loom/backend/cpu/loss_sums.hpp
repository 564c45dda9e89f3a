// What every loss sums over a batch's samples, whatever the loss: the
// engines add these up over replicas and micro-batches, the trainer turns
// them into the means and rates it reports.
#pragma once

#include <cstddef>

namespace loom::cpu {

// What a loss sums over a batch; the trainer divides by the denominator for
// the means it reports.
struct LossSums {
  double loss = 0.0;        // sum over the samples of each one's loss (softmax: -log p[label])
  // Predicted exactly, in the denominator's units (softmax: samples whose
  // arg-max is the label, first max wins; PositionCrossEntropy: positions).
  std::size_t correct = 0;
  // An error rate's sums where the loss defines one (CTC: edits of the
  // greedy decoding, and the reference labels); references 0: none.
  double errors = 0.0;
  double references = 0.0;
  bool overflowed = false;  // a training step's: its scaled gradients overflowed, it was skipped
  // What the loss's mean divides by (loss/loss.hpp, Denominator): the
  // samples for a per-sample loss, the counted positions for
  // PositionCrossEntropy; accuracy is correct over it too. Last, so that
  // code that lists the fields before it keeps its meaning (the GPU
  // executors' sums leave it 0: they train per-sample losses, whose
  // reports divide by the samples).
  double denominator = 0.0;
};

}  // namespace loom::cpu
