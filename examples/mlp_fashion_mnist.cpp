// A deep MLP on Fashion-MNIST: eight 1024-wide hidden layers, deep enough
// to cut into even pipeline stages. The same command line as the LeNet
// example; --policy split --devices 4 trains it as a pipeline of 4 stages.
// Built with CUDA, mlp_gpu.cu adds the GPU side.
#include "example_main.hpp"
#include "networks.hpp"

using namespace loom;

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 128;
  defaults.epochs = 10;
  return examples::example_main<examples::DeepMlp>(argc, argv, "deep MLP", defaults);
}
