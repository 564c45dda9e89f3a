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
