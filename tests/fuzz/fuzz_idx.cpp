// Fuzz target: loom::data::read_idx on any bytes, gzip or raw. What it
// returns must hold exactly the elements its dimensions promise.
#include <cstddef>
#include <loom/data/idx.hpp>

#include "fuzz.hpp"

loom::fuzz::Outcome loom::fuzz::run(std::span<const std::uint8_t> bytes) {
  const std::string& path = scratch_file(bytes);
  return outcome_of([&] {
    const data::IdxArray array = data::read_idx(path);
    LOOM_FUZZ_REQUIRE(!array.dims.empty() && array.dims.size() <= 255);
    std::size_t total = 1;
    for (const std::size_t dim : array.dims) total *= dim;
    LOOM_FUZZ_REQUIRE(total == array.data.size());
    LOOM_FUZZ_REQUIRE(array.path == path);
  });
}
