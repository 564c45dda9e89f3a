// loom.hpp compiled by nvcc: the whole CPU library, a network type, the
// trainer and its callbacks must stay valid for nvcc's C++20 front end, since
// the CUDA backend is enabled by compiling the same header with nvcc. Built in
// every CI run where nvcc exists; run, it trains nothing and checks devices.
#include <loom/loom.hpp>

#include <cstdio>
#include <type_traits>

using LeNet = loom::Sequential<loom::Input<1, 28, 28>, loom::Conv2d<20, 5>, loom::ReLU,
                               loom::MaxPool2d<2>, loom::Conv2d<50, 5>, loom::ReLU,
                               loom::MaxPool2d<2>, loom::Flatten, loom::Linear<500>, loom::ReLU,
                               loom::Linear<10>>;
static_assert(LeNet::parameter_count == 431080);
static_assert(LeNet::executed::size == 7);

// nvcc's front end once took time doubling with every layer of a network
// (types written as the previous layer's, see net/sequential.hpp), and a
// static_assert naming such a type is re-emitted in full: 42 layers would
// never finish. Now seconds.
template <class... Repeat>
using Deep = loom::Sequential<loom::Input<1, 8, 8>, loom::Conv2d<4, 3, 1, 1>, Repeat...,
                              loom::Flatten, loom::Linear<10>>;
using Deep42 = Deep<loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::Conv2d<4, 3, 1, 1>, loom::ReLU, loom::Conv2d<4, 3, 1, 1>,
                    loom::ReLU, loom::BatchNorm2d, loom::ReLU>;
static_assert(Deep42::layer_count == 42);
static_assert(std::is_same_v<loom::type_at_t<39, Deep42::layers>::output_shape,
                             loom::Shape<4, 8, 8>>);

// What each layer of a GPU range does besides its own work
// (gpu::detail::runner_role): a ReLU mask is handed from a Linear+ReLU to
// the next Linear only within a range, so a pipeline cut between them hands
// over a plain gradient; a later stage's first layer passes its input's
// gradient back.
using Mlp = loom::Sequential<loom::Input<1, 28, 28>, loom::Flatten, loom::Linear<64>, loom::ReLU,
                             loom::Linear<32>, loom::ReLU, loom::Linear<10>>;
using MlpLayers = Mlp::executed;  // Flatten, Linear+ReLU, Linear+ReLU, Linear
static_assert(MlpLayers::size == 4);
namespace gd = loom::gpu::detail;
constexpr loom::LayerRange mlp_all{0, 4}, mlp_front{0, 2}, mlp_back{2, 4};
static_assert(gd::runner_role<MlpLayers, 1>(mlp_all, false).writes_mask);
static_assert(gd::runner_role<MlpLayers, 2>(mlp_all, false).applies_previous_drelu);
// Before the first Linear only Flatten, with nothing to train.
static_assert(!gd::runner_role<MlpLayers, 1>(mlp_all, false).input_gradient);
static_assert(gd::runner_role<MlpLayers, 2>(mlp_all, false).input_gradient);
static_assert(!gd::runner_role<MlpLayers, 1>(mlp_front, false).writes_mask);
static_assert(!gd::runner_role<MlpLayers, 2>(mlp_back, true).applies_previous_drelu);
static_assert(gd::runner_role<MlpLayers, 2>(mlp_back, true).writes_mask);
static_assert(gd::runner_role<MlpLayers, 2>(mlp_back, true).input_gradient);

int main() {
  loom::Trainer<LeNet, loom::SingleDevice, loom::SGD> trainer(loom::devices::all(),
                                                              {.lr = 0.01f, .momentum = 0.9f});
  const auto gpus = loom::devices::gpus();
  for (const auto& gpu : gpus)
    if (gpu.kind != loom::Device::Kind::cuda) return 1;
  std::printf("nvcc build of loom.hpp: %zu GPU(s) visible, %zu parameters\n", gpus.size(),
              trainer.model().parameters().size());
  return trainer.model().parameters().size() == 431080 ? 0 : 1;
}
