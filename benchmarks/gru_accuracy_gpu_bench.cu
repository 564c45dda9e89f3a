// Wall time to issue 7's sequence-model bar on one GPU: the GRU example's
// network and recipe (rows of the image as a sequence, to 88 % test
// accuracy: batch 64, SGD lr 0.05 momentum 0.9, 10x lower after epoch 7);
// the loop, the timing and the JSON line are accuracy_gpu_bench.cuh's. (No
// ResNet-20 counterpart yet: nvcc's front end takes over 10 minutes on a
// ResNet-20's CPU Model alone, which g++ compiles in 8 s, so it cannot be
// built on the GPU machine in time.)
#include "accuracy_gpu_bench.cuh"

using RowGru = loom::Sequential<loom::Input<1, 28, 28>, loom::Reshape<28, 28>, loom::GRU<128>,
                                loom::Linear<64>, loom::ReLU, loom::Linear<10>>;

int main(int argc, char** argv) {
  CLI::App app{"Training time of the GRU example's network to its Fashion-MNIST test accuracy "
               "bar on one GPU (JSON line)"};
  loom::bench::AccuracyRecipe recipe{
      .batch = 64, .lr = 0.05f, .milestones = {7}, .epochs = 10, .target = 0.88};
  loom::bench::add_accuracy_options(app, recipe);
  CLI11_PARSE(app, argc, argv);
  return loom::bench::time_to_accuracy<RowGru>("gru_accuracy_gpu_bench", "row_gru_time_to_accuracy",
                                              recipe);
}
