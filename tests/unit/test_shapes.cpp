// The network as a type: shapes, parameter counts, FLOPs, the fusion rewrite
// and the memory plan, all checked at compile time (STATIC_REQUIRE).
#include <loom/loom.hpp>

#include "loom_test.hpp"

using namespace loom;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

template <std::size_t I>
using lenet_layer = type_at_t<I, LeNet::layers>;

}  // namespace

TEST_CASE("shapes: LeNet's shapes are inferred left to right") {
  STATIC_REQUIRE(std::is_same_v<LeNet::input_shape, Shape<1, 28, 28>>);
  STATIC_REQUIRE(std::is_same_v<lenet_layer<0>::output_shape, Shape<20, 24, 24>>);
  STATIC_REQUIRE(std::is_same_v<lenet_layer<2>::output_shape, Shape<20, 12, 12>>);
  STATIC_REQUIRE(std::is_same_v<lenet_layer<3>::output_shape, Shape<50, 8, 8>>);
  STATIC_REQUIRE(std::is_same_v<lenet_layer<5>::output_shape, Shape<50, 4, 4>>);
  STATIC_REQUIRE(std::is_same_v<lenet_layer<6>::output_shape, Shape<800>>);
  STATIC_REQUIRE(std::is_same_v<LeNet::output_shape, Shape<10>>);
  STATIC_REQUIRE(LeNet::layer_count == 10);
  // Indices count from 1 (the Input is 0), as error messages and cuts use them.
  STATIC_REQUIRE(lenet_layer<0>::index == 1);
  STATIC_REQUIRE(lenet_layer<7>::index == 8);
}

TEST_CASE("shapes: a layer inside blocks is named by its path") {
  using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 1, 1>,
                         Series<ReLU, Residual<ReLU, Conv2d<4, 3, 1, 1>>>, Flatten, Linear<10>>;
  using Series2 = type_at_t<1, Net::layers>;
  using Residual22 = type_at_t<1, Series2::children>;
  using Conv222 = type_at_t<1, Residual22::children>;
  STATIC_REQUIRE(std::is_same_v<detail::layer_path_t<type_at_t<0, Net::layers>::index>,
                                LayerPath<1>>);
  STATIC_REQUIRE(std::is_same_v<detail::layer_path_t<Series2::index>, LayerPath<2>>);
  STATIC_REQUIRE(std::is_same_v<detail::layer_path_t<Residual22::index>, LayerPath<2, 2>>);
  STATIC_REQUIRE(std::is_same_v<detail::layer_path_t<Conv222::index>, LayerPath<2, 2, 2>>);
  STATIC_REQUIRE(std::is_same_v<typename Conv222::spec, Conv2d<4, 3, 1, 1>>);
  CHECK(detail::layer_path_text(type_at_t<3, Net::layers>::index) == "layer 4");
  CHECK(detail::layer_path_text(Residual22::index) == "layer 2.2");
  CHECK(detail::layer_path_text(Conv222::index) == "layer 2.2.2");
  // A projection shortcut is its Residual's child 0.
  using Projected = Sequential<Input<6>, Residual<Linear<4>>, Linear<2>>;
  using Shortcut = typename type_at_t<0, Projected::layers>::shortcut;
  STATIC_REQUIRE(std::is_same_v<detail::layer_path_t<Shortcut::index>, LayerPath<1, 0>>);
  CHECK(detail::layer_path_text(Shortcut::index) == "layer 1.0");
}

TEST_CASE("shapes: parameter counts") {
  STATIC_REQUIRE(LeNet::parameter_count == 431080);
  STATIC_REQUIRE(lenet_layer<0>::param_count == 20 * 25 + 20);
  STATIC_REQUIRE(lenet_layer<3>::param_count == 50 * 500 + 50);
  STATIC_REQUIRE(lenet_layer<7>::param_count == 800 * 500 + 500);
  STATIC_REQUIRE(lenet_layer<9>::param_count == 5010);
}

TEST_CASE("shapes: stride, padding and floor-mode pooling") {
  using Net = Sequential<Input<3, 32, 30>, Conv2d<8, 3, 2, 1>, AvgPool2d<3, 2>, Conv2d<4, 1>,
                         MaxPool2d<2>, Flatten, Linear<6>>;
  STATIC_REQUIRE(std::is_same_v<type_at_t<0, Net::layers>::output_shape, Shape<8, 16, 15>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, Net::layers>::output_shape, Shape<8, 7, 7>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<3, Net::layers>::output_shape, Shape<4, 3, 3>>);
  STATIC_REQUIRE(std::is_same_v<Net::output_shape, Shape<6>>);
  STATIC_REQUIRE(Net::parameter_count == (8 * 27 + 8) + (4 * 8 + 4) + (36 * 6 + 6));
}

TEST_CASE("shapes: per-layer FLOPs per sample") {
  // conv1: 2 * 20 filters * 576 positions * 25 taps + bias; conv2 likewise.
  STATIC_REQUIRE(LeNet::forward_flops[0] == 2 * 20 * 576 * 25 + 20 * 576);
  // The first layer needs no input gradient: one GEMM less.
  STATIC_REQUIRE(LeNet::backward_flops[0] == 2 * 20 * 576 * 25 + 20 * 576);
  STATIC_REQUIRE(LeNet::backward_flops[3] == 4 * 50 * 64 * 500 + 50 * 64);
  STATIC_REQUIRE(LeNet::forward_flops[3] == 2 * 50 * 64 * 500 + 50 * 64);
  STATIC_REQUIRE(LeNet::forward_flops[7] == 2 * 800 * 500 + 500);
  STATIC_REQUIRE(LeNet::backward_flops[7] == 4 * 800 * 500 + 500);
  STATIC_REQUIRE(LeNet::forward_flops[2] == 2880 * 4);
  STATIC_REQUIRE(LeNet::forward_flops[6] == 0);
}

TEST_CASE("shapes: the fusion pass folds each ReLU into the layer before it") {
  using E = LeNet::executed;
  STATIC_REQUIRE(E::size == 7);
  STATIC_REQUIRE(
      std::is_same_v<type_at_t<0, E>, Bind<Fused<Conv2d<20, 5>, ReLU>, Shape<1, 28, 28>, 1>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, E>, Bind<MaxPool2d<2>, Shape<20, 24, 24>, 3>>);
  STATIC_REQUIRE(
      std::is_same_v<type_at_t<2, E>, Bind<Fused<Conv2d<50, 5>, ReLU>, Shape<20, 12, 12>, 4>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<5, E>, Bind<Fused<Linear<500>, ReLU>, Shape<800>, 8>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<6, E>, Bind<Linear<10>, Shape<500>, 10>>);
  // A ReLU with nothing to fuse into stays a layer of its own.
  using Odd = Sequential<Input<4>, ReLU, Linear<3>, ReLU, ReLU>;
  STATIC_REQUIRE(
      std::is_same_v<Odd::executed,
                     TypeList<Bind<ReLU, Shape<4>, 1>, Bind<Fused<Linear<3>, ReLU>, Shape<4>, 2>,
                              Bind<ReLU, Shape<3>, 4>>>);
  STATIC_REQUIRE(Unfused<LeNet>::executed::size == 10);
}

TEST_CASE("shapes: the activation memory plan") {
  constexpr MemoryPlan plan = LeNet::memory_plan;
  // Outputs kept for backward: conv1 (fused) 11520, pool 2880, conv2 3200,
  // pool 800, Flatten aliases, fc1 500, fc2 10.
  STATIC_REQUIRE(plan.activations == 11520 + 2880 + 3200 + 800 + 500 + 10);
  // Two ping-pong gradient buffers of the largest activation (conv1's output).
  STATIC_REQUIRE(plan.activation_gradients == 2 * 11520);
  // Whole-batch workspace: fc1's dZ (500 per sample). Convolutions work in
  // chunks of 64 samples; conv2's im2col matrix (500 x 64) and GEMM output
  // (50 x 64) per sample are the largest.
  STATIC_REQUIRE(plan.workspace == 500);
  STATIC_REQUIRE(plan.chunked_workspace == 500 * 64 + 50 * 64);
  STATIC_REQUIRE(plan.chunk == 64);
  STATIC_REQUIRE(plan.workspace_elements(16) == 16 * 35200);
  STATIC_REQUIRE(plan.workspace_elements(256) == 64 * 35200);
  STATIC_REQUIRE(plan.parameters == 431080);
  STATIC_REQUIRE(plan.training_bytes(256, 4) ==
                 (3 * 431080 + 256 * (18910 + 23040) + 64 * 35200) * 4);
  // Unfused, every ReLU output is kept as well.
  STATIC_REQUIRE(Unfused<LeNet>::memory_plan.activations == plan.activations + 11520 + 3200 + 500);
}

TEST_CASE("shapes: in-place layers hand on the buffer of the layer before them") {
  using E = LeNet::executed;
  // Executed: conv1, pool1, conv2, pool2, Flatten (in place), fc1, fc2.
  STATIC_REQUIRE(detail::list_info<E>::output_owner == std::array<int, 7>{0, 1, 2, 3, 3, 5, 6});
  using FlatFirst = Sequential<Input<2, 3, 3>, Flatten, Linear<4>>;
  STATIC_REQUIRE(detail::list_info<FlatFirst::executed>::output_owner == std::array<int, 2>{-1, 1});
}
