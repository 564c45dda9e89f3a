// What the numerical-fault tests share: setting a named tensor, the error a
// fit raises, a data set without some samples, and a network whose gradient
// overflows under a finite loss.
#pragma once

#include <catch2/catch.hpp>
#include <cstddef>
#include <loom/loom.hpp>
#include <span>
#include <string>

namespace loom::test {

// Sets every value of tensor `name` (see tensor_table) in `weights`.
template <class Net>
void set_tensor(std::span<float> weights, const std::string& name, float value) {
  for (const auto& slot : tensor_table<Net>())
    if (slot.name == name) {
      std::fill_n(weights.begin() + static_cast<std::ptrdiff_t>(slot.offset), slot.size(), value);
      return;
    }
  FAIL("no tensor " << name);
}

// The error fit() raises.
template <class Net, class Policy>
std::string error_of(Trainer<Net, Policy>& trainer, const data::Dataset& data, FitOptions fit) {
  try {
    trainer.fit(data, fit);
  } catch (const Error& error) {
    return error.what();
  }
  FAIL("fit() did not raise");
  return {};
}

// `data` without its samples [first, first + count).
inline data::Dataset without(const data::Dataset& data, std::size_t first, std::size_t count) {
  data::Dataset out = data;
  const auto sample = static_cast<std::ptrdiff_t>(data.sample_size());
  out.images.erase(out.images.begin() + static_cast<std::ptrdiff_t>(first) * sample,
                   out.images.begin() + static_cast<std::ptrdiff_t>(first + count) * sample);
  out.labels.erase(out.labels.begin() + static_cast<std::ptrdiff_t>(first),
                   out.labels.begin() + static_cast<std::ptrdiff_t>(first + count));
  out.count -= count;
  return out;
}

// Layer 2's gradient overflows under a finite loss (see overflowing_gradient).
using OverflowingNet = Sequential<Input<1, 28, 28>, Flatten, Linear<8>, Linear<10>>;

// Every image 1, every label 1: with overflowing_gradient's weights, layer
// 2 (Linear<8>) gives 1e-30 whatever its input, layer 3 maps it to logits
// +-2.4e9 (finite loss, 4.8e9 a sample) with weights of +-3e38.
// Back-propagated, each sample's gradient of layer 2's output is 3e38/64 +
// 3e38/64 = 9.4e36, and summed over a batch of 64 samples (times an input
// of 1) layer 2's weight gradient is 6e38: inf in float. (Under
// DataParallel only once the replicas' gradients are summed; in a pipeline
// once enough micro-batches are added.)
inline data::Dataset ones(std::size_t count) {
  data::Dataset data;
  data.name = "ones";
  data.count = count;
  data.height = data.width = 28;
  data.images.assign(count * 784, 1.0f);
  data.labels.assign(count, 1);
  return data;
}

inline void overflowing_gradient(std::span<float> p) {
  set_tensor<OverflowingNet>(p, "2.linear.weight", 0.0f);
  set_tensor<OverflowingNet>(p, "2.linear.bias", 1e-30f);
  set_tensor<OverflowingNet>(p, "3.linear.weight", 0.0f);
  const std::size_t w3 = 8 * 784 + 8;  // layer 3's weight: 10 x 8
  for (std::size_t j = 0; j < 8; ++j) {
    p[w3 + 0 * 8 + j] = 3e38f;   // class 0: the arg-max
    p[w3 + 1 * 8 + j] = -3e38f;  // class 1: the label
  }
}

}  // namespace loom::test
