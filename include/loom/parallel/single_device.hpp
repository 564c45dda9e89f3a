// SingleDevice: the whole network and batch on one device. The simplest
// policy, and the reference every other policy must reproduce. On the CPU
// it is the grid engine's grid of one rank (grid_engine.hpp).
#pragma once

#include <cstddef>

namespace loom {

struct SingleDevice {
  static constexpr std::size_t devices_needed = 1;
  static constexpr const char* name = "SingleDevice";
};

}  // namespace loom
