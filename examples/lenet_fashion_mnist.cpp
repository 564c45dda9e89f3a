// The classic: LeNet trained on Fashion-MNIST, with progress and the final
// test accuracy. The network is a type; the policy is a type too.
//
//   lenet_fashion_mnist                    one device: the GPU where there is one
//                                          (built by nvcc), else the CPU
//   lenet_fashion_mnist --devices 4        DataParallel over 4 CPU worker devices
//   lenet_fashion_mnist --policy split --devices 2 [--schedule gpipe|1f1b]
//                       [--micro-batches M]
//                                          ModelSplit: a pipeline of 2 balanced stages
//   mpirun -np 2 lenet_fashion_mnist [--policy split]
//                                          DataParallel (or ModelSplit) over 2
//                                          processes (built with loom::mpi); rank 0 reports
#include "example_main.hpp"

using namespace loom;

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::parameter_count == 431080);

int main(int argc, char** argv) {
  return examples::example_main<LeNet>(argc, argv, "LeNet", examples::Options{});
}
