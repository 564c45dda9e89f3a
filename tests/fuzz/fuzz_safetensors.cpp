// Fuzz target: loom::io::SafetensorsFile::parse on any bytes. A file it
// accepts must lay its tensors end to end over the data buffer, find each by
// name, and read every F32 tensor back at its own shape.
#include <cstddef>
#include <loom/io/safetensors.hpp>
#include <vector>

#include "fuzz.hpp"

loom::fuzz::Outcome loom::fuzz::run(std::span<const std::uint8_t> bytes) {
  return outcome_of([&] {
    const auto file = io::SafetensorsFile::parse(std::as_bytes(bytes), "fuzz input");
    std::size_t header = 0;
    for (std::size_t i = 0; i < 8; ++i) header |= std::size_t{bytes[i]} << (8 * i);
    std::size_t covered = 0;
    for (const io::TensorInfo& tensor : file.tensors()) {
      LOOM_FUZZ_REQUIRE(tensor.begin == covered && tensor.begin <= tensor.end);
      covered = tensor.end;
      LOOM_FUZZ_REQUIRE(file.contains(tensor.name));
      LOOM_FUZZ_REQUIRE(&file.info(tensor.name) == &tensor);
      if (tensor.dtype != "F32") continue;
      std::size_t count = 1;
      for (const std::size_t dim : tensor.shape) count *= dim;
      LOOM_FUZZ_REQUIRE(count * 4 == tensor.end - tensor.begin);
      std::vector<float> values(count);
      file.read(tensor.name, values, tensor.shape);
    }
    LOOM_FUZZ_REQUIRE(8 + header + covered == bytes.size());
    for (const auto& [key, value] : file.metadata()) LOOM_FUZZ_REQUIRE(file.metadata(key) == value);
  });
}
