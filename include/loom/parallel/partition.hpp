// Where ModelSplit cuts a network into pipeline stages, decided at compile
// time: At<i, j, ...> by hand, Balanced<S> by a constexpr cost model. Layer
// indices are the user's, 1-based (Input = 0), as in shape errors; a cut
// "before layer i" starts a stage with layer i.
//
// Balanced<2, 3, 4> carries the balanced cut for each stage count listed,
// all made at compile time; the run-time count of devices (or processes)
// picks one (PipelineGrid::stages). One trainer type then runs pipelines of
// any of those lengths.
//
// The cost model, per training sample, in FLOP-equivalents:
//   - a layer: its forward and backward FLOPs, plus its optimizer update
//     (4 FLOPs per parameter, spread over a nominal batch of 64 samples);
//   - a cut: the activation sent forward and its gradient sent back, counted
//     on both stages it joins, 1 per byte.
// Balanced<S> takes the contiguous cut into S non-empty stages whose most
// expensive stage is the cheapest (exact, by dynamic programming); among
// equal cuts the first found (stages ending earliest) wins. It cuts only
// between the layers that run (after the fusion pass): a fused pair such as
// Conv2d, ReLU stays in one stage, so no stage sends a pre-activation, and
// every stage is a range of the whole network's layers (one stage type
// for every cut; see StageOf). At<...> cuts anywhere.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../net/sequential.hpp"

namespace loom {

// `stages`: the partition's stage count, or 0 when it carries several
// (`stage_counts`) and the run-time count picks.
template <std::size_t... Cuts>
struct At {
  static constexpr std::size_t stages = sizeof...(Cuts) + 1;
  static constexpr std::array<std::size_t, 1> stage_counts{stages};
};

template <std::size_t... S>
struct Balanced {
  static_assert(sizeof...(S) >= 1, "loom ModelSplit error: Balanced<S...> needs a stage count");
  static constexpr std::array<std::size_t, sizeof...(S)> stage_counts{S...};
  static_assert(std::ranges::is_sorted(stage_counts) &&
                    std::ranges::adjacent_find(stage_counts) == stage_counts.end(),
                "loom ModelSplit error: Balanced<S...>'s stage counts must increase");
  static constexpr std::size_t stages = sizeof...(S) == 1 ? stage_counts[0] : 0;
};

// The errors a partition can have, named in the compiler's message with
// their arguments (cut position, cut index, layer count / previous cut).
template <std::size_t Position, std::size_t Cut, std::size_t LayerCount>
struct model_split_cut_out_of_range {
  static_assert(Cut >= 2 && Cut <= LayerCount,
                "loom ModelSplit error: At<...> cuts before a layer index that leaves a stage "
                "empty or does not exist (template arguments: position in At, cut index, layer "
                "count); cut before layers 2 .. layer count, numbered from 1 as in shape errors");
  static constexpr bool ok = Cut >= 2 && Cut <= LayerCount;
};

template <std::size_t Position, std::size_t Cut, std::size_t Previous>
struct model_split_cuts_not_increasing {
  static_assert(Cut > Previous,
                "loom ModelSplit error: At<...>'s cut indices must increase (template arguments: "
                "position in At, cut index, the cut before it)");
  static constexpr bool ok = Cut > Previous;
};

template <std::size_t Stages, std::size_t ExecutedCount>
struct model_split_more_stages_than_layers {
  static_assert(Stages >= 1 && Stages <= ExecutedCount,
                "loom ModelSplit error: Balanced<S> needs 1 <= S <= the network's layer count, "
                "a fused pair such as Conv2d, ReLU counting once (template arguments: stages, "
                "that count)");
  static constexpr bool ok = Stages >= 1 && Stages <= ExecutedCount;
};

template <class Net>
struct StageCostModel {
  static constexpr std::size_t layers = Net::layer_count;
  static constexpr std::size_t nominal_batch = 64;

 private:
  template <class... Ls>
  static constexpr std::array<double, sizeof...(Ls)> layer_costs(TypeList<Ls...>) {
    return {(static_cast<double>(Ls::forward_flops + Ls::backward_flops) +
             4.0 * static_cast<double>(Ls::param_count) / nominal_batch)...};
  }
  template <class... Ls>
  static constexpr std::array<double, sizeof...(Ls)> output_bytes(TypeList<Ls...>) {
    return {static_cast<double>(Ls::output_shape::size * sizeof(float))...};
  }

 public:
  // Index i: user layer i + 1.
  static constexpr auto layer = layer_costs(typename Net::layers{});
  static constexpr auto activation_bytes = output_bytes(typename Net::layers{});

  // The stage of layers [first, last) (0-based, last exclusive).
  static constexpr double stage(std::size_t first, std::size_t last) {
    double total = 0.0;
    for (std::size_t i = first; i < last; ++i) total += layer[i];
    if (first > 0) total += 2.0 * activation_bytes[first - 1];
    if (last < layers) total += 2.0 * activation_bytes[last - 1];
    return total;
  }
};

// The executed layer (after fusion) that begins with user layer position
// `position` (0-based; the layer count: one past the last executed layer),
// or npos when `position` falls inside a fused layer.
template <class Net>
constexpr std::size_t executed_from(std::size_t position) {
  constexpr auto starts = []<class... Ls>(TypeList<Ls...>) {
    return std::array<std::size_t, sizeof...(Ls)>{(Ls::index - 1)...};
  }(typename Net::executed{});
  if (position == Net::layer_count) return starts.size();
  for (std::size_t i = 0; i < starts.size(); ++i)
    if (starts[i] == position) return i;
  return static_cast<std::size_t>(-1);
}

// Whether a stage may begin (or end) before user layer position `position`:
// no fused layer spans it.
template <class Net>
constexpr bool between_executed(std::size_t position) {
  return executed_from<Net>(position) != static_cast<std::size_t>(-1);
}

// Whether every stage of a cut begins and ends between executed layers:
// its stages are then ranges of the whole network's executed list.
template <class Net, std::size_t N>
constexpr bool cuts_between_executed(const std::array<std::size_t, N>& bounds) {
  return std::ranges::all_of(bounds, between_executed<Net>);
}

// Stage bounds as 0-based layer positions: stage k holds [bounds[k], bounds[k+1]).
template <class Net, class Partition>
struct partition_bounds;

template <class Net, std::size_t... Cuts>
struct partition_bounds<Net, At<Cuts...>> {
  static constexpr std::size_t stages = sizeof...(Cuts) + 1;

 private:
  static constexpr std::array<std::size_t, sizeof...(Cuts)> cuts{Cuts...};
  template <std::size_t... P>
  static constexpr bool check(std::index_sequence<P...>) {
    return (model_split_cut_out_of_range<P + 1, cuts[P], Net::layer_count>::ok && ...) &&
           (model_split_cuts_not_increasing<P + 1, cuts[P], (P == 0 ? 1 : cuts[P == 0 ? 0 : P - 1])>::ok &&
            ...);
  }

 public:
  static constexpr bool checked = check(std::make_index_sequence<sizeof...(Cuts)>{});
  static constexpr std::array<std::size_t, stages + 1> bounds = [] {
    static_assert(checked, "loom ModelSplit error: see the At<...> error above");
    std::array<std::size_t, stages + 1> b{};
    // != rather than <: no cuts (one stage) is no "pointless comparison" for nvcc.
    for (std::size_t k = 0; k != cuts.size(); ++k) b[k + 1] = cuts[k] - 1;
    b[stages] = Net::layer_count;
    return b;
  }();
};

template <class Net, std::size_t S>
struct partition_bounds<Net, Balanced<S>> {
  static constexpr std::size_t stages = S;
  static constexpr bool checked =
      model_split_more_stages_than_layers<S, Net::executed::size>::ok;
  static constexpr std::array<std::size_t, S + 1> bounds = [] {
    static_assert(checked, "loom ModelSplit error: see the Balanced<S> error above");
    using Cost = StageCostModel<Net>;
    constexpr std::size_t L = Net::layer_count;
    constexpr double infinity = std::numeric_limits<double>::infinity();
    // best[k][j]: the cheapest most-expensive stage for layers [0, j) in k stages;
    // from[k][j]: where the last of those stages starts.
    std::array<std::array<double, L + 1>, S + 1> best{};
    std::array<std::array<std::size_t, L + 1>, S + 1> from{};
    for (auto& row : best) row.fill(infinity);
    best[0][0] = 0.0;
    for (std::size_t k = 1; k <= S; ++k)
      for (std::size_t j = k; j <= L; ++j) {
        if (!between_executed<Net>(j)) continue;
        for (std::size_t i = k - 1; i < j; ++i) {
          if (!between_executed<Net>(i)) continue;
          const double worst = std::max(best[k - 1][i], Cost::stage(i, j));
          if (worst < best[k][j]) {
            best[k][j] = worst;
            from[k][j] = i;
          }
        }
      }
    std::array<std::size_t, S + 1> b{};
    b[S] = L;
    for (std::size_t k = S; k > 0; --k) b[k - 1] = from[k][b[k]];
    return b;
  }();
};

namespace detail {

template <class Net>
struct user_layers;
template <std::size_t... Dims, class... Ls>
struct user_layers<Sequential<Input<Dims...>, Ls...>> {
  using type = TypeList<Ls...>;
};

template <class Net, std::size_t First, class Indices>
struct stage_net;
template <class Net, std::size_t First, std::size_t... I>
struct stage_net<Net, First, std::index_sequence<I...>> {
  using in = typename type_at_t<First, typename Net::layers>::input_shape;
  using type = Network<First + 1, in, type_at_t<First + I, typename user_layers<Net>::type>...>;
};

}  // namespace detail

// Stage k of a partition as a network of its own: the shape the stage
// receives, then the user's layers of the stage (fused within it, numbered
// as in the whole network). Its
// parameters are a contiguous slice of the whole network's flat buffer,
// starting at stage_parameter_offset.
template <class Net, class Partition, std::size_t K>
using stage_net_t = typename detail::stage_net<
    Net, partition_bounds<Net, Partition>::bounds[K],
    std::make_index_sequence<partition_bounds<Net, Partition>::bounds[K + 1] -
                             partition_bounds<Net, Partition>::bounds[K]>>::type;

template <class Net, class Partition, std::size_t K>
inline constexpr std::size_t stage_parameter_offset =
    detail::list_info<typename Net::layers>::param_offsets[partition_bounds<Net, Partition>::bounds[K]];

template <class Net, class Partition, std::size_t K>
inline constexpr std::size_t stage_state_offset =
    detail::list_info<typename Net::layers>::state_offsets[partition_bounds<Net, Partition>::bounds[K]];

namespace detail {

// A partition's cuts, one per stage count: At<...> itself, Balanced<S...>
// as Balanced<S>....
template <class Partition>
struct cuts_of;
template <std::size_t... Cuts>
struct cuts_of<At<Cuts...>> {
  using type = TypeList<At<Cuts...>>;
};
template <std::size_t... S>
struct cuts_of<Balanced<S...>> {
  using type = TypeList<Balanced<S>...>;
};

}  // namespace detail

// Calls f.template operator()<Cut>() with Partition's cut into `stages`
// stages (a partition of one stage count); false when it carries none.
template <class Partition, class F>
bool with_cut(std::size_t stages, F&& f) {
  using cuts = typename detail::cuts_of<Partition>::type;
  bool found = false;
  static_for<cuts::size>([&](auto i) {
    using Cut = type_at_t<i, cuts>;
    if (!found && Cut::stages == stages) {
      f.template operator()<Cut>();
      found = true;
    }
  });
  return found;
}

// Stage bounds of Net cut by Partition into `stages` stages (one of its
// stage counts): stage k holds user layers [bounds[k], bounds[k+1]).
template <class Net, class Partition>
std::vector<std::size_t> cut_bounds(std::size_t stages) {
  std::vector<std::size_t> bounds;
  with_cut<Partition>(stages, [&]<class Cut>() {
    constexpr auto b = partition_bounds<Net, Cut>::bounds;
    bounds.assign(b.begin(), b.end());
  });
  return bounds;
}

// "2, 3 or 4": the stage counts a partition carries, for messages.
template <class Partition>
std::string stage_counts_text() {
  std::string text;
  constexpr auto& counts = Partition::stage_counts;
  for (std::size_t i = 0; i < counts.size(); ++i)
    text += (i == 0 ? "" : i + 1 == counts.size() ? " or " : ", ") + std::to_string(counts[i]);
  return text;
}

// The most expensive stage of a cut, under the cost model.
template <class Net, std::size_t N>
constexpr double bottleneck(const std::array<std::size_t, N>& bounds) {
  double worst = 0.0;
  for (std::size_t k = 0; k + 1 < N; ++k)
    worst = std::max(worst, StageCostModel<Net>::stage(bounds[k], bounds[k + 1]));
  return worst;
}

}  // namespace loom
