// Fuzz target: loom::data::read_cifar10 on any bytes. A data set it returns
// must hold whole records, labels below 10 and finite pixels.
#include <cmath>
#include <loom/data/cifar.hpp>

#include "fuzz.hpp"

loom::fuzz::Outcome loom::fuzz::run(std::span<const std::uint8_t> bytes) {
  const std::string& path = scratch_file(bytes);
  return outcome_of([&] {
    const data::Dataset set = data::read_cifar10({path}, "fuzz");
    LOOM_FUZZ_REQUIRE(set.count * data::cifar_record == bytes.size());
    LOOM_FUZZ_REQUIRE(set.labels.size() == set.count);
    LOOM_FUZZ_REQUIRE(set.images.size() == set.count * data::cifar_pixels);
    for (std::size_t i = 0; i < set.count; ++i) {
      LOOM_FUZZ_REQUIRE(set.labels[i] < 10);
      LOOM_FUZZ_REQUIRE(set.labels[i] == bytes[i * data::cifar_record]);
    }
    for (const float pixel : set.images) LOOM_FUZZ_REQUIRE(std::isfinite(pixel));
  });
}
