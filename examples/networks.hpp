// The Fashion-MNIST examples' networks (LeNet, the deep MLP, the row GRU,
// ResNet-20): the example's program (g++) trains them and its CUDA side
// (<example>_gpu.cu, nvcc) registers their GPU executors, so both name them.
#pragma once

#include <loom/loom.hpp>
#include <type_traits>

namespace loom::examples {

// The classic: two convolutions, two fully connected layers.
using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::parameter_count == 431080);

// Eight 1024-wide hidden layers, deep enough to cut into even pipeline
// stages.
using DeepMlp = Sequential<Input<1, 28, 28>, Flatten, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>,
                           ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<10>>;
static_assert(DeepMlp::layer_count == 18);

// Each image read as a sequence of 28 rows of 28 features by a GRU, whose
// last hidden state is classified.
using RowGru = Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<128>, Linear<64>, ReLU, Linear<10>>;

// ResNet-20: conv-BN-ReLU-conv-BN plus the shortcut; a strided first block
// halves the image and doubles the channels through a 1 x 1 projection.
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

}  // namespace loom::examples
