// DeviceModel<Net>: a network's executed layer list training on one GPU.
// Weights come from a CPU Model of the same network (the same seed gives the
// same starting point on both backends). Its layers run on DeviceLayers,
// which a grid engine's stage (stage.cuh) runs over a range of them: the
// parameters, gradients, optimizer state, activations, ReLU masks and
// workspace live in the layers' device arena, the step's scalars, flags and
// two input slots in the model's, both sized up front; each layer's
// cuBLASLt/cuDNN plan is made once per batch size.
//
// Layer by layer: Linear is one GEMM with a bias(+ReLU) epilogue forward and
// two GEMMs backward. Where a Linear+ReLU feeds another Linear, the forward
// GEMM also keeps the ReLU bit-mask (RELU_AUX_BIAS) and the next layer's
// input-gradient GEMM applies the ReLU derivative and sums the bias gradient
// in its epilogue (DRELU_BGRAD): that layer's backward is then its weight
// GEMM alone, with no elementwise or bias kernel. Conv2d is cuDNN (fused
// conv+bias+ReLU where it offers it); pooling, standalone activations, the
// loss and the optimizer updates (SGD, Adam, AdamW; clipping by global norm)
// are loom's kernels. Sequences: a batch's lengths (set_frames, the CPU's
// Pass::frames) are mapped through the layers on the host and written to
// the device before each step; Conv1d (conv1d.cuh), BatchNorm over time
// (layers.cuh) and the recurrent runners read them there.
//
// A step (forward, loss, backward, update) only enqueues work: it runs
// directly the first time a (kind, batch size, input slot) is seen (what
// cuDNN, cuBLASLt, NCCL and CUDA set up on first use may not be legal in a
// capture), is captured as a CUDA graph the second time and replayed after,
// and it never waits for the host. The scalars the host sets for a step
// (learning rate and step number, loss scale, Dropout's pass) reach the
// device through pinned staging (ScalarStager), which keeps the copies from
// synchronising the host with the stream. Loss sums accumulate on
// the device (LossTotals); a non-finite loss, or non-finite gradients under
// a finite one (checked before every update, as on the CPU), halts the
// totals and makes every later update a no-op, so the weights and running
// statistics stay those of the last good step until the host reads the
// totals and reports it. With set_skip_nonfinite such a step is skipped
// instead (LossTotals::skipped says why) and the next goes on.
//
// bf16 and fp16 (DeviceModelOptions::precision) keep the buffers fp32 and
// round what the CPU backend's emulation rounds (precision.cuh): each step
// first rounds the fp32 master weights into a copy the layers compute with,
// and its input batch (in place, in its slot); the loss gradient, and each
// layer's output, weight gradients and passed-back gradient are rounded as
// they are made. The optimizer updates the master weights. fp16 scales the
// loss gradient by a scale kept on the device and unscales the gradients
// before the update, skipping it (running statistics included) when they
// overflowed (loss_scaling.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <charconv>
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
#include "../backend/cuda/graph.hpp"
#include "../backend/cuda/loss_scaling.cuh"
#include "../backend/cuda/optimizer.cuh"
#include "../backend/cuda/pool.cuh"
#include "../backend/cuda/precision.cuh"
#include "../backend/cuda/softmax_xent.cuh"
#include "../backend/cuda/staging.hpp"
#include "../backend/cuda/stream.hpp"
#include "../comm/nccl_comm.hpp"
#include "../core/meta.hpp"
#include "../net/model.hpp"
#include "../optim/adam.hpp"
#include "../optim/any_optimizer.hpp"
#include "../optim/loss_scaler.hpp"
#include "../optim/sgd.hpp"
#include "../parallel/buckets.hpp"
#include "../parallel/step_protocol.hpp"
#include "conv1d.cuh"
#include "cudnn_rnn.cuh"
#include "layer_call.hpp"
#include "layers.cuh"
#include "recurrent.cuh"

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

struct DeviceModelOptions {
  // Capture each step as a CUDA graph and replay it; off runs every kernel
  // launch directly (for debugging with compute-sanitizer or a profiler).
  bool graphs = true;
  // TF32 tensor-core math for GEMMs and convolutions: faster, inputs rounded
  // to a 10-bit mantissa. Off, results match the CPU backend to FP32 rounding.
  bool allow_tf32 = false;
  // fp32, or bf16 or fp16 on tensor cores (see the file comment; allow_tf32
  // is then moot). fp16 scales the loss dynamically by `loss_scaling`.
  Precision precision = Precision::fp32;
  LossScaling loss_scaling{};
  // Data parallelism: this model is one rank of `data_parallel` (which must
  // outlive it). Each step then sums the ranks' loss statistics before it
  // decides to update, and all-reduces the gradients in buckets of about
  // `bucket_bytes` (slices of the flat gradient buffer in reverse layer
  // order) on a communication stream, each as soon as backward has produced
  // it; the update waits for the last.
  comm::NcclComm* data_parallel = nullptr;
  std::size_t bucket_bytes = std::size_t{64} << 10;
  // Room for gradient accumulation (train_micro_step): one more buffer the
  // size of the parameters.
  bool gradient_accumulation = false;
};

namespace detail {

// Where each layer's weights and bias sit in the device's flat parameter
// buffer: the CPU Model's order, each block starting on a 256-byte boundary
// (cuBLASLt's operands and epilogue vectors must be 16-byte aligned; cuDNN
// is fastest at 256). A Residual block's body layers (and its projection)
// are laid out the same way inside the block, so every layer a runner sees
// is aligned however deep it sits. The gaps are zero in parameters and
// gradients alike, so the update over the whole buffer leaves them zero.
inline constexpr std::size_t parameter_align = 64;  // floats
// Floats rounded up to whole 256-byte blocks (parameters and saved areas).
constexpr std::size_t round_to_block(std::size_t n) {
  return (n + parameter_align - 1) / parameter_align * parameter_align;
}

template <class L>
struct residual_layout;

// A layer's block: its weights, then (aligned) the rest of its parameters.
template <class L>
constexpr std::size_t device_size() {
  if constexpr (L::kind == "residual")
    return residual_layout<L>::offsets.total;
  else
    return round_to_block(L::weight_count) + round_to_block(L::param_count - L::weight_count);
}

// Where a layer's "bias" pointer starts in its device block (a Residual
// block's parameters are all weights).
template <class L>
constexpr std::size_t weight_block() {
  if constexpr (L::kind == "residual")
    return device_size<L>();
  else
    return round_to_block(L::weight_count);
}

template <class L>
struct residual_layout {
  using body = typename L::body;
  static constexpr std::size_t count = body::size;
  struct Offsets {
    std::array<std::size_t, count> at{};  // each body layer's block in the block
    std::size_t shortcut = 0;             // the projection's
    std::size_t total = 0;
  };
  static constexpr Offsets offsets = [] {
    Offsets o;
    static_for<count>([&](auto i) {
      o.at[i] = o.total;
      o.total += device_size<type_at_t<i, body>>();
    });
    if constexpr (!L::identity) {
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
  if (count == 0) return;
  const bool to_device = kind == cudaMemcpyHostToDevice;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(to_device ? device : host, to_device ? host : device,
                                  count * sizeof(float), kind, stream));
}

// Enqueues copying one layer's parameters between the host's flat buffer
// (the CPU Model's order, from host_at) and its device block (at device_at).
template <class L>
void copy_layer_parameters(float* device, float* host, std::size_t device_at, std::size_t host_at,
                           cudaMemcpyKind kind, cudaStream_t stream) {
  if constexpr (L::kind == "residual") {
    using R = residual_layout<L>;
    static_for<R::count>([&](auto i) {
      copy_layer_parameters<type_at_t<i, typename R::body>>(
          device, host, device_at + R::offsets.at[i], host_at + L::info::param_offsets[i], kind,
          stream);
    });
    if constexpr (!L::identity)
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
    if constexpr (L::kind == "linear" && Next::kind == "linear")
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

template <class L>
class ResidualRunner;

// The floats a layer keeps from forward to backward for a batch of n on the
// device. The CPU's layout, except that inside a Residual block each body
// layer's output and saved tensors start on a 256-byte boundary: GEMMs and
// cuDNN are planned for 16-byte aligned pointers at any batch size.
template <class L>
constexpr std::size_t device_saved_floats(std::size_t n);

// The runner of a layer kind that has one of its own (layers.cuh,
// cudnn_rnn.cuh, recurrent.cuh, ResidualRunner), or void for the kinds
// LayerRunner runs itself (conv, linear, pooling, ReLU, flatten). InBlock:
// the layer is in a Residual block's body, whose saved areas are laid out
// at compile time; a GRU or LSTM there runs on recurrent.cuh's runner, as
// cuDNN's reserve space has a size only cuDNN knows.
template <class L, bool InBlock>
constexpr auto kernel_runner_of() {
  if constexpr (L::kind == "tanh")
    return std::type_identity<PointwiseRunner<L, ::loom::detail::TanhFn>>{};
  else if constexpr (L::kind == "sigmoid")
    return std::type_identity<PointwiseRunner<L, ::loom::detail::SigmoidFn>>{};
  else if constexpr (L::kind == "gelu")
    return std::type_identity<PointwiseRunner<L, ::loom::detail::GeluFn>>{};
  else if constexpr (L::kind == "globalavgpool")
    return std::type_identity<GlobalAvgPoolRunner<L>>{};
  else if constexpr (L::kind == "dropout")
    return std::type_identity<DropoutRunner<L>>{};
  else if constexpr (L::kind == "batchnorm" || L::kind == "batchnorm_time")
    return std::type_identity<BatchNormRunner<L>>{};
  else if constexpr (L::kind == "conv1d")
    return std::type_identity<Conv1dRunner<L>>{};
  else if constexpr ((L::kind == "gru" || L::kind == "lstm") && InBlock)
    return std::type_identity<RecurrentRunner<L>>{};
  else if constexpr (L::kind == "gru" || L::kind == "lstm")
    return std::type_identity<CudnnRecurrentRunner<L>>{};
  else if constexpr (L::kind == "residual")
    return std::type_identity<ResidualRunner<L>>{};
  else
    return std::type_identity<void>{};
}
template <class L, bool InBlock>
using kernel_runner_t = typename decltype(kernel_runner_of<L, InBlock>())::type;

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
    if constexpr (L::kind == "residual") {
      kernel_ = std::make_unique<Kernel>(context, batch, library_limit, math);
    } else if constexpr (!std::is_void_v<Kernel>) {
      // Their GEMMs (recurrent.cuh) take TF32 when tensor cores are allowed.
      kernel_ = std::make_unique<Kernel>(context, batch, library_limit, tensor_cores);
    } else if constexpr (L::kind == "conv") {
      conv_ = std::make_unique<Convolution>(
          context.dnn, L::geometry(batch), out_channels,
          ConvOptions{.allow_tensor_ops = tensor_cores, .workspace_limit = library_limit});
    } else if constexpr (L::kind == "linear") {
      constexpr std::size_t in = L::in_features, out_channels = L::out_features;
      // Over Frames x Features it acts per position: a row per sample and position.
      const std::size_t rows = batch * L::positions;
      GemmOptions options;
      options.max_workspace_bytes = std::min(options.max_workspace_bytes, library_limit);
      options.allow_tf32 = math == TensorMath::tf32;
      options.allow_bf16 = math == TensorMath::bf16;
      options.allow_fp16 = math == TensorMath::fp16;
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
    } else if constexpr (L::kind == "conv") {
      conv_->forward_bias_act(c.x, c.weights, c.bias, c.y, activation_is_relu(),
                              library(c.scratch), library_size(c.scratch_bytes));
    } else if constexpr (L::kind == "linear") {
      GemmArgs args = gemm_args(c.x, c.weights, c.y, c);
      args.bias = c.bias;
      if (role_.writes_mask) args.relu_mask_out = c.mask;
      forward_->run(args);
    } else if constexpr (L::kind == "maxpool" || L::kind == "avgpool") {
      pool_forward<L::kind == "maxpool">(L::geometry(batch_), c.x, c.y, c.stream);
    } else if constexpr (L::kind == "relu") {
      activation_forward<Act::relu>(c.x, c.y, batch_ * L::output_shape::size, c.stream);
    } else if constexpr (L::kind != "flatten") {
      static_assert(dependent_false<L>,
                    "No CUDA runner for this layer kind (the template argument names the "
                    "layer); add one to kernel_runner_of");
    }
  }

  void backward(const LayerCall& c) {
    float* dz = reinterpret_cast<float*>(c.scratch);
    if constexpr (!std::is_void_v<Kernel>) {
      kernel_->backward(c);
    } else if constexpr (L::kind == "conv") {
      conv_->bias_act_backward(c.dy, c.y, dz, c.dbias, activation_is_relu(), false);
      conv_->backward_filter(c.x, dz, c.dweights, false, library(c.scratch),
                             library_size(c.scratch_bytes));
      if (c.dx != nullptr)
        conv_->backward_data(c.weights, dz, c.dx, library(c.scratch),
                             library_size(c.scratch_bytes));
    } else if constexpr (L::kind == "linear") {
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
    } else if constexpr (L::kind == "maxpool" || L::kind == "avgpool") {
      if (c.dx != nullptr)
        pool_backward<L::kind == "maxpool">(L::geometry(batch_), c.x, c.dy, c.dx, c.stream);
    } else if constexpr (L::kind == "relu") {
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
    GemmArgs args;
    args.a = a;
    args.b = b;
    args.c = out;
    args.workspace = library(c.scratch);
    args.workspace_bytes = library_size(c.scratch_bytes);
    args.stream = c.stream;
    return args;
  }

  std::size_t batch_;
  RunnerRole role_;
  struct NoKernel {};
  [[no_unique_address]] std::conditional_t<std::is_void_v<Kernel>, NoKernel,
                                           std::unique_ptr<Kernel>> kernel_;
  std::unique_ptr<Convolution> conv_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

// A Residual block's layers run by the same runners as the top level's
// (without the ReLU-mask hand-over between Linear layers), each passing a
// gradient to its input.
template <class Body, class Indices>
struct body_runners;
template <class Body, std::size_t... I>
struct body_runners<Body, std::index_sequence<I...>> {
  using type = std::tuple<LayerRunner<type_at_t<I, Body>, true>...>;
};


template <class Body, std::size_t I>
constexpr std::size_t body_region_floats(std::size_t n) {
  using B = type_at_t<I, Body>;
  return (B::in_place ? 0 : round_to_block(n * B::output_shape::size)) +
         device_saved_floats<B>(n);
}

// Where body layer I's region (its output, then its saved tensors) starts.
template <class Body, std::size_t I>
constexpr std::size_t body_region_at(std::size_t n) {
  std::size_t at = 0;
  static_for<I>([&](auto j) { at += body_region_floats<Body, j>(n); });
  return at;
}

template <class L>
constexpr std::size_t device_saved_floats(std::size_t n) {
  if constexpr (L::kind == "residual")
    return body_region_at<typename L::body, L::body::size>(n);
  else
    return L::saved == 0 ? 0 : round_to_block(n * L::saved);
}

// Residual<Layers...> on the GPU, as the CPU runs it: the body's outputs and
// saved tensors sit in the block's saved area (device_saved_floats' layout),
// y = body(x) + shortcut(x); backward runs the projection (or copies dy),
// then the body in reverse over two gradient buffers at the start of the
// scratch, and adds the body's input gradient. In a reduced precision the
// body's outputs and passed-back gradients, and the projection's, are
// rounded as the CPU rounds them (net/residual.hpp).
template <class L>
class ResidualRunner {
  using Body = typename L::body;
  using R = residual_layout<L>;
  static constexpr std::size_t count = Body::size;
  using Runners = typename body_runners<Body, std::make_index_sequence<count>>::type;
  struct NoShortcut {
    static std::size_t fixed_bytes(std::size_t) { return 0; }
  };
  using Shortcut = std::conditional_t<L::identity, NoShortcut,
                                      LayerRunner<typename L::shortcut, true>>;

 public:
  ResidualRunner(DeviceContext& context, std::size_t batch, std::size_t library_limit,
                 TensorMath math)
      : batch_(batch),
        body_(make_body(context, batch, library_limit, math, std::make_index_sequence<count>{})) {
    if constexpr (!L::identity)
      shortcut_ = std::make_unique<Shortcut>(
          context, batch, limit_for(Shortcut::fixed_bytes(batch), batch, library_limit), math,
          RunnerRole{});
  }

  // Two gradient buffers, then the largest of the body's and projection's needs.
  static std::size_t fixed_bytes(std::size_t n) { return 2 * gradient_bytes(n) + largest_fixed(n); }
  std::size_t scratch_bytes() const {
    std::size_t inner = 0;
    static_for<count>([&](auto i) { inner = std::max(inner, std::get<i>(body_).scratch_bytes()); });
    if constexpr (!L::identity) inner = std::max(inner, shortcut_->scratch_bytes());
    return 2 * gradient_bytes(batch_) + inner;
  }

  void forward(const LayerCall& c) {
    static_for<count>([&](auto i) {
      using B = type_at_t<i, Body>;
      std::get<i>(body_).forward(body_call<i>(c));
      if constexpr (!B::in_place)
        round_values(c.precision, output<i>(c), batch_ * B::output_shape::size, c.stream);
    });
    const float* body_out = output<count - 1>(c);
    const std::size_t out = batch_ * L::output_shape::size;
    if constexpr (L::identity) {
      LOOM_CUDA_CHECK(cudaMemcpyAsync(c.y, c.x, out * sizeof(float), cudaMemcpyDeviceToDevice,
                                      c.stream));
    } else {
      shortcut_->forward(shortcut_call(c));
      round_values(c.precision, c.y, out, c.stream);
    }
    // The sum is rounded by the owner, as any layer's output.
    add_into(c.y, body_out, out, c.stream);
  }

  void backward(const LayerCall& c) {
    std::array<float*, 2> gradients{
        reinterpret_cast<float*>(c.scratch),
        reinterpret_cast<float*>(c.scratch + gradient_bytes(batch_))};
    if constexpr (L::identity) {
      if (c.dx != nullptr)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(c.dx, c.dy, batch_ * L::input_shape::size * sizeof(float),
                                        cudaMemcpyDeviceToDevice, c.stream));
    } else {
      // The projection has no activation: its output is not read, dy stands in.
      LayerCall s = shortcut_call(c);
      s.y = const_cast<float*>(c.dy);
      s.dy = c.dy;
      s.dx = c.dx;
      shortcut_->backward(s);
      if (c.dx != nullptr)
        round_values(c.precision, c.dx, batch_ * L::input_shape::size, c.stream);
    }
    LOOM_CUDA_CHECK(cudaMemcpyAsync(gradients[0], c.dy,
                                    batch_ * L::output_shape::size * sizeof(float),
                                    cudaMemcpyDeviceToDevice, c.stream));
    int current = 0;
    static_for_reverse<count>([&](auto i) {
      using B = type_at_t<i, Body>;
      LayerCall b = body_call<i>(c);
      b.dy = gradients[current];
      b.dx = i == 0 && c.dx == nullptr ? nullptr : gradients[1 - current];
      std::get<i>(body_).backward(b);
      // The block's weight gradients are rounded by the owner, all at once.
      if constexpr (!B::in_place)
        if (b.dx != nullptr)
          round_values(c.precision, b.dx, batch_ * B::input_shape::size, c.stream);
      if (!B::in_place) current = 1 - current;
    });
    if (c.dx != nullptr) add_into(c.dx, gradients[current], batch_ * L::input_shape::size, c.stream);
  }

 private:
  static std::size_t gradient_bytes(std::size_t n) {
    return DeviceArena::padded_bytes<float>(n * L::gradient_buffer);
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
    constexpr int owner = L::info::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<float*>(c.x);
    else
      return c.saved + body_region_at<Body, static_cast<std::size_t>(owner)>(batch_);
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
    b.precision = c.precision;
    return b;
  }
  template <std::size_t I>
  LayerCall body_call(const LayerCall& c) const {
    using B = type_at_t<I, Body>;
    LayerCall b = inner_call(c, R::offsets.at[I], weight_block<B>());
    b.x = input<I>(c);
    b.y = output<I>(c);
    b.state = c.state + L::info::state_offsets[I];
    b.saved = c.saved + body_region_at<Body, I>(batch_) +
              (B::in_place ? 0 : round_to_block(batch_ * B::output_shape::size));
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
// batches of up to max_batch samples in flight. DeviceModel runs the whole
// network on it (one slot), a grid engine's stage its share (stage.cuh): one
// type for both, and for every stage of every cut between executed layers.
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
  static constexpr LayerRange all_layers{0, layer_count};

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
      out_size_ = L::output_shape::size;
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

  const LayerRange& range() const { return range_; }
  cudaStream_t stream() const { return context_.stream.get(); }
  std::size_t max_batch() const { return max_batch_; }
  std::size_t input_size() const { return in_size_; }
  std::size_t output_size() const { return out_size_; }
  // Floats of each parameter-sized device buffer (the gaps included).
  std::size_t parameters() const { return total_; }
  std::size_t state_count() const { return state_count_; }
  float* params() const { return params_; }
  float* grads() const { return grads_; }
  float* moment(std::size_t b) const { return moments_[b]; }
  float* state() const { return state_; }
  float* kept_state() const { return kept_state_; }
  // Where backward starts: the loss gradient (or the next stage's), n x output_size().
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
          if constexpr (L::kind == "conv1d")
            LOOM_CHECK(out[k] > 0, ::loom::detail::type_label<typename L::spec>(), " (layer ", L::index,
                       "): sample ", k, " of the batch has ", in[k], " frames; padded by ",
                       L::spec::pad, " at both ends that is shorter than the ", L::span,
                       " frames the window spans, so it has no output frame; leave such short "
                       "sequences out of the data or use a smaller kernel, dilation or more "
                       "padding");
        }
      }
    });
    LOOM_CUDA_CHECK(cudaMemcpyAsync(s.frames, s.host_frames.data(),
                                    s.host_frames.size() * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream()));
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
      if constexpr (L::kind == "batchnorm_time") {
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
  // SyncBatchNorm sums its statistics over these ranks (null: one device).
  void set_replicas(comm::NcclComm* replicas) { replicas_ = replicas; }

  // Before a step's or an evaluation's first forward, in a reduced
  // precision: the weights the layers compute with, rounded again from the
  // master weights (an update or the host changed them).
  void round_weights() {
    if (reduced()) round_copy(precision_, params_, compute_params_, total_, stream());
  }
  // The running statistics at a step's start, kept; or put back when the
  // step is skipped (enqueued).
  void keep_state() { copy_state(kept_state_, state_); }
  void restore_state() { copy_state(state_, kept_state_); }

  // Makes the plans for batches of n now (planning may run kernels: a
  // captured step plans before its capture).
  void prepare(std::size_t n) {
    check_batch(n);
    plans_.get(n);
  }

  // Runs the range on n samples at `input` (n x input_size(), in device
  // memory that stays until backward) in `slot`.
  void forward(std::size_t slot, float* input, std::size_t n, bool training) {
    check_batch(n);
    auto& plan = plans_.get(n);
    Slot& s = slots_[slot];
    s.input = input;
    s.training = training;
    // The network's input (a later stage's, the stage before rounded).
    // Rounding it again (a slot stepped on twice) changes nothing.
    if (!sends_) round_values(precision_, input, n * in_size_, stream());
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
      LOOM_CUDA_CHECK(cudaMemcpyAsync(input_gradient_, grad_buffers_[current],
                                      n * in_size_ * sizeof(float), cudaMemcpyDeviceToDevice,
                                      stream()));
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
  void copy_state(float* to, const float* from) {
    if (state_count_ > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(to, from, state_count_ * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream()));
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
  std::size_t in_size_ = 0, out_size_ = 0, largest_ = 0;  // per sample
  bool first_in_place_ = false, contextual_ = false;
  std::size_t max_batch_, buffers_;
  Precision precision_;
  detail::PlanCache<executed> plans_;
  std::vector<Slot> slots_;
  comm::NcclComm* replicas_ = nullptr;
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

template <class Net_>
class DeviceModel {
 public:
  using Net = Net_;
  using executed = typename Net::executed;
  using layout = detail::device_layout<executed>;
  static constexpr std::size_t layer_count = executed::size;
  static constexpr std::size_t parameter_count = Net::parameter_count;
  static constexpr std::size_t sample_size = Net::input_shape::size;
  static constexpr std::size_t classes = Net::output_shape::size;
  static constexpr std::size_t state_count = ::loom::detail::list_info<executed>::state_count;

  // Copies the weights of `initial` to the current GPU; steps then take
  // batches of 1 to `max_batch` samples and update with `optimizer` (its
  // state starts at zero: copy_optimizer_from sets another).
  DeviceModel(const Model<Net, float>& initial, std::size_t max_batch, DeviceOptimizer optimizer,
              DeviceModelOptions options = {})
      : max_batch_(max_batch),
        optimizer_(optimizer),
        options_(options),
        graphs_(options.graphs),
        layers_(context_, DeviceLayers<Net>::all_layers, checked_batch(max_batch), 1,
                optimizer.buffers(), options.precision,
                tensor_math(options.precision, options.allow_tf32), owner()),
        loss_(max_batch),
        scaler_(options.loss_scaling),
        snapshots_(2),
        scale_snapshots_(2) {
    arena_ = make_arena([&](auto&& take) { lay_out(take); }, owner());
    skip_ = flags_;
    bad_gradients_ = flags_ + 1;
    skip_nonfinite_ = flags_ + 2;
    LOOM_CUDA_CHECK(cudaMemsetAsync(flags_, 0, 3 * sizeof(int), stream()));
    if (accum_ != nullptr)
      LOOM_CUDA_CHECK(cudaMemsetAsync(accum_, 0, layout::total * sizeof(float), stream()));
    if constexpr (Net::syncs) layers_.set_replicas(options.data_parallel);
    copy_parameters(initial.parameters().data(), cudaMemcpyHostToDevice);
    copy_running_state(initial.state().data(), cudaMemcpyHostToDevice);
    set_pass({});
    set_lr(optimizer.lr);
    if (fp16()) set_loss_scale({.scale = options.loss_scaling.initial_scale});
    reset_totals();
    if (auto* comm = options.data_parallel) {
      buckets_ = plan_buckets(options.bucket_bytes);
      bucket_ready_.resize(buckets_.size());
      // Every rank starts from rank 0's weights.
      LOOM_CUDA_CHECK(cudaStreamSynchronize(stream()));
      comm->broadcast(std::span<float>(layers_.params(), layout::total), 0);
    }
  }

  DeviceModel(const Model<Net, float>& initial, std::size_t max_batch, SGD::Options sgd,
              DeviceModelOptions options = {})
      : DeviceModel(initial, max_batch, device_optimizer(sgd), options) {}

  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;
  // Steps still in flight read the arena: they finish before it goes.
  ~DeviceModel() { LOOM_CUDA_RELEASE(cudaStreamSynchronize(context_.stream.get())); }

  std::size_t max_batch() const { return max_batch_; }
  cudaStream_t stream() const { return context_.stream.get(); }
  const DeviceModelOptions& options() const { return options_; }

  // Where a batch for `slot` (0 or 1) is written before train_step(slot, n)
  // or evaluate_step(slot, n): images N x input, labels N.
  const std::array<StagingSlot, 2>& input_slots() const { return inputs_; }

  // Enqueue one SGD step on the n samples in input slot `slot`, and a copy
  // of the totals after it for wait_totals(slot). Nothing waits for the host.
  // With data parallelism n is this rank's share (0 allowed) of a global
  // batch of global_n samples, whose mean loss the step minimises.
  void train_step(int slot, std::size_t n, std::size_t global_n = 0) {
    const std::size_t all = global(n, global_n);
    step({.train = true, .n = n, .global = all, .group = all, .slot = slot});
  }
  // Gradient accumulation: one batch of an optimizer step over group_n
  // samples (the loss is their mean). accumulate: add to the gradients of
  // the step's earlier batches; last: (reduce and) update. Needs
  // DeviceModelOptions::gradient_accumulation.
  void train_micro_step(int slot, std::size_t n, std::size_t global_n, std::size_t group_n,
                        bool accumulate, bool last) {
    LOOM_CHECK(accum_ != nullptr || (!accumulate && last),
               "DeviceModel: gradient accumulation needs DeviceModelOptions::gradient_accumulation");
    const std::size_t all = global(n, global_n);
    const std::size_t group = group_n == 0 ? all : group_n;
    LOOM_CHECK(group >= all, "DeviceModel: a batch of ", all, " samples in an optimizer step over ",
               group);
    step({.train = true, .n = n, .global = all, .group = group, .accumulate = accumulate,
          .last = last, .slot = slot});
  }
  // Enqueue the loss of the n samples in `slot`, no update.
  void evaluate_step(int slot, std::size_t n, std::size_t global_n = 0) {
    const std::size_t all = global(n, global_n);
    step({.train = false, .n = n, .global = all, .group = all, .slot = slot});
  }

  // Waits for the last step enqueued on `slot` and returns the totals as
  // they were after it.
  LossTotals wait_totals(int slot) {
    check_slot(slot);
    // Under data parallelism the step holds NCCL kernels that wait for the
    // other ranks: a lost rank must end in an error, not a wait for ever.
    if (auto* comm = options_.data_parallel)
      comm->wait_event(done_[slot].get(), "a training step's gradient all-reduce");
    else
      done_[slot].synchronize();
    return snapshots_.data()[slot];
  }

  // Enqueues zeroing the totals (and clearing a halt).
  void reset_totals() {
    LOOM_CUDA_CHECK(cudaMemsetAsync(totals_, 0, sizeof(LossTotals), stream()));
  }

  // Every later update uses this learning rate (read on the device, so the
  // captured steps need no new capture).
  void set_lr(float lr) { lr_ = lr; }
  // Steps enqueued after this whose loss or gradients go non-finite are
  // skipped (LossTotals::skipped) rather than halting the totals (read on
  // the device).
  void set_skip_nonfinite(bool skip) {
    skip_nonfinite_value_ = skip ? 1 : 0;
    scalars_.copy(skip_nonfinite_, skip_nonfinite_value_, stream());
  }
  // Every later update first clips the gradients by their global norm
  // (after the all-reduce under data parallelism: the norm of the summed
  // gradients, as on the CPU); 0: no clipping.
  void set_max_grad_norm(float max_norm) {
    LOOM_CHECK(max_norm >= 0.0f && std::isfinite(max_norm),
               "DeviceModel: max_grad_norm must be a finite number >= 0, got ", max_norm);
    max_norm_ = max_norm;
  }
  // fp16: the loss scale and its counters every later step starts from
  // (enqueued; a checkpoint's, say), brought within LossScaling's bounds as
  // LossScaler::restore brings them.
  void set_loss_scale(const LossScaleState& state) {
    LOOM_CHECK(fp16(), "DeviceModel: a loss scale is fp16's; this model computes in ",
               precision_name(options_.precision));
    scaler_.restore(state.scale, state.good_steps);
    scalars_.copy(scale_state_,
                  LossScaleState{.scale = scaler_.scale(),
                                 .good_steps = state.good_steps,
                                 .skipped_steps = state.skipped_steps},
                  stream());
  }
  // fp16: the scale as the last step enqueued on `slot` left it, once
  // wait_totals(slot) returned (`overflowed`: that step's update was
  // skipped for an overflow; see also the totals' `skipped`).
  LossScaleState loss_scale(int slot) {
    check_slot(slot);
    LOOM_CHECK(fp16(), "DeviceModel: a loss scale is fp16's; this model computes in ",
               precision_name(options_.precision));
    return scale_snapshots_.data()[slot];
  }
  const DeviceOptimizer& optimizer() const { return optimizer_; }
  // Optimizer steps enqueued (Adam's bias corrections count them; a step
  // halted on the device counts too, and halts every later one; so do one
  // that fp16 skipped for an overflow and one skipped as non-finite, until
  // the owner, who learns it from loss_scale(slot) or the totals' `skipped`,
  // takes it back with set_optimizer_steps).
  std::uint64_t optimizer_steps() const { return updates_; }
  void set_optimizer_steps(std::uint64_t steps) { updates_ = steps; }

  // One step on a device batch of n samples anywhere in device memory (it is
  // copied into input slot 0 first), waiting for its loss: for tests and
  // one-off use. A halted step raises loom::Error.
  cpu::LossSums train_step(const float* images, const std::int32_t* labels, std::size_t n) {
    return blocking_step(true, images, labels, n);
  }
  cpu::LossSums evaluate(const float* images, const std::int32_t* labels, std::size_t n) {
    return blocking_step(false, images, labels, n);
  }
  // The same without waiting: train_step(0, n) on data copied into slot 0.
  void enqueue_train_step(const float* images, const std::int32_t* labels, std::size_t n) {
    refuse_when_parallel("enqueue_train_step");
    fill_slot(0, images, labels, n);
    train_step(0, n);
  }

  // What a training step's Dropout draws from: the trainer's seed, the
  // step's number and where this device's samples start in the global
  // batch (as loom::Pass). Enqueued: applies to the steps enqueued after.
  void set_pass(const DevicePass& pass) { scalars_.copy(layers_.pass(0), pass, stream()); }

  // Sequences: each sample's frames at the network's input (loom::Pass::
  // frames) for the steps enqueued after this, until the next call: n of
  // them, of which a step of m <= n samples reads the first m; null: every
  // sample has all its frames. Checked and mapped through the layers here
  // (DeviceLayers::set_frames), written to the device enqueued: a replayed
  // graph reads the lengths of its own step.
  void set_frames(const std::int32_t* frames, std::size_t n) { layers_.set_frames(0, frames, n); }

  // Waits for the stream and copies the weights and running statistics
  // into `host` (same network).
  void copy_parameters_to(Model<Net, float>& host) {
    copy_parameters(host.parameters().data(), cudaMemcpyDeviceToHost);
    copy_running_state(host.state().data(), cudaMemcpyDeviceToHost);
    context_.stream.synchronize();
  }
  // Replaces the device weights and running statistics with `host`'s (enqueued).
  void copy_parameters_from(const Model<Net, float>& host) {
    copy_parameters(host.parameters().data(), cudaMemcpyHostToDevice);
    copy_running_state(host.state().data(), cudaMemcpyHostToDevice);
  }

  // The optimizer's buffer b (SGD's velocity; Adam's exp_avg, exp_avg_sq)
  // in the CPU Model's order: to `host` (waits), or from it (enqueued; read
  // on return, as pageable copies are). For checkpoints.
  void copy_optimizer_to(std::size_t b, std::span<float> host) {
    check_optimizer_buffer(b, host.size());
    layers_.copy_parameters(layers_.moment(b), host.data(), cudaMemcpyDeviceToHost);
    context_.stream.synchronize();
  }
  void copy_optimizer_from(std::size_t b, std::span<const float> host) {
    check_optimizer_buffer(b, host.size());
    layers_.copy_parameters(layers_.moment(b), const_cast<float*>(host.data()),
                            cudaMemcpyHostToDevice);
  }

  // Takes the weights, optimizer state and running statistics of another
  // model of the same network and optimizer on the same GPU (e.g. one
  // planned for smaller batches).
  void copy_state_from(DeviceModel& other) {
    LOOM_CHECK(other.optimizer_.rule == optimizer_.rule, "DeviceModel::copy_state_from: ",
               other.optimizer_.name(), "'s state into a ", optimizer_.name(), " model");
    other.context_.stream.synchronize();
    for (auto [to, from] : {std::pair{layers_.params(), other.layers_.params()},
                            std::pair{layers_.moment(0), other.layers_.moment(0)},
                            std::pair{layers_.moment(1), other.layers_.moment(1)}})
      if (to != nullptr)
        LOOM_CUDA_CHECK(cudaMemcpyAsync(to, from, layout::total * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream()));
    updates_ = other.updates_;
    lr_ = other.lr_;
    max_norm_ = other.max_norm_;
    set_skip_nonfinite(other.skip_nonfinite_value_ != 0);
    if constexpr (state_count > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(layers_.state(), other.layers_.state(),
                                      state_count * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream()));
    if (fp16() && other.fp16())
      LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_state_, other.scale_state_, sizeof(LossScaleState),
                                      cudaMemcpyDeviceToDevice, stream()));
    // `other` may be destroyed as soon as this returns.
    context_.stream.synchronize();
  }

  // Graphs captured so far (0 with graphs off).
  std::size_t graphs() const { return graphs_.graphs(); }

 private:
  static std::string owner() {
    return "DeviceModel on cuda:" + std::to_string(current_device());
  }
  static int current_device() { return gpu::detail::current_device(); }
  static std::size_t checked_batch(std::size_t max_batch) {
    LOOM_CHECK(max_batch >= 1, "DeviceModel: the largest batch must be at least 1 sample");
    return max_batch;
  }
  bool fp16() const { return options_.precision == Precision::fp16; }

  // take(pointer, count) for every buffer besides the layers', in the
  // arena's order (make_arena).
  template <class Take>
  void lay_out(Take&& take) {
    take(update_, 1);
    take(norm_, 1);
    take(norm_scratch_, norm_scratch_bytes_);
    take(totals_, 1);
    take(stats_, 3);
    if (fp16()) take(scale_state_, 1);
    take(flags_, 3);
    if (options_.gradient_accumulation) take(accum_, layout::total);
    for (auto& slot : inputs_) {
      take(slot.images, max_batch_ * sample_size);
      take(slot.labels, max_batch_);
    }
  }

  // The running statistics (BatchNorm's) in the CPU Model's order, to or
  // from the host (enqueued).
  void copy_running_state(const float* host_src_or_dst, cudaMemcpyKind kind) {
    layers_.copy_running_state(const_cast<float*>(host_src_or_dst), kind);
  }

  // Host flat buffer (the CPU Model's order) to or from the padded device one.
  void copy_parameters(const float* host_src_or_dst, cudaMemcpyKind kind) {
    layers_.copy_parameters(layers_.params(), const_cast<float*>(host_src_or_dst), kind);
    // A host-to-device copy from pageable memory has read its source on return.
  }

  // With data parallelism a step needs the global batch size: each rank
  // scales its gradient by it, and the ranks' gradients are summed.
  std::size_t global(std::size_t n, std::size_t global_n) const {
    LOOM_CHECK(global_n > 0 || options_.data_parallel == nullptr,
               "DeviceModel: one rank of data parallelism takes a step with its share and the "
               "global batch size: train_step(slot, n, global_n)");
    return global_n == 0 ? n : global_n;
  }
  void refuse_when_parallel(const char* call) const {
    LOOM_CHECK(options_.data_parallel == nullptr, "DeviceModel::", call,
               " is for one device; a rank of data parallelism steps with train_step(slot, n, "
               "global_n) on every rank");
  }

  void check_optimizer_buffer(std::size_t b, std::size_t size) const {
    LOOM_CHECK(b < optimizer_.buffers(), "DeviceModel: ", optimizer_.name(), " has ",
               optimizer_.buffers(), " buffer(s), not ", b + 1);
    LOOM_CHECK(size == parameter_count, "DeviceModel: an optimizer buffer of ", size,
               " floats for a network of ", parameter_count, " parameters");
  }

  void check_slot(int slot) const {
    LOOM_CHECK(slot == 0 || slot == 1, "DeviceModel: input slot ", slot, " does not exist (0 or 1)");
  }

  // What a captured step depends on.
  struct StepShape {
    bool train = true;
    std::size_t n = 0;        // samples here
    std::size_t global = 0;   // samples of this batch on every rank
    std::size_t group = 0;    // samples of the optimizer step (the loss's denominator)
    bool accumulate = false;  // add to the step's earlier gradients
    bool last = true;         // the step's last batch: reduce and update
    int slot = 0;
    bool clip = false;        // clip the gradients by global norm before the update
    bool frames = false;      // the samples have lengths (the layers mask their padding)
    using Key =
        std::tuple<bool, std::size_t, std::size_t, std::size_t, bool, bool, int, bool, bool>;
    Key key() const { return {train, n, global, group, accumulate, last, slot, clip, frames}; }
  };

  void step(const StepShape& s) {
    check_slot(s.slot);
    const bool parallel = options_.data_parallel != nullptr;
    LOOM_CHECK((s.n >= 1 || parallel) && s.n <= max_batch_ && s.n <= s.global,
               "DeviceModel: a batch of ", s.n, " samples (of ", s.global,
               "); this model was planned for ", parallel ? "0" : "1", " to ", max_batch_);
    // A rank without a sample would miss SyncBatchNorm's all-reduces (every
    // rank knows the global batch, so all of them refuse alike).
    if constexpr (Net::syncs)
      if (auto* comm = options_.data_parallel; comm != nullptr && s.train)
        LOOM_CHECK(s.global >= static_cast<std::size_t>(comm->size()), "DataParallel: a batch of ",
                   s.global, " sample(s) over ", comm->size(), " ranks leaves a rank without one, "
                   "and SyncBatchNorm needs every rank's statistics; use batches of at least ",
                   comm->size(), " (the last batch of an epoch included)");
    if (s.n > 0) layers_.prepare(s.n);
    StepShape shape = s;
    shape.frames = layers_.frames_count(0) > 0;
    if (shape.frames && s.n > 0) {
      LOOM_CHECK(s.n <= layers_.frames_count(0), "DeviceModel: a step of ", s.n,
                 " samples but set_frames gave the lengths of ", layers_.frames_count(0));
      if (s.train) layers_.check_training_frames(0, s.n);
    }
    const bool updates = s.train && s.last;
    if (updates) {
      shape.clip = max_norm_ > 0.0f;
      stage_update(updates_ + 1);
    }
    // cuDNN's RNN takes lengths in descriptors set from the host at each
    // call: a replay would run the captured batch's lengths (cudnn_rnn.cuh).
    if (shape.frames && DeviceLayers<Net>::lengths_on_host)
      enqueue_step(shape);
    else
      graphs_.run(shape.key(), stream(), [&](cudaStream_t) { enqueue_step(shape); });
    if (updates) updates_ += 1;  // counted once enqueued (a failed capture takes none)
    done_[s.slot].record(stream());
  }

  void enqueue_step(const StepShape& s) {
    const bool train = s.train;
    const int slot = s.slot;
    const std::size_t n = s.n, global_n = s.global;
    const std::int32_t* labels = inputs_[slot].labels;
    // A step skipped (halted, non-finite, fp16's overflow) puts back the
    // running statistics its forward passes moved: those of its start.
    if (train && !s.accumulate) {
      LOOM_CUDA_CHECK(cudaMemsetAsync(&totals_->skipped, 0, sizeof(int), stream()));
      layers_.keep_state();
    }
    if (n > 0) {
      // Rounded at every step: the master weights change with each update,
      // and the host may replace them between steps.
      layers_.round_weights();
      layers_.forward(0, inputs_[slot].images, n, train);
      softmax_xent_async(layers_.output(0), labels, n, classes, s.group,
                         train ? layers_.output_gradient() : nullptr, loss_, stream(),
                         fp16() ? &scale_state_->scale : nullptr);
      if (train) round_values(options_.precision, layers_.output_gradient(), n * classes, stream());
    }
    if (auto* comm = options_.data_parallel) {
      kernels::local_loss_stats<<<1, 1, 0, stream()>>>(loss_.loss_sum(), loss_.correct(),
                                                       loss_.bad_row(), n > 0, stats_);
      LOOM_CUDA_LAUNCH_CHECK("local_loss_stats");
      comm->all_reduce_async(stats_, 3, comm::ReduceOp::sum, stream());
      kernels::accumulate_global_loss<<<1, 1, 0, stream()>>>(
          stats_, loss_.bad_row(), labels, n > 0, global_n, train, skip_nonfinite_, totals_);
      LOOM_CUDA_LAUNCH_CHECK("accumulate_global_loss");
    } else {
      accumulate_loss(loss_, labels, n, train, totals_, stream(), skip_nonfinite_);
    }
    if (train) {
      const bool parallel = options_.data_parallel != nullptr;
      std::size_t next = 0;  // the next bucket to reduce (the last batch only)
      const auto reduce_ready = [&](std::size_t layer) {
        if (!parallel || !s.last) return;
        for (; next < buckets_.size() && buckets_[next].ready_after == layer; ++next)
          reduce_bucket(next, s.accumulate);
      };
      if (n > 0) {
        layers_.backward(0, n, reduce_ready);
      } else {
        // No samples here: a zero gradient, so the sum is the others'.
        LOOM_CUDA_CHECK(cudaMemsetAsync(layers_.grads(), 0, layout::total * sizeof(float),
                                        stream()));
      }
      if (!s.last) {
        // Kept for the step's last batch (the first copies, the others add).
        if (s.accumulate)
          add_into(accum_, layers_.grads(), layout::total, stream());
        else
          LOOM_CUDA_CHECK(cudaMemcpyAsync(accum_, layers_.grads(), layout::total * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream()));
      } else {
        if (parallel && !buckets_.empty()) {
          while (next < buckets_.size()) reduce_bucket(next++, s.accumulate);
          // Joins the communication stream back (a capture must end on one stream).
          reduced_.record(comm_stream_.get());
          reduced_.wait_on(stream());
        } else if (s.accumulate) {
          add_into(layers_.grads(), accum_, layout::total, stream());
        }
        // The step protocol, every policy's (parallel/step_protocol.hpp),
        // enqueued: under data parallelism over the summed gradients, so
        // every rank decides alike (the all-reduce summed fp16's scaled
        // gradients, as the CPU's replicas do).
        FlaggedStep executor{*this, s.clip};
        ::loom::detail::step_protocol(
            executor, {.lr = lr_,
                       .max_grad_norm = s.clip ? max_norm_ : 0.0f,
                       .precision = options_.precision});
      }
    }
    LOOM_CUDA_CHECK(cudaMemcpyAsync(snapshots_.data() + slot, totals_, sizeof(LossTotals),
                                    cudaMemcpyDeviceToHost, stream()));
    if (fp16())
      LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_snapshots_.data() + slot, scale_state_,
                                      sizeof(LossScaleState), cudaMemcpyDeviceToHost, stream()));
  }

  // The step protocol's executor for a step whose decisions are taken on
  // the device, in flags the host never waits for: each question enqueues
  // the pass that sets its flag (the loss's, accumulate_loss, is enqueued
  // already) and answers "go on", and every later pass is a no-op once the
  // step is to be skipped (halted, non-finite or overflowed): the update
  // leaves the weights, and the running statistics are put back. So the
  // host takes the updating branch, whose enqueued work is the whole
  // protocol; the skipping branches are the device's.
  struct FlaggedStep {
    DeviceModel& m;
    bool clipping;

    // The loss kernels (accumulate_loss; accumulate_global_loss under data
    // parallelism) set the flags.
    bool loss_finite() { return true; }
    bool gradients_finite() {
      check_gradients(m.layers_.grads(), layout::total, m.bad_gradients_, m.skip_nonfinite_,
                      m.totals_, m.skip_, m.stream());
      return true;
    }
    // The scale is the device's, and moves there (LossScaler's rule).
    bool unscale(float) {
      unscale_and_update(m.layers_.grads(), layout::total, m.scale_state_,
                         m.options_.loss_scaling, m.skip_nonfinite_, m.totals_, m.skip_,
                         m.stream());
      return true;
    }
    void skip_nonfinite(bool) {}
    void skip_overflow(bool) {}
    // The norm, read by the update (which scales by it, as clip_gradients does).
    void clip(float) {
      squared_norm(m.layers_.grads(), layout::total, m.norm_, m.norm_scratch_,
                   m.norm_scratch_bytes_, m.stream());
    }
    // At the learning rate staged in the update's scalars (stage_update).
    void update(float) {
      DeviceLayers<Net>& l = m.layers_;
      optimizer_update(m.optimizer_, l.params(), l.grads(), l.moment(0), l.moment(1),
                       layout::total, m.update_, clipping ? m.norm_ : nullptr, m.skip_,
                       m.stream());
      if constexpr (state_count > 0)
        copy_if_set(m.skip_, l.kept_state(), l.state(), state_count, m.stream());
    }
  };

  // Bucket b's gradients are final on the compute stream: the communication
  // stream waits for that point only, then sums them over the ranks.
  // With accumulate, the step's earlier batches' gradients are added first.
  void reduce_bucket(std::size_t b, bool accumulate) {
    const auto& bucket = buckets_[b];
    float* grads = layers_.grads();
    if (accumulate) add_into(grads + bucket.begin, accum_ + bucket.begin, bucket.size(), stream());
    bucket_ready_[b].record(stream());
    bucket_ready_[b].wait_on(comm_stream_.get());
    options_.data_parallel->all_reduce_async(grads + bucket.begin, bucket.size(),
                                             comm::ReduceOp::sum, comm_stream_.get());
  }

  // Optimizer step t's scalars (its number, lr, clipping), written
  // for the update to read.
  void stage_update(std::uint64_t t) {
    const UpdateScalars next = update_scalars(optimizer_, lr_, t, max_norm_);
    if (next == update_value_) return;
    update_value_ = next;
    scalars_.copy(update_, update_value_, stream());
  }

  // Gradient buckets over the padded device layout (BucketPlan's rule).
  static std::vector<GradientBucket> plan_buckets(std::size_t bucket_bytes) {
    std::vector<GradientBucket> out;
    loom::plan_buckets(layout::starts, std::max<std::size_t>(bucket_bytes / sizeof(float), 1),
                       [&](const GradientBucket& b) { out.push_back(b); });
    return out;
  }

  void fill_slot(int slot, const float* images, const std::int32_t* labels, std::size_t n) {
    LOOM_CHECK(n >= 1 && n <= max_batch_, "DeviceModel: a batch of ", n,
               " samples; this model was planned for 1 to ", max_batch_);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(inputs_[slot].images, images, n * sample_size * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream()));
    LOOM_CUDA_CHECK(cudaMemcpyAsync(inputs_[slot].labels, labels, n * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToDevice, stream()));
  }

  cpu::LossSums blocking_step(bool train, const float* images, const std::int32_t* labels,
                              std::size_t n) {
    refuse_when_parallel(train ? "train_step(images, labels, n)" : "evaluate");
    reset_totals();
    fill_slot(0, images, labels, n);
    step({.train = train, .n = n, .global = n, .group = n, .slot = 0});
    const LossTotals totals = wait_totals(0);
    if (totals.halted == halt_bad_label)
      LOOM_FAIL("label ", totals.bad_label, " of sample ", totals.bad_row,
                " is outside the network's ", classes, " classes");
    if (totals.halted == halt_nonfinite_loss)
      LOOM_FAIL("the training loss became ", loss_text(totals.halt_loss),
                "; the weights are kept from the step before");
    if (totals.halted == halt_nonfinite_gradients)
      LOOM_FAIL("the gradients became non-finite under a finite loss; the weights are kept from "
                "the step before");
    // set_skip_nonfinite's skips: this one step is all the caller has.
    if (totals.skipped == skipped_loss)
      LOOM_FAIL("the training loss became ", loss_text(totals.nonfinite_loss),
                "; the step was skipped (set_skip_nonfinite), the weights are kept from the step "
                "before");
    if (totals.skipped == skipped_gradients)
      LOOM_FAIL("the gradients became non-finite; the step was skipped (set_skip_nonfinite), the "
                "weights are kept from the step before");
    if (totals.halted == halt_gradient_overflow) {
      char scale[32];
      const auto end = std::to_chars(scale, scale + sizeof scale, options_.loss_scaling.min_scale).ptr;
      LOOM_FAIL("the gradients became non-finite under a finite loss, even at fp16's minimum "
                "loss scale ", std::string_view(scale, end - scale), " (LossScaling::min_scale); "
                "the weights are kept from the step before");
    }
    return {totals.loss, static_cast<std::size_t>(totals.correct)};
  }

  DeviceContext context_;
  std::size_t max_batch_;
  DeviceOptimizer optimizer_;
  DeviceModelOptions options_;
  StepGraphs<typename StepShape::Key> graphs_;
  DeviceLayers<Net> layers_;
  std::unique_ptr<DeviceArena> arena_;
  SoftmaxXentWorkspace loss_;
  LossScaler scaler_;  // checks LossScaling's options, and bounds set_loss_scale's
  PinnedBuffer<LossTotals> snapshots_;  // one per input slot
  PinnedBuffer<LossScaleState> scale_snapshots_;  // fp16's, one per input slot
  std::array<Event, 2> done_;
  Stream comm_stream_;
  std::vector<GradientBucket> buckets_;
  std::vector<Event> bucket_ready_;
  Event reduced_;
  double* stats_ = nullptr;  // loss, correct, bad-label flag: summed over the ranks
  float* accum_ = nullptr;   // gradients of an optimizer step's earlier batches
  UpdateScalars* update_ = nullptr;
  UpdateScalars update_value_{.lr = std::numeric_limits<float>::quiet_NaN()};  // the last copied
  ScalarStager scalars_;  // the host's per-step values, through pinned slots
  float lr_ = 0.0f;
  float max_norm_ = 0.0f;
  std::uint64_t updates_ = 0;
  double* norm_ = nullptr;  // the gradients' squared global norm, when clipping
  std::size_t norm_scratch_bytes_ = squared_norm_bytes(layout::total);
  unsigned char* norm_scratch_ = nullptr;
  LossScaleState* scale_state_ = nullptr;  // fp16's
  int* flags_ = nullptr;  // skip_, bad_gradients_, skip_nonfinite_
  int* skip_ = nullptr;  // the step's update is skipped (halted, non-finite or overflowed)
  int* bad_gradients_ = nullptr;  // fp32, bf16: the step's gradients are not all finite
  int* skip_nonfinite_ = nullptr;  // set_skip_nonfinite's flag, on the device
  int skip_nonfinite_value_ = 0;   // its last value (copy_state_from takes it)
  LossTotals* totals_ = nullptr;
  std::array<StagingSlot, 2> inputs_{};
};

}  // namespace loom::gpu
