// Whole training steps on the GPU against the CPU backend: LeNet from the
// same initial weights, three SGD steps on the same real Fashion-MNIST
// batches, FP32 without TF32 on both sides.
#include <loom/backend/cuda/model.cuh>
#include <loom/loom.hpp>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

namespace test = loom::test;

namespace {

using LeNet =
    loom::Sequential<loom::Input<1, 28, 28>, loom::Conv2d<20, 5>, loom::ReLU, loom::MaxPool2d<2>,
                     loom::Conv2d<50, 5>, loom::ReLU, loom::MaxPool2d<2>, loom::Flatten,
                     loom::Linear<500>, loom::ReLU, loom::Linear<10>>;

}  // namespace

TEST_CASE("cuda model: three LeNet training steps equal the CPU backend's") {
  constexpr std::size_t batch = 64;
  const auto data = loom::data::fashion_mnist(LOOM_TEST_DATA_DIR);
  const loom::SGD::Options options{.lr = 0.01f, .momentum = 0.9f};
  loom::Model<LeNet, float> cpu_model(3, batch);
  loom::SGD::State<float> cpu_sgd(options, LeNet::parameter_count);
  loom::cuda::DeviceModel<LeNet> gpu_model(cpu_model, batch, options);

  const std::size_t sample = data.train.sample_size();
  for (std::size_t step = 0; step < 3; ++step) {
    const float* images = data.train.images.data() + step * batch * sample;
    const std::int32_t* labels = data.train.labels.data() + step * batch;
    const float* logits = cpu_model.forward(images, batch);
    const auto cpu_sums = loom::SoftmaxCrossEntropy::evaluate<float>(
        logits, labels, batch, 10, batch, cpu_model.output_gradient());
    cpu_model.backward();
    cpu_sgd.step(cpu_model.parameters(), cpu_model.gradients());

    auto d_images = test::to_device(std::vector<float>(images, images + batch * sample));
    auto d_labels = test::to_device(std::vector<std::int32_t>(labels, labels + batch));
    const auto gpu_sums = gpu_model.train_step(d_images.data(), d_labels.data());
    // Sums over 64 samples in another order: the loss to 1e-4 relative.
    REQUIRE(gpu_sums.loss == Approx(cpu_sums.loss).epsilon(1e-4));
    REQUIRE(gpu_sums.correct == cpu_sums.correct);
  }
  loom::Model<LeNet, float> from_gpu(0);
  gpu_model.copy_parameters_to(from_gpu);
  // After three steps the weights differ by FP32 summation order only.
  test::require_close(from_gpu.parameters(), cpu_model.parameters(), {1e-5, 1e-3},
                      "weights after 3 steps");
}

LOOM_CUDA_TEST_MAIN
