// The classic: LeNet trained on Fashion-MNIST, with progress and the final
// test accuracy. The network is a type; the policy is a type too. Built by
// nvcc (CMake does where CUDA is found) it trains on the GPU when there is
// one; built by a C++ compiler, on the CPU.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <loom/loom.hpp>
#include <vector>

using namespace loom;

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::parameter_count == 431080);

int main(int argc, char** argv) {
  CLI::App app{"Train LeNet on Fashion-MNIST with loom"};
  int epochs = 10;
  std::size_t batch_size = 64;
  float lr = 0.01f;
  float momentum = 0.9f;
  std::string data_dir = data::default_fashion_mnist_dir;
  std::uint64_t seed = 0;
  std::vector<int> lr_milestones{7};
  float lr_factor = 0.1f;
  app.add_option("--epochs", epochs, "passes over the training set")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch-size", batch_size, "samples per step")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--lr", lr, "SGD learning rate")
      ->check(CLI::Range(1e-8f, 100.0f))
      ->capture_default_str();
  app.add_option("--lr-milestones", lr_milestones, "epochs after which the learning rate drops")
      ->capture_default_str();
  app.add_option("--lr-factor", lr_factor, "learning-rate multiplier at each milestone")
      ->check(CLI::Range(1e-6f, 1.0f))
      ->capture_default_str();
  app.add_option("--momentum", momentum, "SGD momentum")
      ->check(CLI::Range(0.0f, 0.999f))
      ->capture_default_str();
  app.add_option("--data", data_dir, "folder with the Fashion-MNIST IDX files (.gz or plain)")
      ->capture_default_str();
  app.add_option("--seed", seed, "seed for weights and data order")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    const auto started = std::chrono::steady_clock::now();
    const auto data = data::fashion_mnist(data_dir);
    // SingleDevice trains on one: the first GPU, else the CPU with every core.
    const Device device = devices::all().front();
    std::cout << "loom LeNet on Fashion-MNIST: " << LeNet::parameter_count << " parameters, "
              << data.train.count << " training and " << data.test.count
              << " test images, on " << device.name();
    if (device.kind == Device::Kind::cpu) std::cout << " (" << device.threads << " threads)";
    std::cout << '\n';

    Trainer<LeNet, SingleDevice, SGD> trainer({device}, {.lr = lr, .momentum = momentum},
                                              {.seed = seed});
    callbacks::Evaluate evaluate(data.test);
    trainer.fit(data.train, {.epochs = epochs, .batch_size = batch_size, .seed = seed},
                callbacks::Progress{}, evaluate,
                callbacks::MultiStepLR{.milestones = lr_milestones, .factor = lr_factor});

    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("final test accuracy: %.2f%% (loss %.4f) after %d epoch(s), %.1f s\n",
                100.0 * evaluate.last.accuracy, evaluate.last.loss, epochs, seconds);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
