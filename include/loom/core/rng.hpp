// Counter-based random numbers: a value is a pure function of (seed, stream,
// counter), never of a thread, rank or call order, so weights, data order and
// dropout masks are the same on every backend, policy and device count.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.hpp"

namespace loom {

// SplitMix64's finaliser: a bijective 64-bit mix with full avalanche.
LOOM_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

LOOM_HOST_DEVICE constexpr std::uint64_t hash_key(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return mix64(mix64(mix64(seed) ^ stream) ^ counter);
}

// What a random stream is for. Each purpose keys its streams apart, so that
// (seed, epoch k)'s shuffle never repeats (seed, layer k)'s weights.
enum class RngPurpose : std::uint64_t {
  init = 1,
  shuffle = 2,
  dropout = 3,
  augment = 4,
  spec_augment = 5,  // data/audio.hpp's masks
  bucket = 6,        // data/loader.hpp: the order of an epoch's bucketed batches
};

LOOM_HOST_DEVICE constexpr std::uint64_t stream_key(RngPurpose purpose, std::uint64_t index) {
  return mix64((static_cast<std::uint64_t>(purpose) << 56) ^ index);
}

// Uniform in [0, 1) with 53 random bits.
LOOM_HOST_DEVICE constexpr double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return static_cast<double>(hash_key(seed, stream, counter) >> 11) * 0x1.0p-53;
}

// A sequential generator over the same counter space, for loops that draw
// many numbers from one stream (shuffles).
class CounterRng {
 public:
  constexpr CounterRng(std::uint64_t seed, std::uint64_t stream) : seed_(seed), stream_(stream) {}
  constexpr std::uint64_t next() { return hash_key(seed_, stream_, counter_++); }
  // Unbiased integer in [0, bound) by rejection (Lemire's multiply-shift
  // would need 128-bit arithmetic; rejection keeps this constexpr and simple).
  constexpr std::uint64_t below(std::uint64_t bound) {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
    std::uint64_t value = next();
    while (value >= limit) value = next();
    return value % bound;
  }

 private:
  std::uint64_t seed_;
  std::uint64_t stream_;
  std::uint64_t counter_ = 0;
};

}  // namespace loom
