// The sequence case (speech recognition's shape of problem): each
// Fashion-MNIST image is read as a sequence of 28 rows of 28 features by a
// GRU, and its last hidden state is classified. The same command line as
// the LeNet example, --policy single|data|split|hybrid included.
// The network: examples::RowGru (networks.hpp); built with CUDA, gru_gpu.cu
// adds the GPU side.
#include "example_main.hpp"
#include "networks.hpp"

using namespace loom;
using examples::RowGru;

int main(int argc, char** argv) {
  examples::Options defaults;
  defaults.batch_size = 64;
  defaults.epochs = 10;
  defaults.lr = 0.05f;
  defaults.lr_milestones = {7};
  return examples::example_main<RowGru>(argc, argv, "row-sequence GRU", defaults);
}
