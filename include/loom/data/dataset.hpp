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
  std::vector<std::int32_t> labels;

  std::size_t sample_size() const { return channels * height * width; }
};

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
  part.labels.assign(set.labels.begin(), set.labels.begin() + static_cast<std::ptrdiff_t>(part.count));
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
