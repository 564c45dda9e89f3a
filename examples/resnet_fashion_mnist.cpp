// ResNet-20 (He et al.'s CIFAR design: 3 stages of 3 residual blocks, 16, 32
// and 64 channels, batch normalisation, global average pooling) on
// Fashion-MNIST's 28 x 28 images, or with --cifar DIR on CIFAR-10's 32 x 32
// colour images. The same command line as the LeNet example, --policy
// single|data|split|hybrid included.
#include "example_main.hpp"

using namespace loom;

// conv-BN-ReLU-conv-BN plus the shortcut; a strided first block halves the
// image and doubles the channels through a 1 x 1 projection.
template <std::size_t Channels, std::size_t Stride = 1>
using Block = Residual<Conv2d<Channels, 3, Stride, 1>, BatchNorm2d, ReLU,
                       Conv2d<Channels, 3, 1, 1>, BatchNorm2d>;

template <class In>
using ResNet20 = Sequential<In, Conv2d<16, 3, 1, 1>, BatchNorm2d, ReLU,  //
                            Block<16>, ReLU, Block<16>, ReLU, Block<16>, ReLU,
                            Block<32, 2>, ReLU, Block<32>, ReLU, Block<32>, ReLU,
                            Block<64, 2>, ReLU, Block<64>, ReLU, Block<64>, ReLU,  //
                            GlobalAvgPool, Linear<10>>;
using FashionResNet = ResNet20<Input<1, 28, 28>>;
using CifarResNet = ResNet20<Input<3, 32, 32>>;
static_assert(std::is_same_v<type_at_t<20, FashionResNet::layers>::output_shape, Shape<64, 7, 7>>);
static_assert(std::is_same_v<type_at_t<20, CifarResNet::layers>::output_shape, Shape<64, 8, 8>>);

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 128;
  defaults.epochs = 15;
  defaults.lr = 0.1f;
  defaults.weight_decay = 5e-4f;
  defaults.lr_milestones = {8, 12};
  return examples::example_main<FashionResNet, CifarResNet>(argc, argv, "ResNet-20", defaults);
}
