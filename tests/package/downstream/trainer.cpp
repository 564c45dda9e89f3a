// A downstream trainer built twice: header-only (the default), and with
// LOOM_SEPARATE_COMPILATION beside loom_src.cpp (<loom/src.hpp>). Both fit
// LeNet's head on Fashion-MNIST for one epoch under DataParallel on two CPU
// workers, save, load into a new trainer and evaluate; they write what they
// measured to argv[1], and the two files must be equal byte for byte.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <loom/loom.hpp>
#include <string>

using Net = loom::Sequential<loom::Input<1, 28, 28>, loom::Conv2d<8, 5>, loom::ReLU,
                             loom::MaxPool2d<2>, loom::Flatten, loom::Linear<10>>;
using Policy = loom::DataParallel<>;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " RESULT_FILE\n";
    return 2;
  }
  try {
    const auto data = loom::data::fashion_mnist();
    const auto train = loom::data::head(data.train, 1024);
    const auto test = loom::data::head(data.test, 512);
    loom::Trainer<Net, Policy> trainer(loom::devices::cpu(2), {.lr = 0.05f, .momentum = 0.9f});
    trainer.fit(train, {.epochs = 1, .batch_size = 64});
    const std::filesystem::path checkpoint = std::string(argv[1]) + ".safetensors";
    trainer.save(checkpoint);
    loom::Trainer<Net, Policy> loaded(loom::devices::cpu(2), {.lr = 0.05f, .momentum = 0.9f});
    loaded.load(checkpoint);
    const auto before = trainer.evaluate(test);
    const auto after = loaded.evaluate(test);
    char line[160];
    std::snprintf(line, sizeof line, "steps %llu, test loss %.9g accuracy %.9g, loaded %.9g %.9g\n",
                  static_cast<unsigned long long>(loaded.steps()), before.loss, before.accuracy,
                  after.loss, after.accuracy);
    std::ofstream(argv[1]) << line;
    std::cout << line;
    return before.loss == after.loss && loaded.steps() == 16 ? 0 : 1;
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
}
