// PositionCrossEntropy: cross-entropy of softmax(scores) at every output
// position of a Positions x Classes output, against one class per position
// (PyTorch's CrossEntropyLoss over (N, C, T) with ignore_index, reduction
// 'mean'). A position counts when its label is >= 0 and it lies inside its
// sample's valid frames (Targets::frames at the output); the others add no
// loss and get no gradient. The mean is over the counted positions of the
// whole optimizer step (Denominator::positions), so a short sample weighs
// less than a long one, on every policy alike; `correct` counts the counted
// positions whose arg-max (first max wins) is the label.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../core/error.hpp"
#include "../core/targets.hpp"
#include "loss.hpp"

namespace loom {

struct PositionCrossEntropy {
  using Sums = cpu::LossSums;
  static constexpr const char* name = "PositionCrossEntropy";
  static constexpr TargetKind target = TargetKind::class_per_position;
  static constexpr Denominator denominator = Denominator::positions;
  static constexpr const char* error_rate = nullptr;
  // Compiles only for an output it suits (the Trainer calls it).
  template <class Out>
  static consteval bool fits() {
    static_assert(Out::rank == 2 && Out::dims[1] >= 2,
                  "PositionCrossEntropy trains Positions x Classes scores per sample (at least "
                  "2 classes): end the network with a per-position Linear<classes> over "
                  "Positions x Features");
    return true;
  }
  // A softmax of each position's scores against its label
  // (LossOps::softmax_rows): what a GPU runs on the device.
  static constexpr bool position_softmax = true;

  // A sample's valid positions: its frames at the output, at most the output's.
  template <class Out>
  static std::size_t positions_of(const Targets& targets, std::size_t i) {
    constexpr auto positions = static_cast<std::int32_t>(Out::dims[0]);
    return static_cast<std::size_t>(
        targets.frames == nullptr ? positions : std::clamp(targets.frames[i], 0, positions));
  }

  // Before training: the targets hold a class per output position, each
  // below the output's classes (or < 0: ignored); a loom::Error names the
  // first sample and position that is not.
  template <class Out>
  static void check_targets(const Targets& targets, std::size_t count) {
    constexpr std::size_t positions = Out::dims[0], classes = Out::dims[1];
    LOOM_CHECK(targets.sequences != nullptr && targets.max_target == positions, name,
               ": the targets hold ", targets.max_target, " labels per sample but the network "
               "outputs ", positions, " positions; give one class per output position");
    for (std::size_t i = 0; i < count; ++i)
      for (std::size_t p = 0; p < positions; ++p) {
        const std::int32_t label = targets.sequences[i * positions + p];
        LOOM_CHECK(label < static_cast<std::int32_t>(classes), name, ": sample ", i,
                   " has label ", label, " at position ", p, " but the network outputs ",
                   classes, " classes; expected 0..", classes - 1, " (or < 0: ignored)");
      }
  }

  // The sums over n samples; with dlogits, the gradient of the summed loss
  // times grad_scale (the engines divide by the step's positions after).
  template <class Out, class T>
  static Sums compute(const T* logits, std::size_t n, const Targets& targets, T grad_scale,
                      T* dlogits) {
    constexpr std::size_t positions = Out::dims[0], classes = Out::dims[1];
    LOOM_CHECK(targets.sequences != nullptr && targets.max_target == positions, name,
               " trains against one class per output position (", positions,
               "), but the batch has ", targets.max_target,
               " per sample; give the data set targets with max_target ", positions);
    if (dlogits != nullptr) std::fill_n(dlogits, n * positions * classes, T(0));
    Sums sums;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t valid = positions_of<Out>(targets, i);
      for (std::size_t p = 0; p < valid; ++p) {
        const std::int32_t label = targets.sequences[i * positions + p];
        if (label < 0) continue;
        LOOM_CHECK(label < static_cast<std::int32_t>(classes), name, ": sample ", i,
                   " has label ", label, " at position ", p, "; expected 0..", classes - 1);
        const T* row = logits + (i * positions + p) * classes;
        std::size_t best = 0;
        for (std::size_t c = 1; c < classes; ++c) best = row[c] > row[best] ? c : best;
        const T top = row[best];
        // Each exponential once: kept in the gradient's row where there is one.
        T* grad = dlogits != nullptr ? dlogits + (i * positions + p) * classes : nullptr;
        T total = 0;
        for (std::size_t c = 0; c < classes; ++c) {
          const T e = std::exp(row[c] - top);
          if (grad != nullptr) grad[c] = e;
          total += e;
        }
        const auto k = static_cast<std::size_t>(label);
        sums.loss += static_cast<double>(std::log(total) - (row[k] - top));
        sums.denominator += 1.0;
        sums.correct += best == k ? 1 : 0;
        if (grad == nullptr) continue;
        for (std::size_t c = 0; c < classes; ++c)
          grad[c] = grad_scale * (grad[c] / total - (c == k ? T(1) : T(0)));
      }
    }
    return sums;
  }
};

}  // namespace loom
