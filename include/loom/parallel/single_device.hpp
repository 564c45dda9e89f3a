// SingleDevice: the whole network and batch on one device. The simplest
// policy, and the reference every other policy must reproduce.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../data/dataset.hpp"
#include "../loss/softmax_cross_entropy.hpp"
#include "../net/model.hpp"

namespace loom {

struct SingleDevice {
  static constexpr std::size_t devices_needed = 1;
  static constexpr const char* name = "SingleDevice";
};

namespace detail {

// Loss and correct-count sums of samples [first, first + count) of a data
// set, run forward in pieces of at most `piece`: how one device evaluates,
// and how each DataParallel replica evaluates its share.
template <class Net>
cpu::LossSums evaluate_samples(Model<Net, float>& model, const data::Dataset& data,
                               std::size_t first, std::size_t count, std::size_t piece) {
  constexpr std::size_t classes = Net::output_shape::size;
  const std::size_t sample = data.sample_size();
  cpu::LossSums total;
  for (std::size_t done = 0; done < count; done += piece) {
    const std::size_t at = first + done;
    const std::size_t n = std::min(piece, count - done);
    const float* logits = model.forward(data.images.data() + at * sample, n);
    const auto sums = SoftmaxCrossEntropy::evaluate<float>(logits, data.labels.data() + at, n,
                                                           classes, n, nullptr);
    total.loss += sums.loss;
    total.correct += sums.correct;
  }
  return total;
}

}  // namespace detail
}  // namespace loom
