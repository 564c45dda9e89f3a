// DeviceLayers<Net>: a range of a network's executed layers on one GPU,
// which the grid engine's stage (stage.cuh) runs: the range's parameters,
// gradients, optimizer state, activations, ReLU masks and workspace live in
// one device arena sized up front, and each layer's cuBLASLt/cuDNN plan is
// made once per batch size. Weights come from a CPU Model of the same
// network (the same seed gives the same starting point on both backends).
//
// Layer by layer: Linear is one GEMM with a bias(+ReLU) epilogue forward and
// two GEMMs backward. Where a Linear+ReLU feeds another Linear, the forward
// GEMM also keeps the ReLU bit-mask (RELU_AUX_BIAS) and the next layer's
// input-gradient GEMM applies the ReLU derivative and sums the bias gradient
// in its epilogue (DRELU_BGRAD): that layer's backward is then its weight
// GEMM alone, with no elementwise or bias kernel. Conv2d is cuDNN (fused
// conv+bias+ReLU where it offers it); pooling, standalone activations and
// the optimizer updates (SGD, Adam, AdamW) are loom's kernels. Sequences: a
// batch's lengths (set_frames, the CPU's Pass::frames) are mapped through
// the layers on the host and written to the device before each pass;
// Conv1d (conv1d.cuh), BatchNorm over time (layers.cuh) and the recurrent
// runners read them there.
//
// A forward or backward only enqueues work and never waits for the host, so
// the stage can capture it in a CUDA graph; the plans are made before
// (prepare), as planning may run kernels.
//
// bf16 and fp16 keep the buffers fp32 and round what the CPU backend's
// emulation rounds (precision.cuh): the stage rounds the fp32 master weights
// into a copy the layers compute with (round_weights) and the loss gradient;
// the layers round the network's input (in place, in its slot), and each
// layer's output, weight gradients and passed-back gradient as they are
// made. The optimizer updates the master weights.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "../backend/cuda/arena.hpp"
#include "../backend/cuda/conv.cuh"
#include "../backend/cuda/epilogue.cuh"
#include "../backend/cuda/gemm.hpp"
#include "../backend/cuda/memory.hpp"
#include "../backend/cuda/optimizer.cuh"
#include "../backend/cuda/pool.cuh"
#include "../backend/cuda/precision.cuh"
#include "../backend/cuda/staging.hpp"
#include "../backend/cuda/stream.hpp"
#include "../comm/nccl_comm.hpp"
#include "../core/meta.hpp"
#include "../net/model.hpp"
#include "../net/residual.hpp"
#include "../optim/adam.hpp"
#include "../optim/any_optimizer.hpp"
#include "../optim/sgd.hpp"
#include "conv1d.cuh"
#include "cudnn_rnn.cuh"
#include "layer_call.hpp"
#include "layers.cuh"
#include "recurrent.cuh"
#include "tensor_linear.cuh"
#include "transformer.cuh"

namespace loom::gpu {

// The device update of an optimizer's options: the mapping of optim/ onto
// backend/cuda's kernels, which know no optimizer type.
inline DeviceOptimizer device_optimizer(const SGD::Options& o) {
  DeviceOptimizer d;
  d.lr = o.lr;
  d.momentum = o.momentum;
  d.nesterov = o.nesterov;
  d.weight_decay = o.weight_decay;
  return d;
}

namespace detail {
template <class AdamOptions>
DeviceOptimizer adam_optimizer(const AdamOptions& o, bool decoupled) {
  DeviceOptimizer d;
  d.rule = DeviceOptimizer::Rule::adam;
  d.lr = o.lr;
  d.beta1 = o.beta1;
  d.beta2 = o.beta2;
  d.eps = o.eps;
  d.decoupled = decoupled;
  d.weight_decay = o.weight_decay;
  return d;
}
}  // namespace detail
inline DeviceOptimizer device_optimizer(const Adam::Options& o) {
  return detail::adam_optimizer(o, false);
}
inline DeviceOptimizer device_optimizer(const AdamW::Options& o) {
  return detail::adam_optimizer(o, true);
}
// The chosen optimizer's, at the learning rate the options hold now.
inline DeviceOptimizer device_optimizer(const AnyOptimizer::Options& o) {
  return std::visit([](const auto& chosen) { return device_optimizer(chosen); }, o.chosen());
}

namespace detail {

// Where each layer's weights and bias sit in the device's flat parameter
// buffer: the CPU Model's order, each block starting on a 256-byte boundary
// (cuBLASLt's operands and epilogue vectors must be 16-byte aligned; cuDNN
// is fastest at 256). A block's layers (and a Residual's projection) are
// laid out the same way inside the block, so every layer a runner sees is
// aligned however deep it sits. The gaps are zero in parameters and
// gradients alike, so the update over the whole buffer leaves them zero.
inline constexpr std::size_t parameter_align = 64;  // floats
// Floats rounded up to whole 256-byte blocks (parameters and saved areas).
constexpr std::size_t round_to_block(std::size_t n) {
  return (n + parameter_align - 1) / parameter_align * parameter_align;
}

// Blocks (net/block.hpp), told apart by type: a Residual sums its body's
// output with its input or projection; every other block (Series, named
// blocks) runs its layers in sequence, the last writing the block's output.
template <class Spec>
inline constexpr bool is_residual_spec = false;
template <class... Ls>
inline constexpr bool is_residual_spec<Residual<Ls...>> = true;
template <class L>
concept DeviceBlock = ::loom::detail::BoundBlock<L>;
template <class L>
concept ResidualBlock = DeviceBlock<L> && is_residual_spec<typename L::spec>;

// A block's layers as they run (fused; a Residual's body, without its
// projection), and the one among them whose output is the block's (-1:
// none, a Residual makes its own by the sum).
template <DeviceBlock L>
using block_body_t = typename L::chain::body;
template <DeviceBlock L>
constexpr int block_final_owner() {
  if constexpr (ResidualBlock<L>)
    return -1;
  else
    return L::chain::final_owner;
}
// Whether a block has a Residual's projection shortcut.
template <DeviceBlock L>
constexpr bool block_projects() {
  if constexpr (ResidualBlock<L>)
    return !L::identity;
  else
    return false;
}

template <DeviceBlock L>
struct block_layout;

// The first layer that runs in L (L itself, or a block's first child's).
template <class L>
constexpr auto first_leaf_of() {
  if constexpr (DeviceBlock<L>)
    return first_leaf_of<type_at_t<0, typename L::children>>();
  else
    return std::type_identity<L>{};
}
template <class L>
using first_leaf_t = typename decltype(first_leaf_of<L>())::type;

// The ops LayerRunner runs itself, by spec (a fused ReLU keeps the spec of
// the layer it joins).
template <class Spec>
inline constexpr bool is_linear_spec = false;
template <std::size_t O>
inline constexpr bool is_linear_spec<Linear<O>> = true;
template <class Spec>
inline constexpr bool is_conv2d_spec = false;
template <std::size_t O, std::size_t K, std::size_t S, std::size_t P>
inline constexpr bool is_conv2d_spec<Conv2d<O, K, S, P>> = true;
template <class Spec>
inline constexpr bool is_max_pool_spec = false;
template <std::size_t K, std::size_t S>
inline constexpr bool is_max_pool_spec<MaxPool2d<K, S>> = true;
template <class Spec>
inline constexpr bool is_avg_pool_spec = false;
template <std::size_t K, std::size_t S>
inline constexpr bool is_avg_pool_spec<AvgPool2d<K, S>> = true;
template <class Spec>
inline constexpr bool is_conv1d_spec = false;
template <std::size_t O, std::size_t K, std::size_t S, std::size_t P, std::size_t D>
inline constexpr bool is_conv1d_spec<Conv1d<O, K, S, P, D>> = true;
template <class L>
inline constexpr bool is_linear = is_linear_spec<typename L::spec>;
template <class L>
inline constexpr bool is_conv2d = is_conv2d_spec<typename L::spec>;
template <class L>
inline constexpr bool is_pool = is_max_pool_spec<typename L::spec> ||
                                is_avg_pool_spec<typename L::spec>;
template <class L>
inline constexpr bool is_relu_layer = std::is_same_v<typename L::spec, ReLU>;

// A layer's block: its weights, then (aligned) the rest of its parameters.
template <class L>
constexpr std::size_t device_size() {
  if constexpr (DeviceBlock<L>)
    return block_layout<L>::offsets.total;
  else
    return round_to_block(L::weight_count) + round_to_block(L::param_count - L::weight_count);
}

// Where a layer's "bias" pointer starts in its device block (a block's
// parameters are all weights).
template <class L>
constexpr std::size_t weight_block() {
  if constexpr (DeviceBlock<L>)
    return device_size<L>();
  else
    return round_to_block(L::weight_count);
}

template <DeviceBlock L>
struct block_layout {
  using body = block_body_t<L>;
  using info = ::loom::detail::list_info<body>;
  static constexpr std::size_t count = body::size;
  struct Offsets {
    std::array<std::size_t, count> at{};  // each body layer's block in the block
    std::size_t shortcut = 0;             // a Residual's projection's
    std::size_t total = 0;
  };
  static constexpr Offsets offsets = [] {
    Offsets o;
    static_for<count>([&](auto i) {
      o.at[i] = o.total;
      o.total += device_size<type_at_t<i, body>>();
    });
    if constexpr (block_projects<L>()) {
      o.shortcut = o.total;
      o.total += device_size<typename L::shortcut>();
    }
    return o;
  }();
};

template <class List>
struct device_layout;

template <class... Ls>
struct device_layout<TypeList<Ls...>> {
  static constexpr std::size_t count = sizeof...(Ls);
  static constexpr std::array<std::size_t, count> sizes{device_size<Ls>()...};
  static constexpr std::array<std::size_t, count> weight_sizes{weight_block<Ls>()...};
  struct Offsets {
    std::array<std::size_t, count> weight{}, bias{};
    std::size_t total = 0;
  };
  static constexpr Offsets offsets = [] {
    Offsets o;
    for (std::size_t i = 0; i < count; ++i) {
      o.weight[i] = o.total;
      o.bias[i] = o.total + weight_sizes[i];
      o.total += sizes[i];
    }
    return o;
  }();
  static constexpr std::size_t total = offsets.total;
  // Where each layer's block (weights, then bias) starts, and the end.
  static constexpr std::array<std::size_t, count + 1> starts = [] {
    std::array<std::size_t, count + 1> s{};
    for (std::size_t i = 0; i < count; ++i) s[i] = offsets.weight[i];
    s[count] = offsets.total;
    return s;
  }();
};

// Enqueues copying `count` floats between the host and the device, in the
// direction `kind` names.
inline void copy_floats(float* device, float* host, std::size_t count, cudaMemcpyKind kind,
                        cudaStream_t stream) {
  const bool to_device = kind == cudaMemcpyHostToDevice;
  copy_async(to_device ? device : host, to_device ? host : device, count, kind, stream);
}

// Enqueues copying one layer's parameters between the host's flat buffer
// (the CPU Model's order, from host_at) and its device block (at device_at).
template <class L>
void copy_layer_parameters(float* device, float* host, std::size_t device_at, std::size_t host_at,
                           cudaMemcpyKind kind, cudaStream_t stream) {
  if constexpr (DeviceBlock<L>) {
    using R = block_layout<L>;
    static_for<R::count>([&](auto i) {
      copy_layer_parameters<type_at_t<i, typename R::body>>(
          device, host, device_at + R::offsets.at[i], host_at + R::info::param_offsets[i], kind,
          stream);
    });
    if constexpr (block_projects<L>())
      copy_layer_parameters<typename L::shortcut>(device, host, device_at + R::offsets.shortcut,
                                                  host_at + L::body_params, kind, stream);
  } else {
    copy_floats(device + device_at, host + host_at, L::weight_count, kind, stream);
    copy_floats(device + device_at + weight_block<L>(), host + host_at + L::weight_count,
                L::param_count - L::weight_count, kind, stream);
  }
}

// Layer I (a Linear+ReLU) may keep its ReLU mask for layer I+1 (a Linear).
template <class List, std::size_t I>
constexpr bool writes_relu_mask() {
  if constexpr (I + 1 >= List::size) {
    return false;
  } else {
    using L = type_at_t<I, List>;
    using Next = type_at_t<I + 1, List>;
    if constexpr (is_linear<L> && is_linear<Next>)
      return L::activation == Act::relu;
    else
      return false;
  }
}

// Whether layer I must pass a gradient to its input: some layer before it
// has parameters (else the gradient would be computed and thrown away).
template <class List, std::size_t I>
constexpr bool needs_input_gradient() {
  bool any = false;
  static_for<I>([&](auto j) { any = any || type_at_t<j, List>::param_count > 0; });
  return any;
}

// What layer I of a range of List does besides its own work: keep its
// ReLU mask for the next layer's input-gradient GEMM, which applies the
// derivative and sums this layer's bias gradient (only when both are in the
// range: a cut between them hands over a plain gradient), and pass a
// gradient to its input (`sends`: a pipeline stage after the first sends
// its input's to the stage before).
struct RunnerRole {
  bool writes_mask = false;
  bool applies_previous_drelu = false;
  bool input_gradient = true;
};
template <class List, std::size_t I>
constexpr RunnerRole runner_role(LayerRange range, bool sends) {
  bool applies = false;
  if constexpr (I > 0) applies = writes_relu_mask<List, I - 1>() && I > range.first;
  return {.writes_mask = writes_relu_mask<List, I>() && I + 1 < range.last,
          .applies_previous_drelu = applies,
          .input_gradient = needs_input_gradient<List, I>() || sends};
}

template <DeviceBlock L>
class BlockRunner;

// The floats a layer keeps from forward to backward for a batch of n on the
// device. The CPU's layout, except that inside a block each body layer's
// output and saved tensors start on a 256-byte boundary: GEMMs and
// cuDNN are planned for 16-byte aligned pointers at any batch size.
template <class L>
constexpr std::size_t device_saved_floats(std::size_t n);

// The runner of a layer that has one of its own (layers.cuh, conv1d.cuh,
// cudnn_rnn.cuh, recurrent.cuh, transformer.cuh, BlockRunner), chosen by
// the layer's spec (the type it was written as), or void for the ops
// LayerRunner runs itself (convolution, Linear, pooling, ReLU and the
// layers that only rename the shape). InBlock: the layer is inside a
// block, whose saved areas are laid out at compile time; a GRU or LSTM
// there runs on recurrent.cuh's runner, as cuDNN's reserve space has a
// size only cuDNN knows.
template <class L, bool InBlock, class Spec = typename L::spec>
struct kernel_runner {
  using type = void;
};
template <class L, bool B>
struct kernel_runner<L, B, Tanh> {
  using type = PointwiseRunner<L, ::loom::detail::TanhFn>;
};
template <class L, bool B>
struct kernel_runner<L, B, Sigmoid> {
  using type = PointwiseRunner<L, ::loom::detail::SigmoidFn>;
};
template <class L, bool B>
struct kernel_runner<L, B, GELU> {
  using type = PointwiseRunner<L, ::loom::detail::GeluFn>;
};
template <class L, bool B>
struct kernel_runner<L, B, GlobalAvgPool> {
  using type = GlobalAvgPoolRunner<L>;
};
template <class L, bool B, double P>
struct kernel_runner<L, B, Dropout<P>> {
  using type = DropoutRunner<L>;
};
template <class L, bool B, BatchNormSpec S>
struct kernel_runner<L, B, S> {
  using type = BatchNormRunner<L>;
};
template <class L, bool B, std::size_t O, std::size_t K, std::size_t S, std::size_t P,
          std::size_t D>
struct kernel_runner<L, B, Conv1d<O, K, S, P, D>> {
  using type = Conv1dRunner<L>;
};
template <class L, bool InBlock>
using recurrent_runner_t =
    std::conditional_t<InBlock, RecurrentRunner<L>, CudnnRecurrentRunner<L>>;
template <class L, bool B, std::size_t H, bool Seq, bool Bi>
struct kernel_runner<L, B, GRU<H, Seq, Bi>> {
  using type = recurrent_runner_t<L, B>;
};
template <class L, bool B, std::size_t H, bool Seq, bool Bi>
struct kernel_runner<L, B, LSTM<H, Seq, Bi>> {
  using type = recurrent_runner_t<L, B>;
};
template <class L, bool B, class... Ls>
struct kernel_runner<L, B, Residual<Ls...>> {
  using type = BlockRunner<L>;
};
template <class L, bool B, class S>
  requires std::derived_from<S, NamedBlock>
struct kernel_runner<L, B, S> {
  using type = BlockRunner<L>;
};
template <class L, bool B, std::size_t V, std::size_t W>
struct kernel_runner<L, B, Embedding<V, W>> {
  using type = EmbeddingRunner<L>;
};
template <class L, bool B>
struct kernel_runner<L, B, PositionEmbedding> {
  using type = PositionEmbeddingRunner<L>;
};
template <class L, bool B, std::size_t O, std::size_t T>
struct kernel_runner<L, B, TiedLinear<O, T>> {
  using type = TiedLinearRunner<L>;
};
template <class L, bool B>
struct kernel_runner<L, B, LayerNorm> {
  using type = RowNormRunner<L, true>;
};
template <class L, bool B>
struct kernel_runner<L, B, RMSNorm> {
  using type = RowNormRunner<L, false>;
};
template <class L, bool B, std::size_t H, class P>
struct kernel_runner<L, B, CausalSelfAttention<H, P>> {
  using type = AttentionRunner<L>;
};
// TensorParallel's shares of a Linear (its share of an attention keeps the
// attention's spec, above).
template <class L, bool B, std::size_t N, std::size_t T>
struct kernel_runner<L, B, TensorColumns<Linear<N>, T>> {
  using type = TensorLinearRunner<L, TensorSplit::columns>;
};
template <class L, bool B, std::size_t N, std::size_t T>
struct kernel_runner<L, B, TensorRows<Linear<N>, T>> {
  using type = TensorLinearRunner<L, TensorSplit::rows>;
};
template <class L, bool B, std::size_t N, std::size_t T>
struct kernel_runner<L, B, TensorGather<Linear<N>, T>> {
  using type = TensorLinearRunner<L, TensorSplit::gather>;
};
template <class L, bool InBlock>
using kernel_runner_t = typename kernel_runner<L, InBlock>::type;

// A runner that plans its launches from the host's lengths (cuDNN's RNN):
// a call with lengths may not be captured (its capturable(call)).
template <class L>
concept plans_from_host_lengths =
    requires(const LayerCall& c) { kernel_runner_t<L, false>::capturable(c); };

// How one executed layer runs on the GPU for one batch size, in its `role`.
// `library_limit` caps the workspace its cuBLASLt and cuDNN algorithms may
// ask for.
template <class L, bool InBlock = false>
class LayerRunner {
  using Kernel = kernel_runner_t<L, InBlock>;

 public:
  LayerRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
              TensorMath math, RunnerRole role)
      : batch_(batch), role_(role) {
    const bool tensor_cores = math != TensorMath::fp32;
    if constexpr (std::is_constructible_v<Kernel, DeviceContext&, std::size_t, std::size_t,
                                          TensorMath>) {
      kernel_ = std::make_unique<Kernel>(context, batch, library_limit, math);
    } else if constexpr (!std::is_void_v<Kernel>) {
      // Their GEMMs (recurrent.cuh) take TF32 when tensor cores are allowed.
      kernel_ = std::make_unique<Kernel>(context, batch, library_limit, tensor_cores);
    } else if constexpr (is_conv2d<L>) {
      conv_ = std::make_unique<Convolution>(
          context.dnn, L::geometry(batch), out_channels,
          ConvOptions{.allow_tensor_ops = tensor_cores, .workspace_limit = library_limit});
    } else if constexpr (is_linear<L>) {
      constexpr std::size_t in = L::in_features, out_channels = L::out_features;
      // Over Frames x Features it acts per position: a row per sample and position.
      const std::size_t rows = batch * L::positions;
      const GemmOptions options = gemm_options(math, library_limit);
      const Epilogue forward = L::activation != Act::relu ? Epilogue::bias
                               : role.writes_mask        ? Epilogue::relu_aux_bias
                                                         : Epilogue::relu_bias;
      forward_ = std::make_unique<GemmPlan>(
          context.blas, GemmShape{false, true, rows, out_channels, in, in, in, out_channels},
          forward, options);
      // With the mask kept, the next layer's GEMM has already summed the bias gradient.
      weight_grad_ = std::make_unique<GemmPlan>(
          context.blas, GemmShape{true, false, out_channels, in, rows, out_channels, in, in},
          role.writes_mask ? Epilogue::none : Epilogue::bgrad_a, options);
      if (role.input_gradient)
        input_grad_ = std::make_unique<GemmPlan>(
            context.blas, GemmShape{false, false, rows, in, out_channels, out_channels, in, in},
            role.applies_previous_drelu ? Epilogue::drelu_bgrad : Epilogue::none, options);
    }
  }

  // The scratch a batch of n needs besides its libraries' workspace (which
  // then gets the rest of the shared scratch).
  static std::size_t fixed_bytes(std::size_t n) {
    if constexpr (requires { Kernel::fixed_bytes(n); })
      return Kernel::fixed_bytes(n);
    else if constexpr (std::is_void_v<Kernel>)
      return DeviceArena::padded_bytes<float>(n * L::output_shape::size);
    else
      return 0;
  }

  // The floats its forward keeps for its backward, for its batch: the
  // layer's saved tensors (device_saved_floats), or what cuDNN's RNN asks.
  std::size_t saved_floats() const {
    if constexpr (requires { kernel_->saved_floats(); })
      return kernel_->saved_floats();
    else
      return device_saved_floats<L>(batch_);
  }

  // The gradient after the activation derivative (dZ) + the libraries' own.
  std::size_t scratch_bytes() const {
    if constexpr (!std::is_void_v<Kernel>) return kernel_->scratch_bytes();
    std::size_t library = 0;
    if (conv_) library = conv_->workspace_bytes();
    for (const auto* plan : {forward_.get(), weight_grad_.get(), input_grad_.get()})
      if (plan != nullptr) library = std::max(library, plan->workspace_bytes());
    return dz_bytes() + library;
  }

  void forward(const LayerCall& c) {
    if constexpr (!std::is_void_v<Kernel>) {
      kernel_->forward(c);
    } else if constexpr (is_conv2d<L>) {
      conv_->forward_bias_act(c.x, c.weights, c.bias, c.y, activation_is_relu(),
                              library(c.scratch), library_size(c.scratch_bytes));
    } else if constexpr (is_linear<L>) {
      GemmArgs args = gemm_args(c.x, c.weights, c.y, c);
      args.bias = c.bias;
      if (role_.writes_mask) args.relu_mask_out = c.mask;
      forward_->run(args);
    } else if constexpr (is_pool<L>) {
      pool_forward<is_max_pool_spec<typename L::spec>>(L::geometry(batch_), c.x, c.y, c.stream);
    } else if constexpr (is_relu_layer<L>) {
      activation_forward<Act::relu>(c.x, c.y, batch_ * L::output_shape::size, c.stream);
    } else if constexpr (!L::in_place) {
      static_assert(dependent_false<L>,
                    "No CUDA runner for this layer (the template argument names it); add one "
                    "to kernel_runner");
    }
  }

  void backward(const LayerCall& c) {
    float* dz = reinterpret_cast<float*>(c.scratch);
    if constexpr (!std::is_void_v<Kernel>) {
      kernel_->backward(c);
    } else if constexpr (is_conv2d<L>) {
      conv_->bias_act_backward(c.dy, c.y, dz, c.dbias, activation_is_relu(), false);
      conv_->backward_filter(c.x, dz, c.dweights, false, library(c.scratch),
                             library_size(c.scratch_bytes));
      if (c.dx != nullptr)
        conv_->backward_data(c.weights, dz, c.dx, library(c.scratch),
                             library_size(c.scratch_bytes));
    } else if constexpr (is_linear<L>) {
      // With the mask kept, dy is already dZ (the next layer's epilogue made it).
      const float* grad = c.dy;
      if (L::activation == Act::relu && !role_.writes_mask) {
        activation_backward<Act::relu>(c.dy, c.y, dz, batch_ * L::output_shape::size, c.stream);
        grad = dz;
      }
      GemmArgs weights = gemm_args(grad, c.x, c.dweights, c);
      if (!role_.writes_mask) weights.bias_grad = c.dbias;
      weight_grad_->run(weights);
      if (c.dx != nullptr) {
        GemmArgs input = gemm_args(grad, c.weights, c.dx, c);
        if (role_.applies_previous_drelu) {
          input.relu_mask_in = c.previous_mask;
          input.bias_grad = c.previous_dbias;
        }
        input_grad_->run(input);
      }
    } else if constexpr (is_pool<L>) {
      if (c.dx != nullptr)
        pool_backward<is_max_pool_spec<typename L::spec>>(L::geometry(batch_), c.x, c.dy, c.dx,
                                                          c.stream);
    } else if constexpr (is_relu_layer<L>) {
      if (c.dx != nullptr)
        activation_backward<Act::relu>(c.dy, c.y, c.dx, batch_ * L::output_shape::size, c.stream);
    }
  }

 private:
  static constexpr std::size_t out_channels = L::output_shape::dims[0];

  static constexpr bool activation_is_relu() {
    if constexpr (requires { L::activation; })
      return L::activation == Act::relu;
    else
      return false;
  }
  std::size_t dz_bytes() const {
    return DeviceArena::padded_bytes<float>(batch_ * L::output_shape::size);
  }
  unsigned char* library(unsigned char* scratch) const { return scratch + dz_bytes(); }
  std::size_t library_size(std::size_t scratch_bytes) const { return scratch_bytes - dz_bytes(); }
  // The pointers every GEMM of the layer shares; callers add their epilogue's.
  GemmArgs gemm_args(const float* a, const float* b, float* out, const LayerCall& c) const {
    return gemm_call(a, b, out, library(c.scratch), library_size(c.scratch_bytes), c.stream);
  }

  std::size_t batch_;
  RunnerRole role_;
  struct NoKernel {};
  [[no_unique_address]] std::conditional_t<std::is_void_v<Kernel>, NoKernel,
                                           std::unique_ptr<Kernel>> kernel_;
  std::unique_ptr<Convolution> conv_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

// A block's layers run by the same runners as the top level's (without
// the ReLU-mask hand-over between Linear layers), each passing a gradient
// to its input.
template <class Body, class Indices>
struct body_runners;
template <class Body, std::size_t... I>
struct body_runners<Body, std::index_sequence<I...>> {
  using type = std::tuple<LayerRunner<type_at_t<I, Body>, true>...>;
};

// Body layer I's region of block L's saved area: its output (unless it
// works in place or writes the block's), then its saved tensors.
template <class L, std::size_t I>
constexpr std::size_t block_region_floats(std::size_t n) {
  using B = type_at_t<I, block_body_t<L>>;
  const bool own_output = !B::in_place && static_cast<int>(I) != block_final_owner<L>();
  return (own_output ? round_to_block(n * B::output_shape::size) : 0) + device_saved_floats<B>(n);
}

// Where body layer I's region starts.
template <class L, std::size_t I>
constexpr std::size_t block_region_at(std::size_t n) {
  std::size_t at = 0;
  static_for<I>([&](auto j) { at += block_region_floats<L, j>(n); });
  return at;
}

template <class L>
constexpr std::size_t device_saved_floats(std::size_t n) {
  if constexpr (DeviceBlock<L>)
    return block_region_at<L, block_body_t<L>::size>(n);
  else
    return L::saved == 0 ? 0 : round_to_block(n * L::saved);
}

// The runner of a Residual's projection shortcut, or none.
struct NoShortcut {
  static std::size_t fixed_bytes(std::size_t) { return 0; }
};
template <DeviceBlock L>
constexpr auto shortcut_runner_of() {
  if constexpr (block_projects<L>())
    return std::type_identity<LayerRunner<typename L::shortcut, true>>{};
  else
    return std::type_identity<NoShortcut>{};
}

// A block on the GPU, as the CPU runs it (net/block.hpp's Chain): the
// body's outputs and saved tensors sit in the block's saved area
// (device_saved_floats' layout); backward runs the body in reverse over two
// gradient buffers at the start of the scratch. A Residual: y = body(x) +
// shortcut(x), and backward runs the projection (or copies dy) and adds the
// body's input gradient. A sequence block (Series, named blocks): its
// last layer writes the block's output, and its first the block's input
// gradient. In a reduced precision the body's outputs and passed-back
// gradients, and the projection's, are rounded as the CPU rounds them.
template <DeviceBlock L>
class BlockRunner {
  using Body = block_body_t<L>;
  using R = block_layout<L>;
  using Info = typename R::info;
  static constexpr std::size_t count = Body::size;
  static constexpr bool residual = ResidualBlock<L>;
  static constexpr bool projects = block_projects<L>();
  static constexpr int final_owner = block_final_owner<L>();
  using Runners = typename body_runners<Body, std::make_index_sequence<count>>::type;
  using Shortcut = typename decltype(shortcut_runner_of<L>())::type;

 public:
  BlockRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
              TensorMath math)
      : batch_(batch),
        body_(make_body(context, batch, library_limit, math, std::make_index_sequence<count>{})) {
    if constexpr (projects)
      shortcut_ = std::make_unique<Shortcut>(
          context, batch, limit_for(Shortcut::fixed_bytes(batch), batch, library_limit), math,
          RunnerRole{});
  }

  // Two gradient buffers, then the largest of the body's and projection's needs.
  static std::size_t fixed_bytes(std::size_t n) { return 2 * gradient_bytes(n) + largest_fixed(n); }
  std::size_t scratch_bytes() const {
    std::size_t inner = 0;
    static_for<count>([&](auto i) { inner = std::max(inner, std::get<i>(body_).scratch_bytes()); });
    if constexpr (projects) inner = std::max(inner, shortcut_->scratch_bytes());
    return 2 * gradient_bytes(batch_) + inner;
  }

  void forward(const LayerCall& c) {
    static_for<count>([&](auto i) {
      using B = type_at_t<i, Body>;
      std::get<i>(body_).forward(body_call<i>(c));
      if constexpr (!B::in_place)
        round_values(c.precision, output<i>(c), batch_ * B::output_shape::size, c.stream);
    });
    if constexpr (residual) {
      const float* body_out = output<count - 1>(c);
      const std::size_t out = batch_ * L::output_shape::size;
      if constexpr (projects) {
        shortcut_->forward(shortcut_call(c));
        round_values(c.precision, c.y, out, c.stream);
      } else {
        copy_async(c.y, c.x, out, cudaMemcpyDeviceToDevice, c.stream);
      }
      // The sum is rounded by the owner, as any layer's output.
      add_into(c.y, body_out, out, c.stream);
    }
  }

  void backward(const LayerCall& c) {
    std::array<float*, 2> gradients{
        reinterpret_cast<float*>(c.scratch),
        reinterpret_cast<float*>(c.scratch + gradient_bytes(batch_))};
    const std::size_t in = batch_ * L::input_shape::size;
    if constexpr (projects) {
      // The projection has no activation: its output is not read, dy stands in.
      LayerCall s = shortcut_call(c);
      s.y = const_cast<float*>(c.dy);
      s.dy = c.dy;
      s.dx = c.dx;
      shortcut_->backward(s);
      if (c.dx != nullptr) round_values(c.precision, c.dx, in, c.stream);
    } else if constexpr (residual) {
      if (c.dx != nullptr) copy_async(c.dx, c.dy, in, cudaMemcpyDeviceToDevice, c.stream);
    }
    // A Residual's body adds its input gradient to the shortcut's; a
    // sequence's first layer writes the block's.
    const float* gradient = c.dy;
    int next = 0;
    static_for_reverse<count>([&](auto i) {
      using B = type_at_t<i, Body>;
      LayerCall b = body_call<i>(c);
      b.dy = gradient;
      b.dx = gradients[next];
      if constexpr (i == 0)
        if (c.dx == nullptr || !residual) b.dx = c.dx;
      std::get<i>(body_).backward(b);
      // The block's weight gradients are rounded by the owner, all at once.
      if constexpr (!B::in_place) {
        if (b.dx != nullptr) round_values(c.precision, b.dx, batch_ * B::input_shape::size, c.stream);
        gradient = b.dx;
        next = 1 - next;
      }
    });
    if (c.dx == nullptr) return;
    if constexpr (residual)
      add_into(c.dx, gradient, in, c.stream);
    else if (gradient != c.dx)
      copy_async(c.dx, gradient, in, cudaMemcpyDeviceToDevice, c.stream);
  }

 private:
  static std::size_t gradient_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * Info::largest_activation);
  }
  static std::size_t largest_fixed(std::size_t n) {
    std::size_t most = Shortcut::fixed_bytes(n);
    static_for<count>([&](auto i) {
      most = std::max(most, std::tuple_element_t<i, Runners>::fixed_bytes(n));
    });
    return most;
  }
  // The room an inner layer's libraries get: what the block's limit leaves
  // after the block's largest fixed need, plus what this layer leaves of it.
  static std::size_t limit_for(std::size_t fixed, std::size_t n, std::size_t library_limit) {
    if (library_limit == std::numeric_limits<std::size_t>::max()) return library_limit;
    return library_limit + (largest_fixed(n) - fixed);
  }
  template <std::size_t... I>
  static Runners make_body(DeviceContext& context, std::size_t n, std::size_t library_limit,
                           TensorMath math, std::index_sequence<I...>) {
    return Runners{std::tuple_element_t<I, Runners>(
        context, n,
        limit_for(std::tuple_element_t<I, Runners>::fixed_bytes(n), n, library_limit), math,
        RunnerRole{})...};
  }

  template <std::size_t I>
  float* output(const LayerCall& c) const {
    constexpr int owner = Info::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<float*>(c.x);
    else if constexpr (owner == final_owner)
      return c.y;
    else
      return c.saved + block_region_at<L, static_cast<std::size_t>(owner)>(batch_);
  }
  template <std::size_t I>
  const float* input(const LayerCall& c) const {
    if constexpr (I == 0)
      return c.x;
    else
      return output<I - 1>(c);
  }
  // What every inner call shares: the stream, the pass, the scratch after
  // the gradient buffers.
  LayerCall inner_call(const LayerCall& c, std::size_t at, std::size_t bias_at) const {
    LayerCall b;
    b.weights = c.weights + at;
    b.bias = c.weights + at + bias_at;
    b.dweights = c.dweights + at;
    b.dbias = c.dweights + at + bias_at;
    b.scratch = c.scratch + 2 * gradient_bytes(batch_);
    b.scratch_bytes = c.scratch_bytes - 2 * gradient_bytes(batch_);
    b.stream = c.stream;
    b.training = c.training;
    b.pass = c.pass;
    b.replicas = c.replicas;
    b.tensor = c.tensor;
    b.precision = c.precision;
    // A block's layers keep the samples' lengths (none inside changes them).
    b.frames = c.frames;
    b.host_frames = c.host_frames;
    return b;
  }
  template <std::size_t I>
  LayerCall body_call(const LayerCall& c) const {
    using B = type_at_t<I, Body>;
    LayerCall b = inner_call(c, R::offsets.at[I], weight_block<B>());
    b.x = input<I>(c);
    b.y = output<I>(c);
    b.state = c.state + Info::state_offsets[I];
    const bool own_output = !B::in_place && static_cast<int>(I) != final_owner;
    b.saved = c.saved + block_region_at<L, I>(batch_) +
              (own_output ? round_to_block(batch_ * B::output_shape::size) : 0);
    return b;
  }
  LayerCall shortcut_call(const LayerCall& c) const {
    LayerCall s = inner_call(c, R::offsets.shortcut, weight_block<typename L::shortcut>());
    s.x = c.x;
    s.y = c.y;
    return s;
  }

  std::size_t batch_;
  Runners body_;
  std::unique_ptr<Shortcut> shortcut_;
};

template <class List, class Indices>
struct runners;
template <class List, std::size_t... I>
struct runners<List, std::index_sequence<I...>> {
  using type = std::tuple<std::optional<LayerRunner<type_at_t<I, List>>>...>;
};

// The runner of every layer of a range of List for each batch size seen,
// made on first use (the layers outside the range have none). The largest
// batch's plans size the scratch all layers share; smaller batches'
// algorithms are held to the room that leaves (dZ of a smaller batch is
// smaller).
template <class List>
class PlanCache {
 public:
  using Runners = typename runners<List, std::make_index_sequence<List::size>>::type;

  PlanCache(DeviceContext& context, LayerRange range, bool sends, std::size_t max_batch,
            TensorMath math)
      : context_(context), range_(range), sends_(sends), max_batch_(max_batch), math_(math) {
    auto first = make(max_batch, false);
    for_each(*first, [&](auto, auto& runner) {
      scratch_bytes_ = std::max(scratch_bytes_, runner.scratch_bytes());
    });
    plans_.emplace(max_batch, std::move(first));
  }

  std::size_t scratch_bytes() const { return scratch_bytes_; }
  // Layer I's saved area for the largest batch, in floats (what the owner
  // allocates; smaller batches need no more).
  template <std::size_t I>
  std::size_t saved_floats() const {
    return std::get<I>(*plans_.at(max_batch_))->saved_floats();
  }

  Runners& get(std::size_t n) {
    auto found = plans_.find(n);
    if (found != plans_.end()) return *found->second;
    auto made = make(n, true);
    for_each(*made, [&](auto i, auto& runner) {
      LOOM_CHECK(runner.scratch_bytes() <= scratch_bytes_, "layer ", i + 1,
                 "'s algorithms for a batch of ", n, " need ", runner.scratch_bytes(),
                 " bytes of scratch but ", scratch_bytes_, " were planned for ", max_batch_);
      LOOM_CHECK(runner.saved_floats() <= saved_floats<i>(), "layer ", i + 1, " keeps ",
                 runner.saved_floats(), " floats for a batch of ", n, " but ", saved_floats<i>(),
                 " were planned for ", max_batch_);
    });
    return *plans_.emplace(n, std::move(made)).first->second;
  }

 private:
  template <std::size_t I>
  using runner_t = typename std::tuple_element_t<I, Runners>::value_type;

  // f(index, runner) for the range's layers.
  template <class F>
  void for_each(Runners& runners, F&& f) const {
    static_for<List::size>([&](auto i) {
      if (i >= range_.first && i < range_.last) f(i, *std::get<i>(runners));
    });
  }
  // Within the scratch planned for the largest batch, each layer's
  // algorithms get the room its own buffers for n samples leave.
  template <std::size_t I>
  std::size_t library_limit(std::size_t n, bool planned) const {
    if (!planned) return std::numeric_limits<std::size_t>::max();
    const std::size_t fixed = runner_t<I>::fixed_bytes(n);
    return fixed < scratch_bytes_ ? scratch_bytes_ - fixed : 0;
  }
  std::unique_ptr<Runners> make(std::size_t n, bool planned) {
    auto made = std::make_unique<Runners>();
    static_for<List::size>([&](auto i) {
      if (i >= range_.first && i < range_.last)
        std::get<i>(*made).emplace(context_, n, library_limit<i>(n, planned), math_,
                                   runner_role<List, i>(range_, sends_));
    });
    return made;
  }

  DeviceContext& context_;
  LayerRange range_;
  bool sends_;
  std::size_t max_batch_;
  TensorMath math_;
  std::size_t scratch_bytes_ = 0;
  std::map<std::size_t, std::unique_ptr<Runners>> plans_;
};

}  // namespace detail

// The layers `range` of Net's executed list on the current GPU: their plans
// for each batch size, weights (and in bf16 and fp16 the rounded copy the
// layers compute with), gradients, optimizer buffers, running statistics
// (and their copy at a step's start), and the activations of `slots`
// batches of up to max_batch samples in flight. A grid engine's stage
// (stage.cuh) runs its share on it: one type for every stage of every cut
// between executed layers, the whole network included.
// The device layout is the whole network's (device_layout) from the range's
// first block on, and host buffers are the range's slice of the CPU Model's.
// A range after the network's first layer (or `sends`, a later stage's own
// network) passes back its input's gradient.
//
// bf16 and fp16 round what the CPU backend's emulation rounds
// (precision.cuh): the network's input, each layer's
// output, weight gradients and passed-back gradient (the owner rounds the
// weights, round_weights, and the loss gradient).
template <class Net>
class DeviceLayers {
 public:
  using executed = typename Net::executed;
  using layout = detail::device_layout<executed>;
  using info = ::loom::detail::list_info<executed>;
  static constexpr std::size_t layer_count = executed::size;

  DeviceLayers(DeviceContext& context, LayerRange range, std::size_t max_batch,
               std::size_t slots, std::size_t optimizer_buffers, Precision precision,
               TensorMath math, const std::string& owner, bool sends = false)
      : context_(context),
        range_(checked(range)),
        sends_(sends || range.first > 0),
        base_(layout::starts[range.first]),
        total_(layout::starts[range.last] - base_),
        host_base_(info::param_offsets[range.first]),
        state_base_(info::state_offsets[range.first]),
        state_count_(info::state_offsets[range.last] - state_base_),
        max_batch_(max_batch),
        buffers_(optimizer_buffers),
        precision_(precision),
        plans_(context, range, sends_, max_batch, math),
        slots_(slots) {
    each([&](auto i) {
      using L = type_at_t<i, executed>;
      if (i == range_.first) {
        in_size_ = L::input_shape::size;
        first_in_place_ = L::in_place;
      }
      largest_ = std::max({largest_, L::input_shape::size, L::output_shape::size});
      contextual_ = contextual_ || L::contextual;
    });
    arena_ = make_arena([&](auto&& take) { lay_out(take); }, owner);
    // The gaps between blocks stay zero in every buffer the update reads.
    for (float* buffer : {params_, compute_params_, grads_, moments_[0], moments_[1]})
      if (buffer != nullptr)
        LOOM_CUDA_CHECK(cudaMemsetAsync(buffer, 0, total_ * sizeof(float), stream()));
  }
  DeviceLayers(const DeviceLayers&) = delete;
  DeviceLayers& operator=(const DeviceLayers&) = delete;

  cudaStream_t stream() const { return context_.stream.get(); }
  std::size_t max_batch() const { return max_batch_; }
  // Floats of each parameter-sized device buffer (the gaps included).
  std::size_t parameters() const { return total_; }
  std::size_t state_count() const { return state_count_; }
  float* params() const { return params_; }
  float* grads() const { return grads_; }
  float* moment(std::size_t b) const { return moments_[b]; }
  float* state() const { return state_; }
  float* kept_state() const { return kept_state_; }
  // Where backward starts: the loss gradient (or the next stage's), n x the
  // range's output size.
  float* output_gradient() const { return grad_buffers_[0]; }
  // Where a range that sends leaves its input's gradient (else null).
  float* input_gradient() const { return input_gradient_; }
  // What slot's Dropout draws from (device memory the owner writes).
  DevicePass* pass(std::size_t slot) const { return slots_[slot].pass; }
  // Slot's output: the range's last layer's (its input when every layer
  // of the range works in place).
  float* output(std::size_t slot) const {
    const Slot& s = slots_[slot];
    return output_is_input()
               ? s.input
               : s.outputs[static_cast<std::size_t>(info::output_owner[range_.last - 1])];
  }
  // Whether the range's output is its input (every layer of it in place).
  bool output_is_input() const {
    return info::output_owner[range_.last - 1] < static_cast<int>(range_.first);
  }
  // Whether a layer of the range reads the pass (Dropout, BatchNorm).
  bool contextual() const { return contextual_; }

  // Sequences (loom::Pass::frames): each of n samples' frames at the
  // network's input for slot's forwards and backwards from now on (null:
  // every sample has all its frames), checked as the CPU layers check them
  // and mapped through every layer that changes them up to the range's end
  // (ChangesFrames, as the CPU Model maps them). Every layer's input
  // lengths are written to the slot's device table, enqueued: a step
  // captured in a graph reads the table at replay, so it takes the lengths
  // written before it. The host table is pinned, so the copy leaves the
  // host free (from pageable memory the driver may wait for the stream),
  // and it is written again only once its last copy has run.
  void set_frames(std::size_t slot, const std::int32_t* frames, std::size_t n) {
    Slot& s = slots_[slot];
    s.frames_count = 0;
    if (frames == nullptr) return;
    check_batch(n);
    constexpr std::size_t input_frames = type_at_t<0, executed>::input_shape::dims[0];
    for (std::size_t k = 0; k < n; ++k)
      LOOM_CHECK(frames[k] >= 0 && static_cast<std::size_t>(frames[k]) <= input_frames,
                 "sample ", k, " of the batch has length ", frames[k], ", outside 0..",
                 input_frames, " (the frames the network's input holds); check the lengths the "
                 "batch carries");
    if (s.host_frames.size() == 0) {
      s.host_frames = PinnedBuffer<std::int32_t>(frames_rows * max_batch_);
      std::fill_n(s.host_frames.data(), s.host_frames.size(), 0);
    }
    s.frames_copied.synchronize();
    std::copy(frames, frames + n, s.host_frames.data());
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (ChangesFrames<L>) {
        if (i >= range_.last) return;
        const std::int32_t* in = s.host_frames.data() + frames_rules_before[i] * max_batch_;
        std::int32_t* out = s.host_frames.data() + (frames_rules_before[i] + 1) * max_batch_;
        for (std::size_t k = 0; k < n; ++k) {
          out[k] = static_cast<std::int32_t>(L::frames_out(static_cast<std::size_t>(in[k])));
          // The CPU's Conv1d refuses a sample it leaves without a frame.
          if constexpr (detail::is_conv1d_spec<typename L::spec>)
            LOOM_CHECK(out[k] > 0, ::loom::detail::type_label<typename L::spec>(), " (layer ", L::index,
                       "): sample ", k, " of the batch has ", in[k], " frames; padded by ",
                       L::spec::pad, " at both ends that is shorter than the ", L::span,
                       " frames the window spans, so it has no output frame; leave such short "
                       "sequences out of the data or use a smaller kernel, dilation or more "
                       "padding");
        }
      }
    });
    copy_async(s.frames, s.host_frames.data(), s.host_frames.size(), cudaMemcpyHostToDevice,
               stream());
    s.frames_copied.record(stream());
    s.frames_count = n;
  }
  // How many samples' lengths slot holds (0: none, every frame valid).
  std::size_t frames_count(std::size_t slot) const { return slots_[slot].frames_count; }
  // Their lengths at the range's output (host memory, until slot's next
  // set_frames), or null when it holds none.
  const std::int32_t* output_frames(std::size_t slot) const {
    const Slot& s = slots_[slot];
    if (s.frames_count == 0) return nullptr;
    return s.host_frames.data() + frames_rules_before[range_.last] * max_batch_;
  }
  // Before a training step of n samples with lengths: a BatchNorm over time
  // needs a valid frame to take statistics from, as the CPU's refuses
  // (across replicas the other ranks' frames count too: not checked here).
  void check_training_frames(std::size_t slot, std::size_t n) const {
    const Slot& s = slots_[slot];
    if (s.frames_count == 0) return;
    each([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (batch_norm_over_time<L>()) {
        if (L::syncs && replicas_ != nullptr) return;
        const std::int32_t* at = s.host_frames.data() + frames_rules_before[i] * max_batch_;
        std::size_t valid = 0;
        for (std::size_t k = 0; k < n; ++k) valid += static_cast<std::size_t>(at[k]);
        LOOM_CHECK(valid > 0, ::loom::detail::type_label<typename L::spec>(), " (layer ", L::index,
                   ") in training: no sample of the batch has a valid frame (every length is "
                   "0), so there are no statistics to normalise with; leave empty sequences out "
                   "of the data");
      }
    });
  }
  // A first stage's batch, on the host before it goes over: token ids are
  // checked as the CPU's Embedding checks them, with its message (the
  // gather reads the table at each id).
  void check_input(const float* host, std::size_t n) const {
    if constexpr (requires { first_layer::check_ids(host, n); })
      if (range_.first == 0) first_layer::check_ids(host, n);
  }

  // SyncBatchNorm sums its statistics over these ranks (null: one device).
  void set_replicas(comm::NcclComm* replicas) { replicas_ = replicas; }
  // TensorParallel's split layers sum and gather over this group (null: no split layer).
  void set_tensor(DeviceTensorGroup* tensor) { tensor_ = tensor; }

  // Before a step's or an evaluation's first forward, in a reduced
  // precision: the weights the layers compute with, rounded again from the
  // master weights (an update or the host changed them).
  void round_weights() {
    if (reduced()) round_copy(precision_, params_, compute_params_, total_, stream());
  }
  // The running statistics at a step's start, kept; or put back when the
  // step is skipped (enqueued).
  void keep_state() {
    copy_async(kept_state_, state_, state_count_, cudaMemcpyDeviceToDevice, stream());
  }
  void restore_state() {
    copy_async(state_, kept_state_, state_count_, cudaMemcpyDeviceToDevice, stream());
  }

  // Makes the plans for batches of n now (planning may run kernels: a
  // captured step plans before its capture).
  void prepare(std::size_t n) {
    check_batch(n);
    plans_.get(n);
  }

  // What slot's next forward takes, and its backward reads on the host:
  // its input, and whether it trains. forward sets them; an owner that
  // replays a captured forward (whose host code does not run) sets them
  // first.
  void bind(std::size_t slot, float* input, bool training) {
    Slot& s = slots_[slot];
    s.input = input;
    s.training = training;
  }

  // Runs the range on n samples at `input` (n x its input size, in device
  // memory that stays until backward) in `slot`.
  void forward(std::size_t slot, float* input, std::size_t n, bool training) {
    check_batch(n);
    auto& plan = plans_.get(n);
    bind(slot, input, training);
    const Slot& s = slots_[slot];
    // The network's input (a later stage's, the stage before rounded).
    // Rounding it again (a slot stepped on twice) changes nothing.
    if (!sends_ && !takes_ids) round_values(precision_, input, n * in_size_, stream());
    each([&](auto i) {
      using L = type_at_t<i, executed>;
      std::get<i>(plan)->forward(call<i>(s));
      if constexpr (!L::in_place)
        round_values(precision_, output_of<i>(s), n * L::output_shape::size, stream());
    });
  }

  // Back-propagates slot's last forward from output_gradient(), overwriting
  // the gradients; done(i) as layer `first + i`'s gradients are final.
  // Where layer I applies layer I-1's ReLU derivative, its GEMM summed layer
  // I-1's bias gradient before the rounding: in a reduced precision it is
  // summed again from the rounded gradient, as the CPU sums it, and rounded
  // with layer I-1's block.
  template <class OnLayerDone>
  void backward(std::size_t slot, std::size_t n, OnLayerDone&& done) {
    check_batch(n);
    auto& plan = plans_.get(n);
    const Slot& s = slots_[slot];
    int current = 0;
    each_reverse([&](auto i) {
      using L = type_at_t<i, executed>;
      const detail::RunnerRole role = detail::runner_role<executed, i>(range_, sends_);
      detail::LayerCall c = call<i>(s);
      c.dy = grad_buffers_[current];
      if (i == range_.first)
        c.dx = input_gradient_;  // null unless the range sends
      else if (role.input_gradient)
        c.dx = grad_buffers_[1 - current];
      std::get<i>(plan)->backward(c);
      if (reduced()) {
        if constexpr (L::param_count > 0)
          round_values(precision_, c.dweights, layout::sizes[i], stream());
        if constexpr (!L::in_place)
          if (c.dx != nullptr) round_values(precision_, c.dx, n * L::input_shape::size, stream());
        if (role.applies_previous_drelu)
          bias_act_backward_nchw<Act::identity>(c.dx, c.dx, c.dx, c.previous_dbias, n,
                                                L::input_shape::size, 1, false, stream());
      }
      if (!L::in_place) current = 1 - current;
      done(std::size_t{i} - range_.first);
    });
    // An in-place first layer (Flatten) passes the gradient through.
    if (input_gradient_ != nullptr && first_in_place_)
      copy_async(input_gradient_, grad_buffers_[current], n * in_size_, cudaMemcpyDeviceToDevice,
                 stream());
  }
  void backward(std::size_t slot, std::size_t n) {
    backward(slot, n, [](std::size_t) {});
  }

  // A parameter-sized device buffer (params(), grads(), moment(b)) to or
  // from the range's slice of a host buffer in the CPU Model's order
  // (enqueued; a copy from pageable memory has read it on return).
  void copy_parameters(float* device, float* host, cudaMemcpyKind kind) {
    each([&](auto i) {
      detail::copy_layer_parameters<type_at_t<i, executed>>(
          device, host, layout::offsets.weight[i] - base_, info::param_offsets[i] - host_base_,
          kind, stream());
    });
  }
  // Where the range's parameters [at, at + count) (its slice of the CPU
  // Model's order) lie in the device buffers: a run within one layer's
  // weights (weight tying's, of a top-level Embedding or TiedLinear).
  std::size_t device_offset(std::size_t at, std::size_t count) const {
    std::optional<std::size_t> found;
    each([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!detail::DeviceBlock<L>) {
        const std::size_t first = info::param_offsets[i] - host_base_;
        if (!found && at >= first && at + count <= first + L::weight_count)
          found = layout::offsets.weight[i] - base_ + (at - first);
      }
    });
    LOOM_CHECK(found.has_value(), "DeviceLayers: parameters [", at, ", ", at + count,
               ") of the range are not within one layer's weights");
    return *found;
  }

  // The range's running statistics to or from its slice of the host's.
  void copy_running_state(float* host, cudaMemcpyKind kind) {
    detail::copy_floats(state_, host, state_count_, kind, stream());
  }

 private:
  struct Slot {
    float* input = nullptr;
    std::array<float*, layer_count> outputs{};
    std::array<unsigned char*, layer_count> masks{};
    std::array<float*, layer_count> saved{};
    DevicePass* pass = nullptr;
    bool training = false;  // of its last forward, which its backward follows
    // Sequences: the samples' lengths at the network's input, then after
    // each layer that changes them (frames_rules_before's order), max_batch
    // each, on the device and on the host; frames_count: the samples they
    // hold (0: no lengths). The host's is pinned, made by the first set_frames.
    std::int32_t* frames = nullptr;
    PinnedBuffer<std::int32_t> host_frames;
    Event frames_copied;  // the last copy of host_frames to frames
    std::size_t frames_count = 0;
  };

  // Per executed layer: how many layers before it change the samples'
  // lengths, so which row of a slot's table it reads (net/model.hpp's rule).
  static constexpr std::array<std::size_t, layer_count + 1> frames_rules_before = [] {
    std::array<std::size_t, layer_count + 1> before{};
    static_for<layer_count>([&](auto i) {
      before[i + 1] = before[i] + (ChangesFrames<type_at_t<i, executed>> ? 1 : 0);
    });
    return before;
  }();
  static constexpr std::size_t frames_rows = frames_rules_before[layer_count] + 1;

 public:
  // Whether the network's input holds token ids (an Embedding first, perhaps
  // in a block), which no precision may round.
  using first_layer = detail::first_leaf_t<type_at_t<0, executed>>;
  static constexpr bool takes_ids = [] {
    if constexpr (requires { first_layer::takes_ids; })
      return first_layer::takes_ids;
    else
      return false;
  }();

  // Whether a step whose batch has lengths must run uncaptured: some layer's
  // runner plans from the host lengths (plans_from_host_lengths).
  static constexpr bool lengths_on_host = [] {
    bool any = false;
    static_for<layer_count>([&](auto i) {
      any = any || detail::plans_from_host_lengths<type_at_t<i, executed>>;
    });
    return any;
  }();

 private:
  static LayerRange checked(LayerRange range) {
    LOOM_CHECK(range.first < range.last && range.last <= layer_count, "DeviceLayers: layers [",
               range.first, ", ", range.last, ") of a network of ", layer_count,
               " executed layers");
    return range;
  }
  bool reduced() const { return precision_ != Precision::fp32; }
  void check_batch(std::size_t n) const {
    LOOM_CHECK(n >= 1 && n <= max_batch_, "a batch of ", n, " samples on cuda:",
               gpu::detail::current_device(), "; its layers were planned for 1 to ", max_batch_);
  }

  // take(pointer, count) for every buffer, in the arena's order (make_arena).
  template <class Take>
  void lay_out(Take&& take) {
    take(params_, total_);
    if (reduced()) take(compute_params_, total_);
    take(grads_, total_);
    for (std::size_t b = 0; b < buffers_; ++b) take(moments_[b], total_);
    if (state_count_ > 0) {
      take(state_, state_count_);
      take(kept_state_, state_count_);
    }
    for (auto& buffer : grad_buffers_) take(buffer, max_batch_ * largest_);
    if (sends_) take(input_gradient_, max_batch_ * in_size_);
    for (auto& s : slots_) {
      take(s.pass, 1);
      take(s.frames, frames_rows * max_batch_);
      each([&](auto i) {
        using L = type_at_t<i, executed>;
        if constexpr (!L::in_place) take(s.outputs[i], max_batch_ * L::output_shape::size);
        if (detail::runner_role<executed, i>(range_, sends_).writes_mask)
          take(s.masks[i], relu_mask_bytes(max_batch_, L::output_shape::size));
        if constexpr (L::saved > 0) take(s.saved[i], plans_.template saved_floats<i>());
      });
    }
    take(scratch_, plans_.scratch_bytes());
  }

  // f(i) for the range's layers, first to last, or last to first.
  template <class F>
  void each(F&& f) const {
    static_for<layer_count>([&](auto i) {
      if (i >= range_.first && i < range_.last) f(i);
    });
  }
  template <class F>
  void each_reverse(F&& f) const {
    static_for_reverse<layer_count>([&](auto i) {
      if (i >= range_.first && i < range_.last) f(i);
    });
  }

  template <std::size_t I>
  float* input_of(const Slot& s) const {
    return ::loom::detail::range_input<executed, I>(s.outputs, s.input, range_);
  }
  template <std::size_t I>
  float* output_of(const Slot& s) const {
    return ::loom::detail::range_output<executed, I>(s.outputs, s.input, range_);
  }

  template <std::size_t I>
  detail::LayerCall call(const Slot& s) const {
    using L = type_at_t<I, executed>;
    detail::LayerCall c;
    c.training = s.training;
    c.pass = s.pass;
    if constexpr (L::state_count > 0) c.state = state_ + (info::state_offsets[I] - state_base_);
    c.saved = s.saved[I];
    if constexpr (L::syncs) c.replicas = replicas_;
    c.tensor = tensor_;
    const float* weights = reduced() ? compute_params_ : params_;
    c.weights = weights + (layout::offsets.weight[I] - base_);
    c.bias = weights + (layout::offsets.bias[I] - base_);
    c.dweights = grads_ + (layout::offsets.weight[I] - base_);
    c.dbias = grads_ + (layout::offsets.bias[I] - base_);
    c.x = input_of<I>(s);
    c.y = output_of<I>(s);
    c.mask = s.masks[I];
    if constexpr (I > 0) {
      if (I > range_.first) {
        c.previous_mask = s.masks[I - 1];
        c.previous_dbias = grads_ + (layout::offsets.bias[I - 1] - base_);
      }
    }
    c.scratch = scratch_;
    c.scratch_bytes = plans_.scratch_bytes();
    c.stream = stream();
    c.precision = precision_;
    if (s.frames_count > 0) {
      const std::size_t row = frames_rules_before[I] * max_batch_;
      c.frames = s.frames + row;
      c.host_frames = s.host_frames.data() + row;
    }
    return c;
  }

  DeviceContext& context_;
  LayerRange range_;
  bool sends_;
  std::size_t base_, total_;  // the range's device blocks: where they begin, their floats
  std::size_t host_base_, state_base_, state_count_;  // its slices of the CPU Model's buffers
  std::size_t in_size_ = 0, largest_ = 0;             // per sample
  bool first_in_place_ = false, contextual_ = false;
  std::size_t max_batch_, buffers_;
  Precision precision_;
  detail::PlanCache<executed> plans_;
  std::vector<Slot> slots_;
  comm::NcclComm* replicas_ = nullptr;
  DeviceTensorGroup* tensor_ = nullptr;
  std::unique_ptr<DeviceArena> arena_;
  float* params_ = nullptr;
  float* compute_params_ = nullptr;  // params_ rounded to a reduced precision (else null)
  float* grads_ = nullptr;
  std::array<float*, 2> moments_{};  // SGD's velocity; Adam's exp_avg and exp_avg_sq
  float* state_ = nullptr;  // running statistics
  float* kept_state_ = nullptr;  // state_ at the step's start
  std::array<float*, 2> grad_buffers_{};
  float* input_gradient_ = nullptr;
  unsigned char* scratch_ = nullptr;
};

}  // namespace loom::gpu
