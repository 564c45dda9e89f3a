// The loom side of the PyTorch interoperability test (check_torch.py): trains
// LeNet briefly on Fashion-MNIST and writes, into the folder given,
//   lenet.safetensors      the trainer's checkpoint (Trainer::save)
//   reference.safetensors  "images" [100,1,28,28], the first 100 test images
//                          as loom fed them, and "logits" [100,10], loom's
//                          outputs for them in evaluation mode
//   metrics.jsonl          callbacks::Metrics' lines, for scripts/plot_metrics.py
// 2000 training images and one epoch: a few seconds, and weights far enough
// from their initial values that a wrong layout shows in the logits.
#include <cstddef>
#include <exception>
#include <filesystem>
#include <iostream>
#include <loom/loom.hpp>
#include <span>

using namespace loom;

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " OUTPUT_FOLDER\n";
    return 2;
  }
  try {
    const std::filesystem::path out = argv[1];
    std::filesystem::create_directories(out);
    const auto split = data::fashion_mnist(LOOM_TEST_DATA_DIR);
    const auto train = data::head(split.train, 2000);
    const auto test = data::head(split.test, 500);
    const auto reference = data::head(split.test, 100);

    Trainer<LeNet, SingleDevice, SGD> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f},
                                              {.seed = 0});
    callbacks::Evaluate evaluate(test);
    trainer.fit(train, {.epochs = 1, .batch_size = 64}, evaluate,
                callbacks::Metrics({.path = out / "metrics.jsonl", .evaluate = &evaluate}));
    trainer.save(out / "lenet.safetensors");

    const float* logits = trainer.model().forward(reference.images.data(), reference.count);
    io::SafetensorsWriter writer;
    writer.add("images", reference.images,
               {reference.count, reference.channels, reference.height, reference.width});
    writer.add("logits", std::span<const float>(logits, reference.count * reference.classes),
               {reference.count, reference.classes});
    writer.write(out / "reference.safetensors");
    std::cout << "wrote " << (out / "lenet.safetensors").string() << ", "
              << (out / "reference.safetensors").string() << " and "
              << (out / "metrics.jsonl").string() << '\n';
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "export_lenet: " << error.what() << '\n';
    return 1;
  }
}
