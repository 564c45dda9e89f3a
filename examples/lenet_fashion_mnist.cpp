// The classic: LeNet trained on Fashion-MNIST, with progress and the final
// test accuracy. The network is a type (examples::LeNet, networks.hpp); the
// policy is a type too.
//
//   lenet_fashion_mnist                    every GPU found (built with CUDA; DataParallel
//                                          over them when there are several), else
//                                          one CPU device with every core
//   lenet_fashion_mnist --devices 4        DataParallel over 4 CPU worker devices (or 4
//                                          ranks spread over the GPUs)
//   lenet_fashion_mnist --policy split --devices 2 [--schedule gpipe|1f1b]
//                       [--micro-batches M]
//                                          ModelSplit: a pipeline of 2 balanced stages
//   mpirun -np 2 lenet_fashion_mnist [--policy split]
//                                          DataParallel (or ModelSplit) over 2
//                                          processes (built with loom::mpi); rank 0 reports
//
// Built with CUDA, lenet_gpu.cu adds the GPU side.
#include "example_main.hpp"
#include "networks.hpp"

int main(int argc, char** argv) {
  using namespace loom;
  return examples::example_main<examples::LeNet>(argc, argv, "LeNet", examples::Options{});
}
