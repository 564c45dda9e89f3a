// Launch shapes shared by loom's elementwise and grid-stride kernels.
#pragma once

#include <algorithm>
#include <cstddef>

namespace loom::gpu {

// 256 threads per block, at most 4 blocks per SM's worth (132 SMs on H200):
// enough to saturate memory bandwidth with grid-stride loops; not yet tuned
// on a GPU.
inline constexpr unsigned block_threads = 256;

inline unsigned grid_blocks(std::size_t count) {
  return static_cast<unsigned>(
      std::min<std::size_t>((count + block_threads - 1) / block_threads, 4 * 132));
}

}  // namespace loom::gpu
