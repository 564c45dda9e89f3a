// libFuzzer's entry point for every target: the harness linked with it
// decides what an input means.
#include <cstddef>
#include <cstdint>

#include "fuzz.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  loom::fuzz::run({data, size});
  return 0;
}
