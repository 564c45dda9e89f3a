// SpecAugment-style masks (Park et al., 2019) over one utterance's log-mel
// features, frames x mels, frame-major: a few bands of frequencies and spans
// of frames set to a fill value. The loader applies them to each training
// sample's valid frames when data::Augment::spec says so; audio.hpp's
// readers and tests call them directly.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <loom/core/error.hpp>
#include <loom/core/rng.hpp>
#include <span>

namespace loom::data {

// SpecAugment's masks (Park et al. 2019, without time warping): `frequency_masks`
// bands of width 0..max_frequency_width and `time_masks` spans of width
// 0..max_time_width (at most the utterance) are set to `fill`: 0, each band's
// mean once features are normalised per utterance.
struct SpecAugmentOptions {
  std::size_t frequency_masks = 2;
  std::size_t max_frequency_width = 15;
  std::size_t time_masks = 2;
  std::size_t max_time_width = 40;
  float fill = 0.0f;
};

// Masks one utterance's frames x mels features in place. The draw is a
// function of (seed, epoch, sample index), so a run is reproducible whatever
// the thread timing, as the image Loader's augmentation is.
inline void spec_augment(std::span<float> features, std::size_t frames, std::size_t mels,
                         const SpecAugmentOptions& options, std::uint64_t seed, std::size_t epoch,
                         std::size_t index) {
  LOOM_CHECK(features.size() == frames * mels, "spec_augment: ", features.size(),
             " features given for ", frames, " frames x ", mels, " mels = ", frames * mels);
  const std::uint64_t stream = stream_key(RngPurpose::spec_augment, epoch);
  const std::uint64_t draws = 2 * (options.frequency_masks + options.time_masks);
  std::uint64_t counter = static_cast<std::uint64_t>(index) * draws;
  const auto below = [&](std::uint64_t bound) { return hash_key(seed, stream, counter++) % bound; };
  for (std::size_t k = 0; k < options.frequency_masks; ++k) {
    const std::size_t width = below(std::min(options.max_frequency_width, mels) + 1);
    const std::size_t start = below(mels - width + 1);
    for (std::size_t t = 0; t < frames; ++t)
      std::fill_n(features.data() + t * mels + start, width, options.fill);
  }
  for (std::size_t k = 0; k < options.time_masks; ++k) {
    const std::size_t width = below(std::min(options.max_time_width, frames) + 1);
    const std::size_t start = below(frames - width + 1);
    std::fill_n(features.data() + start * mels, width * mels, options.fill);
  }
}

}  // namespace loom::data
