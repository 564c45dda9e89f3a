// Real data for tests: Fashion-MNIST from LOOM_TEST_DATA_DIR (CMake sets it),
// read once per test program, and the first samples of a split.
#pragma once

#include <cstddef>
#include <loom/data/dataset.hpp>
#include <string>

namespace loom::test {

inline const data::Split& fashion() {
  static const data::Split split = data::fashion_mnist(LOOM_TEST_DATA_DIR);
  return split;
}

// The first `count` samples, named "<name> (first <count>)".
inline data::Dataset head(const data::Dataset& full, std::size_t count) {
  data::Dataset part = full;
  part.name = full.name + " (first " + std::to_string(count) + ")";
  part.count = count;
  part.images.resize(count * full.sample_size());
  part.labels.resize(count);
  return part;
}

}  // namespace loom::test
