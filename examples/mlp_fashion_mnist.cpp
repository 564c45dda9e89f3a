// A deep MLP on Fashion-MNIST: eight 1024-wide hidden layers, deep enough
// to cut into even pipeline stages. The same command line as the LeNet
// example; --policy split --devices 4 trains it as a pipeline of 4 stages.
#include "example_main.hpp"

using namespace loom;

using DeepMlp = Sequential<Input<1, 28, 28>, Flatten, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU,
                           Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<1024>, ReLU, Linear<10>>;
static_assert(DeepMlp::layer_count == 18);

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 128;
  defaults.epochs = 10;
  return examples::example_main<DeepMlp>(argc, argv, "deep MLP", defaults);
}
