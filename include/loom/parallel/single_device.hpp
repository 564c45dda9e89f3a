// SingleDevice: the whole network and batch on one device. The simplest
// policy, and the reference every other policy must reproduce.
#pragma once

#include <cstddef>

namespace loom {

struct SingleDevice {
  static constexpr std::size_t devices_needed = 1;
  static constexpr const char* name = "SingleDevice";
};

}  // namespace loom
