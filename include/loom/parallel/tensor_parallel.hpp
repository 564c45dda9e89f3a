// TensorParallel<T, Inner>: every layer that splits (Megatron's splits) is
// cut over T ranks of the mesh's tensor axis, and Inner's grid (SingleDevice,
// DataParallel<>, ModelSplit<...> or Hybrid<...>) runs over each share:
//
//   TensorParallel<2>                                        tensor 2
//   TensorParallel<2, DataParallel<>>                        data R x tensor 2
//   TensorParallel<2, ModelSplit<Balanced<2>>>               pipe 2 x tensor 2
//   TensorParallel<2, Hybrid<2, ModelSplit<Balanced<2>>>>    data 2 x pipe 2 x tensor 2
//
// What splits, read off the network's type (tensor_shard_t):
//   - CausalSelfAttention's heads: each rank T-th of them, its rows of the
//     q, k, v projection and its columns of the output projection
//     (TensorHeads, layers/attention.hpp);
//   - a Linear followed, through pointwise layers only (ReLU, GELU, Tanh,
//     Sigmoid), by another Linear (a transformer block's MLP): the first
//     column-parallel, the second row-parallel (TensorColumns, TensorRows,
//     layers/tensor_linear.hpp);
//   - the network's last Linear (a GPT's vocabulary): column-parallel, its
//     outputs gathered for the loss (TensorGather).
// Blocks (Residual, Series, TransformerBlock, a user's) are looked into:
// their layers are sharded by the same rules, so a TransformerBlock splits
// its attention's heads and its MLP's pair.
// Everything else (embeddings, norms, the loss) runs whole on every rank of
// a tensor group, on the same values: after each split pair the features
// are summed into equal copies, so their gradients are equal too, and need
// no reduction (Megatron reduces norms' gradients only under sequence
// parallelism, where each rank holds a different part of the sequence).
//
// The tensor degree must divide what it splits (heads, the MLP's hidden
// features, the vocabulary): otherwise a compile error names the layer and
// the numbers. The weights start as the whole network's (each rank takes
// its parts), checkpoints gather them whole, and a checkpoint loads under
// any mesh. Same numbers: each rank computes its share of every sum that
// one device computes whole, so results equal one device's to fp32
// rounding (the tests' tolerance is stated there), not bit for bit.
//
// On CPU devices and MPI processes, and on GPUs (gpu/tensor_linear.cuh and
// the attention's runner: the sums on NCCL, or through the host where
// ranks share a GPU).
#pragma once

#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../core/error.hpp"
#include "../layers/attention.hpp"
#include "../layers/tensor_linear.hpp"
#include "../net/block.hpp"
#include "../net/model.hpp"
#include "../net/residual.hpp"
#include "../optim/clip.hpp"
#include "data_parallel.hpp"
#include "grid_engine.hpp"
#include "hybrid.hpp"
#include "model_split.hpp"
#include "partition.hpp"
#include "schedule.hpp"
#include "single_device.hpp"

namespace loom {

namespace detail {

// Inner's grid: its pipeline (one stage for SingleDevice and DataParallel),
// replicas (0: from the devices) and gradient bucket size.
template <class Inner>
struct tensor_inner {
  static_assert(dependent_false<Inner>,
                "TensorParallel<T, Inner>: Inner is SingleDevice, DataParallel<...>, "
                "ModelSplit<...> or Hybrid<...>");
};
template <>
struct tensor_inner<SingleDevice> {
  using split = ModelSplit<At<>, OneFOneB<1>>;
  static constexpr std::size_t replicas = 1;
  static constexpr std::size_t bucket_bytes = default_bucket_bytes;
};
template <std::size_t B>
struct tensor_inner<DataParallel<B>> {
  using split = ModelSplit<At<>, OneFOneB<1>>;
  static constexpr std::size_t replicas = replicas_from_devices;
  static constexpr std::size_t bucket_bytes = B;
};
template <class P, class S>
struct tensor_inner<ModelSplit<P, S>> {
  using split = ModelSplit<P, S>;
  static constexpr std::size_t replicas = 1;
  static constexpr std::size_t bucket_bytes = default_bucket_bytes;
};
template <std::size_t R, class S, std::size_t B>
struct tensor_inner<Hybrid<R, S, B>> {
  using split = S;
  static constexpr std::size_t replicas = R;
  static constexpr std::size_t bucket_bytes = B;
};

}  // namespace detail

template <std::size_t Tensor, class Inner = SingleDevice>
struct TensorParallel {
  static_assert(Tensor >= 1, "TensorParallel<T, Inner>: the tensor degree T is at least 1");
  using inner = Inner;
  using split = typename detail::tensor_inner<Inner>::split;
  using partition = typename split::partition;
  using schedule_type = typename split::schedule_type;
  static constexpr std::size_t tensor = Tensor;
  static constexpr std::size_t replicas = detail::tensor_inner<Inner>::replicas;  // 0: from devices
  static constexpr std::size_t stages = split::stages;  // 0: one of the partition's
  static constexpr std::size_t devices_needed = replicas * stages * Tensor;  // 0: a multiple of T
  static constexpr PipelineSchedule schedule = split::schedule;
  static constexpr std::size_t bucket_bytes = detail::tensor_inner<Inner>::bucket_bytes;
  static constexpr const char* name = "TensorParallel";
};

template <std::size_t T, class I>
inline constexpr bool is_tensor_parallel<TensorParallel<T, I>> = true;

namespace detail {

template <class L>
inline constexpr bool tensor_pointwise =
    std::is_same_v<L, ReLU> || std::is_same_v<L, GELU> || std::is_same_v<L, Tanh> ||
    std::is_same_v<L, Sigmoid>;
template <class L>
inline constexpr bool is_plain_linear = false;
template <std::size_t N>
inline constexpr bool is_plain_linear<Linear<N>> = true;

// Whether a layer list starts with pointwise layers and then a Linear (the
// row-parallel partner of a Linear before it).
template <class... Ls>
inline constexpr bool row_partner_next = false;
template <class L, class... Rest>
inline constexpr bool row_partner_next<L, Rest...> =
    is_plain_linear<L> || (tensor_pointwise<L> && row_partner_next<Rest...>);

template <class L, std::size_t T>
struct shard_one {
  using type = L;
};
template <std::size_t T, class Done, bool InPair, class... Rest>
struct shard_list {
  using type = Done;
};

template <std::size_t H, class P, std::size_t T>
struct shard_one<CausalSelfAttention<H, P>, T> {
  using type = TensorHeads<CausalSelfAttention<H, P>, T>;
};
template <class... Ls, std::size_t T>
struct shard_one<Residual<Ls...>, T> {
  template <class List>
  struct as_residual;
  template <class... Shards>
  struct as_residual<TypeList<Shards...>> {
    using type = Residual<Shards...>;
  };
  using type = typename as_residual<typename shard_list<T, TypeList<>, false, Ls...>::type>::type;
};

template <class List, std::size_t T>
struct shard_layers;
template <class... Ls, std::size_t T>
struct shard_layers<TypeList<Ls...>, T> {
  using type = typename shard_list<T, TypeList<>, false, Ls...>::type;
};

}  // namespace detail

// A named block (Series, TransformerBlock, ...) as one rank of T holds it:
// its layers for the input, sharded as a network's are.
template <class Spec, std::size_t T>
struct TensorBlock : NamedBlock {
  template <class In>
  using layers = typename detail::shard_layers<typename Spec::template layers<In>, T>::type;
  static constexpr std::string_view kind = Spec::kind;
  static constexpr std::string_view name = Spec::name;
};

namespace detail {

template <class Spec, std::size_t T>
  requires std::derived_from<Spec, NamedBlock>
struct shard_one<Spec, T> {
  using type = TensorBlock<Spec, T>;
};

// Inside a pair, pointwise layers pass and the next Linear closes it.
template <std::size_t T, class... Done, class L, class... Rest>
struct shard_list<T, TypeList<Done...>, true, L, Rest...> {
  using type = typename shard_list<
      T, TypeList<Done..., std::conditional_t<is_plain_linear<L>, TensorRows<L, T>, L>>,
      !is_plain_linear<L>, Rest...>::type;
};
template <std::size_t T, class... Done, class L, class... Rest>
struct shard_list<T, TypeList<Done...>, false, L, Rest...> {
  static constexpr bool opens = is_plain_linear<L> && row_partner_next<Rest...>;
  using type = typename shard_list<
      T,
      TypeList<Done..., std::conditional_t<opens, TensorColumns<L, T>,
                                           typename shard_one<L, T>::type>>,
      opens, Rest...>::type;
};

// The network's last Linear, unpaired: its outputs split and gathered.
template <class L, std::size_t T>
struct shard_last {
  using type = L;
};
template <std::size_t N, std::size_t T>
struct shard_last<Linear<N>, T> {
  using type = TensorGather<Linear<N>, T>;
};

template <class Net, std::size_t T>
struct tensor_shard {
  static_assert(dependent_false<Net>,
                "TensorParallel: the network must be a Sequential<Input<...>, Layers...>");
};
template <std::size_t... Dims, class... Ls, std::size_t T>
struct tensor_shard<Sequential<Input<Dims...>, Ls...>, T> {
  template <class List>
  struct as_net;
  template <class... Shards>
  struct as_net<TypeList<Shards...>> {
    // The last one, if a plain Linear, gathers.
    template <std::size_t... I>
    static auto make(std::index_sequence<I...>) {
      using list = TypeList<Shards...>;
      return static_cast<Sequential<
          Input<Dims...>,
          std::conditional_t<I + 1 == sizeof...(Shards),
                             typename shard_last<type_at_t<I, list>, T>::type,
                             type_at_t<I, list>>...>*>(nullptr);
    }
    using type =
        std::remove_pointer_t<decltype(make(std::make_index_sequence<sizeof...(Shards)>{}))>;
  };
  using type = typename as_net<typename shard_list<T, TypeList<>, false, Ls...>::type>::type;
};

}  // namespace detail

// Net as one rank of T holds it (see the top of this file).
template <class Net, std::size_t T>
using tensor_shard_t = typename detail::tensor_shard<Net, T>::type;

namespace detail {

// The whole layer's parameter count of a bound layer of a sharded network.
template <class L>
constexpr std::size_t whole_params() {
  if constexpr (requires { L::whole_param_count; }) {
    return L::whole_param_count;
  } else if constexpr (BoundBlock<L>) {
    std::size_t total = 0;
    static_for<L::children::size>(
        [&](auto i) { total += whole_params<type_at_t<i, typename L::children>>(); });
    return total;
  } else {
    return L::param_count;
  }
}

// Where bound layer L's parameters on tensor rank `rank` lie in the whole
// layer's: runs (whole, local, count, split) from `whole_at` and `local_at`.
template <class L, class Visit>
void layer_segments(std::size_t rank, std::size_t whole_at, std::size_t local_at,
                    Visit&& visit) {
  if constexpr (requires { L::whole_param_count; }) {
    L::tensor_segments(rank, [&](std::size_t w, std::size_t l, std::size_t count, bool split) {
      visit(whole_at + w, local_at + l, count, split);
    });
  } else if constexpr (BoundBlock<L>) {
    // A block's parameters are its children's, end to end, in both.
    using children = typename L::children;
    std::size_t whole = whole_at;
    static_for<children::size>([&](auto i) {
      using C = type_at_t<i, children>;
      layer_segments<C>(rank, whole, local_at + list_info<children>::param_offsets[i], visit);
      whole += whole_params<C>();
    });
  } else if (L::param_count > 0) {
    visit(whole_at, local_at, L::param_count, false);
  }
}

// TensorParallel's engine: the grid engine over each rank's share of Net
// (tensor_shard_t), the stages cut from the whole network's initial weights
// and made on each rank's device as `stages` makes them (HostStages: the
// CPU's; gpu::DeviceStages). A stage's `segments` place its parameters in
// the whole network's, for the checkpoint's gather and the clipping norm.
template <class Net, class Policy, class Optimizer, class Loss, class Stages = HostStages>
class TensorEngine final : public GridSplitEngine<Net> {
 public:
  using ShardNet = tensor_shard_t<Net, Policy::tensor>;
  static_assert(ShardNet::executed::size == Net::executed::size &&
                    ShardNet::state_count == Net::state_count,
                "TensorParallel: the sharded network runs the whole one's layers");

  TensorEngine(const std::vector<Device>& devices, comm::Comm processes,
               const Model<Net, float>& initial, typename Optimizer::Options options,
               PipelineGrid grid, PipelineSchedule schedule, const Stages& stages = {})
      : GridSplitEngine<Net>(grid_net<Net, Optimizer, Loss>(grid.stages, false),
                             [&](MeshCoordinates at, const Device& device) {
                               return make_stage(grid, at, initial, options, device, stages);
                             },
                             devices, std::move(processes), grid, schedule) {}

  // The parameter runs of tensor rank `rank` over executed layers `range`
  // (merged where they meet), in the whole network's buffer.
  static std::vector<ParamSegment> segments(std::size_t rank, LayerRange range) {
    using whole = list_info<typename Net::executed>;
    using shard = list_info<typename ShardNet::executed>;
    std::vector<ParamSegment> runs;
    static_for<ShardNet::executed::size>([&](auto i) {
      using L = type_at_t<i, typename ShardNet::executed>;
      static_assert(whole_params<L>() == type_at_t<i, typename Net::executed>::param_count,
                    "TensorParallel: a share's whole layer is not the network's layer");
      if (i < range.first || i >= range.last) return;
      layer_segments<L>(rank, whole::param_offsets[i],
                        shard::param_offsets[i] - shard::param_offsets[range.first],
                        [&](std::size_t w, std::size_t l, std::size_t count, bool split) {
                          const bool tied = TiesWeight<L>;
                          if (!runs.empty() && runs.back().split == split &&
                              runs.back().tied_copy == tied &&
                              runs.back().whole + runs.back().count == w &&
                              runs.back().local + runs.back().count == l)
                            runs.back().count += count;
                          else
                            runs.push_back({w, l, count, split, tied});
                        });
    });
    return runs;
  }

 private:
  static std::unique_ptr<PipelineStage> make_stage(const PipelineGrid& grid, MeshCoordinates at,
                                                   const Model<Net, float>& whole,
                                                   typename Optimizer::Options options,
                                                   const Device& device, const Stages& stages) {
    using executed = list_info<typename Net::executed>;
    using shard = list_info<typename ShardNet::executed>;
    std::unique_ptr<PipelineStage> made;
    with_cut<typename Policy::partition>(grid.stages, [&]<class Cut>() {
      constexpr auto bounds = partition_bounds<Net, Cut>::bounds;
      LOOM_CHECK(cuts_between_executed<Net>(bounds), Policy::name,
                 ": a stage cut splits a fused pair (a Linear or convolution and its ReLU); "
                 "cut before or after the pair");
      const LayerRange range{executed_from<Net>(bounds[at.pipe]),
                             executed_from<Net>(bounds[at.pipe + 1])};
      auto runs = segments(at.tensor, range);
      const std::size_t size =
          shard::param_offsets[range.last] - shard::param_offsets[range.first];
      std::vector<float> own(size);
      cut_own(runs, whole.parameters().data(), own);
      const std::size_t state_at = executed::state_offsets[range.first];
      const std::size_t state_size = executed::state_offsets[range.last] - state_at;
      made = stages.template make<ShardNet, Optimizer>(
          own, whole.state().subspan(state_at, state_size), options, 0, state_at, range, device);
      made->segments = std::move(runs);
      made->tensor_rank = at.tensor;
      // The range's layers, numbered from its first as its backward's hooks are.
      std::vector<std::size_t> starts(shard::param_offsets.begin() + range.first,
                                      shard::param_offsets.begin() + range.last + 1);
      for (std::size_t& start : starts) start -= shard::param_offsets[range.first];
      plan_buckets(std::span<const std::size_t>(starts),
                   std::max<std::size_t>(1, grid.bucket_bytes / sizeof(float)),
                   [&](const GradientBucket& b) { made->buckets.push_back(b); });
    });
    return made;
  }
};

}  // namespace detail
}  // namespace loom
