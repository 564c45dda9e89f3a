// The network's tensors by name, for checkpoints: "I.kind.name" for layer I
// (counted from 1, as in shape errors), e.g. "1.conv.weight",
// "4.batchnorm.running_mean", "7.residual.body.0.conv.weight", each a slice of
// the flat parameter buffer (or, for running statistics, of the state
// buffer) in PyTorch's layout.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "../core/meta.hpp"
#include "sequential.hpp"

namespace loom {

struct TensorSlot {
  std::string name;
  std::size_t offset = 0;  // into the parameters, or the state when `state`
  std::vector<std::size_t> shape;
  bool state = false;

  std::size_t size() const {
    std::size_t n = 1;
    for (const std::size_t d : shape) n *= d;
    return n;
  }
};

template <class Net>
std::vector<TensorSlot> tensor_table() {
  using layers = typename Net::layers;
  using info = detail::list_info<layers>;
  std::vector<TensorSlot> table;
  static_for<layers::size>([&](auto i) {
    using L = type_at_t<i, layers>;
    const std::string prefix = std::to_string(L::index) + "." + std::string(L::kind) + ".";
    L::tensors([&](std::string_view name, std::size_t offset, std::vector<std::size_t> shape,
                   bool state) {
      table.push_back({prefix + std::string(name),
                       offset + (state ? info::state_offsets[i] : info::param_offsets[i]),
                       std::move(shape), state});
    });
  });
  return table;
}

}  // namespace loom
