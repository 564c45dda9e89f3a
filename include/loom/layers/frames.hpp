// A sample's length of the time dimension, as a layer over time reads it
// from LayerContext::frames: checked against its input's Frames, so that a
// bad length is an Error naming the layer and the sample, never a read past
// the sample's storage.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/error.hpp"
#include "../core/meta.hpp"
#include "layer.hpp"

namespace loom::detail {

// Sample `sample`'s length at a layer (spec Spec, index Index) whose input
// holds Frames frames per sample: the context's, or Frames without lengths.
template <class Spec, std::size_t Index, std::size_t Frames, class T>
std::size_t sample_frames(const LayerContext<T>& context, std::size_t sample) {
  if (context.frames == nullptr) return Frames;
  const std::int32_t length = context.frames[sample];
  LOOM_CHECK(length >= 0 && static_cast<std::size_t>(length) <= Frames, type_label<Spec>(), " (",
             layer_path_text(Index), "): sample ", sample, " of the batch (global sample ",
             context.pass.first_sample + sample, ") has length ", length, ", outside 0..", Frames,
             " (the frames its input holds); check the lengths the batch carries");
  return static_cast<std::size_t>(length);
}

}  // namespace loom::detail
