// What a batch's samples train against, as a view from its first sample. A
// loss names which of these it reads (its TargetKind); the loader gathers
// them and the engines hand each micro-batch its slice.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom {

enum class TargetKind {
  class_label,     // one class per sample (SoftmaxCrossEntropy)
  label_sequence,  // a sequence of labels per sample, with its length (CTCLoss)
  // One class per output position (PositionCrossEntropy): max_target (the
  // output's positions) labels per sample in Targets::sequences, no
  // lengths; a label < 0 is ignored.
  class_per_position,
};

inline constexpr const char* target_kind_name(TargetKind kind) {
  switch (kind) {
    case TargetKind::class_label: return "one class per sample";
    case TargetKind::label_sequence: return "a label sequence per sample";
    case TargetKind::class_per_position: return "one class per position";
  }
  return "?";
}

struct Targets {
  const std::int32_t* labels = nullptr;  // class_label: one per sample
  // label_sequence: max_target labels per sample (the unused ones padding)
  // and each sample's length; class_per_position: max_target labels per
  // sample, one per output position, and no lengths.
  const std::int32_t* sequences = nullptr;
  const std::int32_t* sequence_lengths = nullptr;
  std::size_t max_target = 0;
  // Each sample's run-time length of its time dimension (at most the
  // compile-time maximum); null: every sample has all its frames.
  const std::int32_t* frames = nullptr;

  Targets() = default;
  // A batch of class labels is a Targets: code that hands the engines a
  // label array keeps doing so.
  Targets(const std::int32_t* class_labels) : labels(class_labels) {}  // NOLINT(google-explicit-constructor)

  // The view from sample `first` on.
  Targets from(std::size_t first) const {
    Targets t = *this;
    if (labels != nullptr) t.labels += first;
    if (sequences != nullptr) t.sequences += first * max_target;
    if (sequence_lengths != nullptr) t.sequence_lengths += first;
    if (frames != nullptr) t.frames += first;
    return t;
  }
};

}  // namespace loom
