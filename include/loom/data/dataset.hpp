// Image classification data in memory, in the form the trainer consumes: float
// NCHW images, normalised, and int32 labels. make_image_dataset turns any pair of
// ubyte IDX files into one; fashion_mnist loads the Debian-packaged data set.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <loom/core/error.hpp>
#include <loom/core/targets.hpp>
#include <loom/data/idx.hpp>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace loom::data {

struct Dataset {
  std::string name;
  std::size_t count = 0, channels = 1, height = 0, width = 0, classes = 10;
  std::vector<float> images;  // count * sample_size(), NCHW, normalised
  std::vector<std::int32_t> labels;  // one class per sample; empty for label sequences
  // A label sequence per sample (CTCLoss): max_target labels each, padded
  // with 0 past its length; or, with no target_lengths, a class per output
  // position (PositionCrossEntropy: max_target = the output's positions, a
  // label < 0 ignored); max_target 0 when the data has classes instead.
  std::size_t max_target = 0;
  std::vector<std::int32_t> targets;         // count * max_target
  std::vector<std::int32_t> target_lengths;  // count, each 1..max_target; empty: per position
  // Each sample's run-time length of its time dimension (rows, padded with
  // zeros past it); empty: every sample has all of them.
  std::vector<std::int32_t> frames;

  std::size_t sample_size() const { return channels * height * width; }
  bool has_sequences() const { return max_target > 0; }
  TargetKind target_kind() const {
    if (!has_sequences()) return TargetKind::class_label;
    return target_lengths.empty() ? TargetKind::class_per_position : TargetKind::label_sequence;
  }
};

// The whole data set's targets, from its first sample.
inline Targets targets_of(const Dataset& set) {
  Targets t;
  t.labels = set.labels.empty() ? nullptr : set.labels.data();
  t.sequences = set.targets.empty() ? nullptr : set.targets.data();
  t.sequence_lengths = set.target_lengths.empty() ? nullptr : set.target_lengths.data();
  t.max_target = set.max_target;
  t.frames = set.frames.empty() ? nullptr : set.frames.data();
  return t;
}

// Its arrays hold what count says, a label sequence per sample when it has
// them (each of length 1..max_target, labels 1..classes-1: 0 is CTC's
// blank), a class per position (each < classes; < 0 ignored), or one class
// per sample; frames, when given, are
// 1..(its rows: channels x height). Names the first sample that is wrong.
inline void check_targets(const Dataset& set) {
  const std::string where = "dataset '" + set.name + "'";
  LOOM_CHECK(set.images.size() == set.count * set.sample_size(), where, " declares ", set.count,
             " samples of ", set.sample_size(), " values but holds ", set.images.size(),
             " image values");
  if (set.target_kind() == TargetKind::class_per_position) {
    LOOM_CHECK(set.targets.size() == set.count * set.max_target, where, " has ",
               set.targets.size(), " target labels for ", set.count, " samples of ",
               set.max_target, " positions; expected ", set.count * set.max_target);
    for (std::size_t i = 0; i < set.count; ++i)
      for (std::size_t p = 0; p < set.max_target; ++p) {
        const std::int32_t label = set.targets[i * set.max_target + p];
        LOOM_CHECK(label < static_cast<std::int32_t>(set.classes), where, ": sample ", i,
                   " has label ", label, " at position ", p, "; expected 0..", set.classes - 1,
                   " for ", set.classes, " classes (or < 0: ignored)");
      }
  } else if (set.has_sequences()) {
    LOOM_CHECK(set.targets.size() == set.count * set.max_target &&
                   set.target_lengths.size() == set.count,
               where, " has ", set.targets.size(), " target labels and ",
               set.target_lengths.size(), " target lengths for ", set.count,
               " samples of up to ", set.max_target, " labels; expected ",
               set.count * set.max_target, " and ", set.count);
    for (std::size_t i = 0; i < set.count; ++i) {
      const std::int32_t length = set.target_lengths[i];
      LOOM_CHECK(length >= 1 && static_cast<std::size_t>(length) <= set.max_target, where,
                 ": sample ", i, " has a target of length ", length, "; expected 1..",
                 set.max_target);
      for (std::int32_t k = 0; k < length; ++k) {
        const std::int32_t label = set.targets[i * set.max_target + static_cast<std::size_t>(k)];
        LOOM_CHECK(label >= 1 && static_cast<std::size_t>(label) < set.classes, where,
                   ": sample ", i, " has label ", label, " at position ", k,
                   " of its target; expected 1..", set.classes - 1, " (0 is the blank)");
      }
    }
  } else {
    LOOM_CHECK(set.labels.size() == set.count, where, " declares ", set.count, " samples of ",
               set.sample_size(), " values but holds ", set.images.size(),
               " image values and ", set.labels.size(), " labels");
  }
  if (!set.frames.empty()) {
    const std::size_t rows = set.channels * set.height;
    LOOM_CHECK(set.frames.size() == set.count, where, " has ", set.frames.size(),
               " sample lengths (frames) for ", set.count, " samples");
    for (std::size_t i = 0; i < set.count; ++i)
      LOOM_CHECK(set.frames[i] >= 1 && static_cast<std::size_t>(set.frames[i]) <= rows, where,
                 ": sample ", i, " has ", set.frames[i], " frames; expected 1..", rows,
                 " (its rows)");
  }
}

// Batches of `batch_size` in an epoch over `count` samples: the last one
// short, or left out with drop_last.
inline std::size_t batches_per_epoch(std::size_t count, std::size_t batch_size, bool drop_last) {
  return drop_last ? count / batch_size : (count + batch_size - 1) / batch_size;
}

// Pixels become (pixel / 255 - mean) / std. The defaults are the Fashion-MNIST
// training set's own mean and standard deviation after the division by 255.
struct Normalize {
  float mean = 0.2860f;
  float std = 0.3530f;
};

inline Dataset make_image_dataset(const IdxArray& images, const IdxArray& labels,
                                  std::size_t classes, Normalize normalize, std::string name) {
  LOOM_CHECK(images.dims.size() == 3, "images file '", images.path, "' has rank ",
             images.dims.size(), " (", detail::shape_text(images.dims),
             "); expected rank 3 (count x height x width)");
  LOOM_CHECK(labels.dims.size() == 1, "labels file '", labels.path, "' has rank ",
             labels.dims.size(), " (", detail::shape_text(labels.dims),
             "); expected rank 1 (count)");
  for (const IdxArray* array : {&images, &labels}) {
    std::size_t expected = 1;
    for (std::size_t dim : array->dims) expected *= dim;
    LOOM_CHECK(array->data.size() == expected, "IDX array from '", array->path, "' has dims ",
               detail::shape_text(array->dims), " = ", expected, " bytes but holds ",
               array->data.size());
  }
  LOOM_CHECK(images.dims[0] == labels.dims[0], "images file '", images.path, "' holds ",
             images.dims[0], " images but labels file '", labels.path, "' holds ", labels.dims[0],
             " labels; the two files must come from the same split");
  LOOM_CHECK(classes > 0, "data set '", name, "' needs at least one class");
  LOOM_CHECK(std::isfinite(normalize.mean) && std::isfinite(normalize.std) && normalize.std > 0,
             "Normalize{mean = ", normalize.mean, ", std = ", normalize.std,
             "} is invalid; std must be positive and both finite");

  Dataset set;
  set.name = std::move(name);
  set.count = images.dims[0];
  set.height = images.dims[1];
  set.width = images.dims[2];
  set.classes = classes;

  set.labels.resize(set.count);
  for (std::size_t i = 0; i < set.count; ++i) {
    const std::uint8_t label = labels.data[i];
    LOOM_CHECK(label < classes, "labels file '", labels.path, "' has label ", int{label},
               " at index ", i, "; expected 0..", classes - 1, " for ", classes, " classes");
    set.labels[i] = label;
  }

  // 256 possible pixel values: a table beats a divide per pixel.
  std::array<float, 256> table;
  for (std::size_t v = 0; v < table.size(); ++v)
    table[v] =
        static_cast<float>((static_cast<double>(v) / 255.0 - normalize.mean) / normalize.std);
  set.images.resize(images.data.size());
  for (std::size_t i = 0; i < images.data.size(); ++i) set.images[i] = table[images.data[i]];
  return set;
}

struct Split {
  Dataset train, test;
};

// The first n samples of `set` (all of them when it has fewer), for short runs.
inline Dataset head(const Dataset& set, std::size_t n) {
  Dataset part;
  part.count = std::min(n, set.count);
  part.channels = set.channels;
  part.height = set.height;
  part.width = set.width;
  part.classes = set.classes;
  part.images.assign(set.images.begin(),
                     set.images.begin() + static_cast<std::ptrdiff_t>(part.count * set.sample_size()));
  const auto prefix = [&](const std::vector<std::int32_t>& from, std::size_t per_sample) {
    if (from.empty()) return std::vector<std::int32_t>{};
    return std::vector<std::int32_t>(
        from.begin(), from.begin() + static_cast<std::ptrdiff_t>(part.count * per_sample));
  };
  part.labels = prefix(set.labels, 1);
  part.max_target = set.max_target;
  part.targets = prefix(set.targets, set.max_target);
  part.target_lengths = prefix(set.target_lengths, 1);
  part.frames = prefix(set.frames, 1);
  part.name = set.name + " (first " + std::to_string(part.count) + ")";
  return part;
}

inline constexpr const char* default_fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

namespace detail {

// Debian ships the .gz files; a user may have unpacked them, so both are accepted.
inline std::string find_idx_file(const std::string& dir, const std::string& stem) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(dir) / (stem + ".gz");
  const fs::path plain = fs::path(dir) / stem;
  std::error_code ignored;
  if (fs::exists(gz, ignored)) return gz.string();
  if (fs::exists(plain, ignored)) return plain.string();
  LOOM_FAIL("Fashion-MNIST file '", gz.string(), "' (or uncompressed '", plain.string(),
            "') not found; ", missing_data_hint);
}

inline Dataset load_fashion_mnist_split(const std::string& dir, const std::string& prefix,
                                        Normalize normalize, std::string name) {
  const IdxArray images = read_idx(find_idx_file(dir, prefix + "-images-idx3-ubyte"), 3);
  const IdxArray labels = read_idx(find_idx_file(dir, prefix + "-labels-idx1-ubyte"), 1);
  return make_image_dataset(images, labels, 10, normalize, std::move(name));
}

}  // namespace detail

inline Split fashion_mnist(const std::string& dir = default_fashion_mnist_dir,
                           Normalize normalize = {}) {
  return {detail::load_fashion_mnist_split(dir, "train", normalize, "fashion-mnist-train"),
          detail::load_fashion_mnist_split(dir, "t10k", normalize, "fashion-mnist-test")};
}

}  // namespace loom::data
