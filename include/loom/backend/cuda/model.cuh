// DeviceModel<Net>: a network's executed layer list on one GPU. Weights come
// from a CPU Model of the same network (so the same seed gives the same
// starting point on both backends); parameters, gradients, optimizer state,
// activations and every workspace live in one device arena sized up front,
// and each layer's cuBLASLt/cuDNN plan is made once for the batch size.
//
// Layer by layer: Linear is one GEMM with a bias(+ReLU) epilogue forward, and
// backward the weight GEMM with the bias-gradient epilogue plus the input
// GEMM; Conv2d is cuDNN (fused conv+bias+ReLU where it offers it);
// pooling, standalone activations, the loss and the SGD update are loom's
// kernels. Not yet: the cross-layer DRELU_BGRAD fusion, CUDA-graph capture of
// the step, and several batch sizes per model.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>

#include "../../core/meta.hpp"
#include "../../net/model.hpp"
#include "../../optim/sgd.hpp"
#include "arena.hpp"
#include "conv.cuh"
#include "epilogue.cuh"
#include "gemm.hpp"
#include "pool.cuh"
#include "sgd.cuh"
#include "softmax_xent.cuh"
#include "stream.hpp"

namespace loom::cuda {

struct DeviceContext {
  Stream stream;
  BlasLt blas;
  Dnn dnn;
  DeviceContext() { dnn.set_stream(stream.get()); }
};

namespace detail {

// How one executed layer runs on the GPU. `scratch` is the layer's share of
// the step workspace: at least scratch_bytes(), reused by every layer.
template <class L>
class LayerRunner {
 public:
  LayerRunner(DeviceContext& context, std::size_t batch) : batch_(batch) {
    if constexpr (L::kind == "conv") {
      conv_ = std::make_unique<Convolution>(context.dnn, L::geometry(batch), out_channels);
    } else if constexpr (L::kind == "linear") {
      constexpr std::size_t in = L::in_features;
      forward_ = std::make_unique<GemmPlan>(
          context.blas, GemmShape{false, true, batch, out_channels, in, in, in, out_channels},
          L::activation == Act::relu ? Epilogue::relu_bias : Epilogue::bias);
      weight_grad_ = std::make_unique<GemmPlan>(
          context.blas, GemmShape{true, false, out_channels, in, batch, out_channels, in, in},
          Epilogue::bgrad_a);
      if constexpr (L::index > 1)
        input_grad_ = std::make_unique<GemmPlan>(
            context.blas, GemmShape{false, false, batch, in, out_channels, out_channels, in, in},
            Epilogue::none);
    }
  }

  // The gradient after the activation derivative (dZ) + the library's own.
  std::size_t scratch_bytes() const {
    std::size_t library = 0;
    if (conv_) library = conv_->workspace_bytes();
    for (const auto* plan : {forward_.get(), weight_grad_.get(), input_grad_.get()})
      if (plan != nullptr) library = std::max(library, plan->workspace_bytes());
    return DeviceArena::padded_bytes<float>(batch_ * L::output_shape::size) + library;
  }

  void forward(const float* params, const float* x, float* y, unsigned char* scratch,
               std::size_t scratch_size, cudaStream_t stream) {
    if constexpr (L::kind == "conv") {
      conv_->forward_bias_act(x, params, params + L::weight_count, y, activation_is_relu(),
                              library(scratch), library_size(scratch_size));
    } else if constexpr (L::kind == "linear") {
      GemmArgs args = gemm_args(x, params, y, scratch, scratch_size, stream);
      args.bias = params + L::weight_count;
      forward_->run(args);
    } else if constexpr (L::kind == "maxpool" || L::kind == "avgpool") {
      pool_forward<L::kind == "maxpool">(L::geometry(batch_), x, y, stream);
    } else if constexpr (L::kind == "relu") {
      activation_forward<Act::relu>(x, y, batch_ * L::output_shape::size, stream);
    } else if constexpr (L::kind != "flatten") {
      static_assert(dependent_false<L>, "No CUDA runner for this layer kind");
    }
  }

  void backward(const float* params, const float* x, const float* y, const float* dy, float* dx,
                float* dparams, unsigned char* scratch, std::size_t scratch_size,
                cudaStream_t stream) {
    float* dz = reinterpret_cast<float*>(scratch);
    if constexpr (L::kind == "conv") {
      conv_->bias_act_backward(dy, y, dz, dparams + L::weight_count, activation_is_relu(), false);
      conv_->backward_filter(x, dz, dparams, false, library(scratch), library_size(scratch_size));
      if (dx != nullptr)
        conv_->backward_data(params, dz, dx, library(scratch), library_size(scratch_size));
    } else if constexpr (L::kind == "linear") {
      const float* grad = dy;
      if constexpr (L::activation == Act::relu) {
        activation_backward<Act::relu>(dy, y, dz, batch_ * out_channels, stream);
        grad = dz;
      }
      GemmArgs weights = gemm_args(grad, x, dparams, scratch, scratch_size, stream);
      weights.bias_grad = dparams + L::weight_count;
      weight_grad_->run(weights);
      if (dx != nullptr)
        input_grad_->run(gemm_args(grad, params, dx, scratch, scratch_size, stream));
    } else if constexpr (L::kind == "maxpool" || L::kind == "avgpool") {
      if (dx != nullptr)
        pool_backward<L::kind == "maxpool">(L::geometry(batch_), x, dy, dx, stream);
    } else if constexpr (L::kind == "relu") {
      if (dx != nullptr)
        activation_backward<Act::relu>(dy, y, dx, batch_ * L::output_shape::size, stream);
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
  unsigned char* library(unsigned char* scratch) const {
    return scratch + DeviceArena::padded_bytes<float>(batch_ * L::output_shape::size);
  }
  std::size_t library_size(std::size_t scratch_size) const {
    return scratch_size - DeviceArena::padded_bytes<float>(batch_ * L::output_shape::size);
  }
  // The pointers every GEMM of the layer shares; callers add their epilogue's.
  GemmArgs gemm_args(const float* a, const float* b, float* c, unsigned char* scratch,
                     std::size_t scratch_size, cudaStream_t stream) const {
    GemmArgs args;
    args.a = a;
    args.b = b;
    args.c = c;
    args.workspace = library(scratch);
    args.workspace_bytes = library_size(scratch_size);
    args.stream = stream;
    return args;
  }

  std::size_t batch_;
  std::unique_ptr<Convolution> conv_;
  std::unique_ptr<GemmPlan> forward_, weight_grad_, input_grad_;
};

template <class List>
struct runners;
template <class... Ls>
struct runners<TypeList<Ls...>> {
  using type = std::tuple<LayerRunner<Ls>...>;
};

}  // namespace detail

template <class Net_>
class DeviceModel {
 public:
  using Net = Net_;
  using executed = typename Net::executed;
  static constexpr std::size_t layer_count = executed::size;
  static constexpr std::size_t parameter_count = Net::parameter_count;
  static constexpr std::size_t classes = Net::output_shape::size;

  // Copies the weights of `initial` to the GPU; every step then works on
  // batches of exactly `batch` samples.
  DeviceModel(const Model<Net, float>& initial, std::size_t batch, SGD::Options sgd)
      : batch_(batch),
        sgd_(sgd),
        runners_(make_runners(std::make_index_sequence<layer_count>{})),
        arena_(plan_bytes(), "DeviceModel on cuda:" + std::to_string(current_device())),
        loss_(batch) {
    params_ = arena_.take<float>(parameter_count);
    grads_ = arena_.take<float>(parameter_count);
    velocity_ = arena_.take<float>(parameter_count);
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!L::in_place) outputs_[i] = arena_.take<float>(batch * L::output_shape::size);
    });
    for (auto& buffer : grad_buffers_) buffer = arena_.take<float>(batch * largest_activation());
    scratch_ = arena_.take<unsigned char>(scratch_bytes_);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(params_, initial.parameters().data(),
                                    parameter_count * sizeof(float), cudaMemcpyHostToDevice,
                                    stream()));
    LOOM_CUDA_CHECK(cudaMemsetAsync(velocity_, 0, parameter_count * sizeof(float), stream()));
  }

  // One SGD step on a device batch (images N x input, labels N). Returns the
  // loss and correct-count sums; synchronises the stream to read them.
  cpu::LossSums train_step(const float* images, const std::int32_t* labels) {
    forward(images);
    const auto sums = loss(labels, grad_buffers_[0]);
    backward();
    sgd_update(params_, grads_, velocity_, parameter_count, sgd_.lr, sgd_.momentum,
               sgd_.weight_decay, sgd_.nesterov, stream());
    return sums;
  }

  // Loss and correct-count sums of a device batch, no update.
  cpu::LossSums evaluate(const float* images, const std::int32_t* labels) {
    forward(images);
    return loss(labels, nullptr);
  }

  void copy_parameters_to(Model<Net, float>& host) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host.parameters().data(), params_,
                                    parameter_count * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream()));
    context_.stream.synchronize();
  }

  cudaStream_t stream() { return context_.stream.get(); }

 private:
  static int current_device() { return cuda::detail::current_device(); }

  static constexpr std::size_t largest_activation() {
    return ::loom::detail::list_info<executed>::largest_activation;
  }

  template <std::size_t... I>
  typename detail::runners<executed>::type make_runners(std::index_sequence<I...>) {
    return {detail::LayerRunner<type_at_t<I, executed>>(context_, batch_)...};
  }

  std::size_t plan_bytes() {
    std::size_t bytes = 3 * DeviceArena::padded_bytes<float>(parameter_count);
    static_for<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      if constexpr (!L::in_place)
        bytes += DeviceArena::padded_bytes<float>(batch_ * L::output_shape::size);
      scratch_bytes_ = std::max(scratch_bytes_, std::get<i>(runners_).scratch_bytes());
    });
    bytes += 2 * DeviceArena::padded_bytes<float>(batch_ * largest_activation());
    bytes += DeviceArena::padded_bytes<unsigned char>(scratch_bytes_);
    return bytes;
  }

  template <std::size_t I>
  const float* layer_input() const {
    if constexpr (I == 0)
      return input_;
    else
      return layer_output<I - 1>();
  }
  template <std::size_t I>
  float* layer_output() const {
    constexpr int owner = ::loom::detail::list_info<executed>::output_owner[I];
    if constexpr (owner < 0)
      return const_cast<float*>(input_);
    else
      return outputs_[owner];
  }

  void forward(const float* images) {
    input_ = images;
    static_for<layer_count>([&](auto i) {
      std::get<i>(runners_).forward(params_ + offset(i), layer_input<i>(), layer_output<i>(),
                                    scratch_, scratch_bytes_, stream());
    });
  }

  cpu::LossSums loss(const std::int32_t* labels, float* dlogits) {
    return softmax_xent(layer_output<layer_count - 1>(), labels, batch_, classes, batch_, dlogits,
                        loss_, stream());
  }

  void backward() {
    int current = 0;
    static_for_reverse<layer_count>([&](auto i) {
      using L = type_at_t<i, executed>;
      float* dx = i == 0 ? nullptr : grad_buffers_[1 - current];
      std::get<i>(runners_).backward(params_ + offset(i), layer_input<i>(), layer_output<i>(),
                                     grad_buffers_[current], dx, grads_ + offset(i), scratch_,
                                     scratch_bytes_, stream());
      if (!L::in_place) current = 1 - current;
    });
  }

  static constexpr std::size_t offset(std::size_t i) {
    return ::loom::detail::list_info<executed>::param_offsets[i];
  }

  DeviceContext context_;
  std::size_t batch_;
  SGD::Options sgd_;
  std::size_t scratch_bytes_ = 0;
  typename detail::runners<executed>::type runners_;
  DeviceArena arena_;
  SoftmaxXentWorkspace loss_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  float* velocity_ = nullptr;
  std::array<float*, layer_count> outputs_{};
  std::array<float*, 2> grad_buffers_{};
  unsigned char* scratch_ = nullptr;
  const float* input_ = nullptr;
};

}  // namespace loom::cuda
