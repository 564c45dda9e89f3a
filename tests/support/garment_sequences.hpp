// A sequence task from real data: Fashion-MNIST garments read top to bottom,
// a row a frame. Sample i stacks images 2i and 2i+1 (56 rows of 28) with the
// target (class + 1, class + 1): CTC's blank is 0. Every third sample holds
// its first garment only: 28 frames, the rest zero padding, a target of one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <loom/loom.hpp>
#include <string>

namespace loom::test {

inline data::Dataset garment_sequences(const data::Dataset& images, std::size_t count) {
  const std::size_t rows = images.height, width = images.width, image = rows * width;
  data::Dataset set;
  set.name = images.name + " garment pairs";
  set.count = std::min(count, images.count / 2);
  set.channels = 1;
  set.height = 2 * rows;
  set.width = width;
  set.classes = images.classes + 1;
  set.max_target = 2;
  set.images.assign(set.count * 2 * image, 0.0f);
  set.targets.assign(set.count * 2, 0);
  set.target_lengths.assign(set.count, 2);
  set.frames.assign(set.count, static_cast<std::int32_t>(2 * rows));
  for (std::size_t i = 0; i < set.count; ++i) {
    const bool one = i % 3 == 2;
    const std::size_t garments = one ? 1 : 2;
    for (std::size_t g = 0; g < garments; ++g) {
      const std::size_t from = 2 * i + g;
      std::copy_n(images.images.begin() + static_cast<std::ptrdiff_t>(from * image), image,
                  set.images.begin() + static_cast<std::ptrdiff_t>((2 * i + g) * image));
      set.targets[2 * i + g] = images.labels[from] + 1;
    }
    set.target_lengths[i] = static_cast<std::int32_t>(garments);
    set.frames[i] = static_cast<std::int32_t>(garments * rows);
  }
  return set;
}

}  // namespace loom::test
