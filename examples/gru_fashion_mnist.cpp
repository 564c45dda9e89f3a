// The sequence case (speech recognition's shape of problem): each
// Fashion-MNIST image is read as a sequence of 28 rows of 28 features by a
// GRU, and its last hidden state is classified. The same command line as
// the LeNet example, --policy single|data|split|hybrid included.
#include "example_main.hpp"

using namespace loom;

using RowGru = Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<128>, Linear<64>, ReLU, Linear<10>>;

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 64;
  defaults.epochs = 10;
  defaults.lr = 0.05f;
  defaults.lr_milestones = {7};
  return examples::example_main<RowGru>(argc, argv, "row-sequence GRU", defaults);
}
