// Wall time to a test accuracy on one GPU: LeNet trained on Fashion-MNIST by
// loom's Trainer (CUDA graphs, batches staged from pinned host memory, the
// loss read back one step late); the loop, the timing and the JSON line are
// accuracy_gpu_bench.cuh's. The recipe is the example's: SGD with momentum
// 0.9, lr 0.01 dropped 10x after epoch 7, batch 64, to 91 %.
#include "accuracy_gpu_bench.cuh"
#include "lenet_bench.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Training time of LeNet to a Fashion-MNIST test accuracy on one GPU (JSON line)"};
  loom::bench::AccuracyRecipe recipe;
  int milestone = 7;
  loom::bench::add_accuracy_options(app, recipe);
  app.add_option("--lr-milestone", milestone, "epoch after which the learning rate drops 10x")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  recipe.milestones = {milestone};
  return loom::bench::time_to_accuracy<loom::bench::LeNet>("lenet_accuracy_gpu_bench",
                                                           "lenet_time_to_accuracy", recipe);
}
