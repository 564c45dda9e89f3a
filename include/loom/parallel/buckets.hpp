// Gradient buckets for data parallelism (BucketPlan plans them at compile
// time; a grid engine's stage at run time, over its range): slices of
// the flat gradient buffer in reverse layer order (the order backward
// produces them), each closed once it holds at least the target bytes, so a
// bucket's all-reduce can start as soon as backward has finished the lowest
// layer in it. A layer is never split: its gradients become final at once.
#pragma once

#include <array>
#include <cstddef>
#include <span>

#include "../net/sequential.hpp"

namespace loom {

struct GradientBucket {
  std::size_t begin = 0;        // first element in the flat gradient buffer
  std::size_t end = 0;          // one past the last
  // The executed layer whose backward completes it (numbered from the
  // first layer of a stage's range, as the backward's hooks number them).
  std::size_t ready_after = 0;
  constexpr std::size_t size() const { return end - begin; }
};

// The planning rule, for any layout: layer i's gradients fill
// [offsets[i], offsets[i + 1]) of the flat buffer (an empty range: no
// parameters). emit(bucket) is called for each, in order.
template <class Emit>
constexpr void plan_buckets(std::span<const std::size_t> offsets, std::size_t target_elements,
                            Emit&& emit) {
  std::size_t open_end = 0, open_size = 0;
  std::size_t lowest = 0;
  for (std::size_t i = offsets.size() - 1; i-- > 0;) {
    const std::size_t params = offsets[i + 1] - offsets[i];
    if (params == 0) continue;
    if (open_size == 0) open_end = offsets[i + 1];
    open_size += params;
    lowest = i;
    if (open_size >= target_elements) {
      emit(GradientBucket{offsets[i], open_end, i});
      open_size = 0;
    }
  }
  if (open_size > 0) emit(GradientBucket{offsets[lowest], open_end, lowest});
}

template <class Net, std::size_t TargetBytes, class T = float>
struct BucketPlan {
  using executed = typename Net::executed;
  static constexpr std::size_t layer_count = executed::size;
  static constexpr auto offsets = detail::list_info<executed>::param_offsets;
  static constexpr std::size_t target_elements =
      TargetBytes / sizeof(T) > 0 ? TargetBytes / sizeof(T) : 1;

 private:
  template <class Emit>
  static constexpr void plan(Emit&& emit) {
    plan_buckets(offsets, target_elements, emit);
  }

 public:
  static constexpr std::size_t count = [] {
    std::size_t n = 0;
    plan([&](const GradientBucket&) { ++n; });
    return n;
  }();

  // In the order they become ready (the order the all-reduces run).
  static constexpr std::array<GradientBucket, count> buckets = [] {
    std::array<GradientBucket, count> out{};
    std::size_t n = 0;
    plan([&](const GradientBucket& b) { out[n++] = b; });
    return out;
  }();
};

}  // namespace loom
