// ResNet-20 (He et al.'s CIFAR design: 3 stages of 3 residual blocks, 16, 32
// and 64 channels, batch normalisation, global average pooling) on
// Fashion-MNIST's 28 x 28 images, or with --cifar DIR on CIFAR-10's 32 x 32
// colour images. The same command line as the LeNet example, --policy
// single|data|split|hybrid included. The network: examples::ResNet20
// (networks.hpp); built with CUDA, resnet_gpu.cu adds the GPU side.
#include "example_main.hpp"
#include "networks.hpp"

using namespace loom;

using examples::CifarResNet;
using examples::FashionResNet;

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 128;
  defaults.epochs = 15;
  defaults.lr = 0.1f;
  defaults.weight_decay = 5e-4f;
  defaults.lr_milestones = {8, 12};
  return examples::example_main<FashionResNet, CifarResNet>(argc, argv, "ResNet-20", defaults);
}
