// CTCLoss: connectionist temporal classification, for a network that outputs
// Frames x Classes scores per sample (class 0 the blank, labels 1..Classes-1)
// trained against a label sequence per sample. Each sample's loss is divided
// by its target length and the mean taken over samples, as PyTorch's
// ctc_loss(reduction='mean'); frames past a sample's length (Targets::frames)
// take no part and get no gradient. Its error rate is the edit distance of
// the greedy decoding to the reference, over the reference labels; `correct`
// counts the samples decoded exactly.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../backend/cpu/ctc.hpp"
#include "../core/error.hpp"
#include "../core/targets.hpp"
#include "loss.hpp"

namespace loom {

// ZeroInfinity: a target that needs more frames than its sample has adds
// zero loss and gradient (PyTorch's zero_infinity=True) instead of raising a
// loom::Error that names the sample.
template <bool ZeroInfinity_ = false>
struct CTC {
  using Sums = cpu::LossSums;
  static constexpr bool zero_infinity = ZeroInfinity_;
  static constexpr const char* name = ZeroInfinity_ ? "CTCLoss(zero_infinity)" : "CTCLoss";
  static constexpr TargetKind target = TargetKind::label_sequence;
  static constexpr const char* error_rate = "label error rate";
  // Compiles only for an output it suits (the Trainer calls it).
  template <class Out>
  static consteval bool fits() {
    static_assert(Out::rank == 2 && Out::dims[1] >= 2,
                  "CTCLoss trains Frames x Classes scores per sample (class 0 the blank, so at "
                  "least 2): end the network with a per-frame Linear<classes> over "
                  "Input<Frames, Features>");
    return true;
  }

  // A sample's frames: its length (Targets::frames), at most the output's.
  template <class Out>
  static std::int32_t frames_of(const Targets& targets, std::size_t i) {
    constexpr auto max_frames = static_cast<std::int32_t>(Out::dims[0]);
    return targets.frames == nullptr ? max_frames : std::min(targets.frames[i], max_frames);
  }

  // Before training: every target fits its sample's frames (a label
  // repeated in a row needs a blank between, so a frame more), or a
  // loom::Error names the first sample that does not.
  template <class Out>
  static void check_targets(const Targets& targets, std::size_t count) {
    if constexpr (zero_infinity) return;
    for (std::size_t i = 0; i < count; ++i) {
      const std::int32_t* target = targets.sequences + i * targets.max_target;
      const std::int32_t length = targets.sequence_lengths[i];
      std::int32_t repeats = 0;
      for (std::int32_t k = 1; k < length; ++k) repeats += target[k] == target[k - 1] ? 1 : 0;
      const std::int32_t frames = frames_of<Out>(targets, i);
      LOOM_CHECK(length + repeats <= frames, name, ": sample ", i, " has a target of ", length,
                 " labels (", repeats, " repeated in a row, each needing a blank between) that "
                 "needs ", length + repeats, " frames, but the sample has ", frames,
                 "; shorten its target, give it more frames, or train with CTC<true> "
                 "(zero_infinity), which gives such samples zero loss");
    }
  }

  template <class Out, class T>
  static Sums compute(const T* logits, std::size_t n, const Targets& targets, T grad_scale,
                      T* dlogits) {
    constexpr std::size_t max_frames = Out::dims[0], classes = Out::dims[1];
    LOOM_CHECK(targets.sequences != nullptr && targets.sequence_lengths != nullptr, name,
               " trains against a label sequence per sample, but the batch has none; give the "
               "data set targets and target_lengths");
    // Kept per thread: a step allocates nothing once warm.
    thread_local std::vector<std::int32_t> usable;
    thread_local std::vector<std::vector<std::int32_t>> decoded;
    usable.resize(n);
    for (std::size_t i = 0; i < n; ++i) usable[i] = frames_of<Out>(targets, i);
    const std::int32_t* frames = usable.data();
    const auto ctc = cpu::ctc_loss(logits, n, max_frames, classes, frames, targets.sequences,
                                   targets.max_target, targets.sequence_lengths, grad_scale,
                                   dlogits, zero_infinity, 0);
    Sums sums;
    sums.loss = ctc.loss;
    sums.denominator = static_cast<double>(n);
    cpu::greedy_decode(logits, n, max_frames, classes, frames, decoded);
    for (std::size_t i = 0; i < n; ++i) {
      const std::span<const std::int32_t> reference(
          targets.sequences + i * targets.max_target,
          static_cast<std::size_t>(targets.sequence_lengths[i]));
      const std::size_t edits = cpu::edit_distance(decoded[i], reference);
      sums.errors += static_cast<double>(edits);
      sums.references += static_cast<double>(reference.size());
      sums.correct += edits == 0 ? 1 : 0;
    }
    return sums;
  }
};

using CTCLoss = CTC<>;

}  // namespace loom
