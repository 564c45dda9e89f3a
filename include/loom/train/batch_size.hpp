// The largest batch a device can train with, from the compile-time memory
// plan: parameters, gradients, the optimizer's buffers, a reduced
// precision's rounded weights and its gradient sums, running statistics,
// the activation arena Model::reserve would carve, and the loader's two
// batches of inputs and labels. A hardware-aware default: ask the device
// what it has free (devices::memory_available) and pick the batch from
// that. It counts one CPU model with one activation slot, as SingleDevice
// or a DataParallel replica (for its share of the batch) trains; not a
// pipeline stage's in-flight micro-batches, and not the CUDA backend's own
// buffers.
#pragma once

#include <cstddef>

#include "../core/precision.hpp"
#include "../net/model.hpp"

namespace loom {

// Bytes a model of Net takes to train batches of `batch` samples with Optimizer.
template <class Net, class Optimizer>
constexpr std::size_t training_bytes(std::size_t batch, Precision precision = Precision::fp32) {
  const std::size_t per_parameter =
      2 + Optimizer::buffers_per_parameter + (precision == Precision::fp32 ? 0 : 2);  // a bound
  const std::size_t loader = 2 * batch * (Net::input_shape::size + 1);  // labels are 4 bytes too
  return sizeof(float) * (per_parameter * Net::parameter_count + 2 * Net::state_count +
                          Model<Net, float>::activation_elements(batch) + loader);
}

// The largest batch whose training_bytes fits in `bytes` (0: not even one
// sample). For a data-parallel replica, the share of the global batch.
template <class Net, class Optimizer>
constexpr std::size_t largest_batch(std::size_t bytes, Precision precision = Precision::fp32) {
  if (training_bytes<Net, Optimizer>(1, precision) > bytes) return 0;
  std::size_t fits = 1, too_big = 2;
  while (training_bytes<Net, Optimizer>(too_big, precision) <= bytes) {
    fits = too_big;
    if (too_big > (std::size_t{1} << 30)) return fits;  // a billion samples: plenty
    too_big *= 2;
  }
  while (too_big - fits > 1) {
    const std::size_t middle = fits + (too_big - fits) / 2;
    (training_bytes<Net, Optimizer>(middle, precision) <= bytes ? fits : too_big) = middle;
  }
  return fits;
}

}  // namespace loom
