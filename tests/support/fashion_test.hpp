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

// The first samples of a split: data::head, "<name> (first <count>)".
using data::head;

}  // namespace loom::test
