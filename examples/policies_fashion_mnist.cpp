// The same LeNet, the same data and recipe, trained under each policy in
// turn: the policy is one word of the Trainer's type. Prints, per policy,
// its placement, then a table of training throughput and final test
// accuracy (and one JSON line per policy with --json).
//
//   policies_fashion_mnist [--epochs 1] [--devices 4] [--batch-size 64]
//                          [--train-samples N]
//
// --devices CPU worker devices share this machine's cores; SingleDevice
// takes one device with every core. ModelSplit cuts LeNet into --devices
// balanced stages; Hybrid runs 2 pipelines of --devices / 2 stages.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <loom/loom.hpp>
#include <string>
#include <vector>

using namespace loom;

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

namespace {

struct Options {
  int epochs = 1;
  int devices = 4;
  std::size_t batch_size = 64;
  std::size_t train_samples = 0;  // 0: all
  std::string data_dir = data::default_fashion_mnist_dir;
  bool json = false;
};

struct Row {
  std::string policy;
  std::size_t devices = 0;
  double samples_per_second = 0.0;  // training, last epoch
  double accuracy = 0.0;            // test set, after the last epoch
  double seconds = 0.0;             // the whole fit, evaluations included
};

// Throughput of the last epoch, from the trainer's own clock.
struct Throughput {
  double samples_per_second = 0.0;
  void on_epoch_end(const EpochInfo& epoch) {
    samples_per_second = static_cast<double>(epoch.samples) / epoch.seconds;
  }
};

template <class Policy>
Row train(const std::string& policy, std::vector<Device> devices, const Options& o,
          const data::Split& data) {
  std::cout << "\n== " << policy << " on " << devices.size() << " device(s)\n";
  Trainer<LeNet, Policy> trainer(devices, {.lr = 0.01f, .momentum = 0.9f});
  callbacks::Evaluate evaluate(data.test, &std::cout);
  Throughput throughput;
  const auto started = std::chrono::steady_clock::now();
  trainer.fit(data.train, {.epochs = o.epochs, .batch_size = o.batch_size},
              callbacks::Progress({.lines_per_epoch = 2}), evaluate, throughput);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return {policy, devices.size(), throughput.samples_per_second, evaluate.last.accuracy, seconds};
}

template <std::size_t Stages>
void train_pipelines(const Options& o, const data::Split& data, std::vector<Row>& rows) {
  rows.push_back(train<ModelSplit<Balanced<Stages>>>(
      "ModelSplit<Balanced<" + std::to_string(Stages) + ">>", devices::cpu(Stages), o, data));
  if constexpr (Stages % 2 == 0)
    rows.push_back(train<Hybrid<2, ModelSplit<Balanced<Stages / 2>>>>(
        "Hybrid<2, ModelSplit<Balanced<" + std::to_string(Stages / 2) + ">>>",
        devices::cpu(Stages), o, data));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Train LeNet on Fashion-MNIST under every policy and compare them"};
  app.add_option("--epochs", o.epochs, "passes over the training set per policy")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--devices", o.devices, "CPU worker devices of the parallel policies (2 or 4)")
      ->check(CLI::IsMember({2, 4}))
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "samples per step (the global batch)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 16))
      ->capture_default_str();
  app.add_option("--train-samples", o.train_samples,
                 "train on the first N training images (0: all 60000)")
      ->capture_default_str();
  app.add_option("--data", o.data_dir, "folder with the Fashion-MNIST IDX files")
      ->capture_default_str();
  app.add_flag("--json", o.json, "also print one JSON line per policy");
  CLI11_PARSE(app, argc, argv);

  try {
    auto data = data::fashion_mnist(o.data_dir);
    if (o.train_samples > 0) data.train = data::head(data.train, o.train_samples);
    std::vector<Row> rows;
    rows.push_back(train<SingleDevice>("SingleDevice", devices::cpu(1), o, data));
    rows.push_back(
        train<DataParallel<>>("DataParallel<>", devices::cpu(o.devices), o, data));
    if (o.devices == 2)
      train_pipelines<2>(o, data, rows);
    else
      train_pipelines<4>(o, data, rows);

    std::printf("\nLeNet, %d epoch(s) of %zu images, batch %zu, SGD lr 0.01 momentum 0.9, "
                "%d CPU cores\n\n",
                o.epochs, data.train.count, o.batch_size, devices::hardware_threads());
    std::printf("| policy | devices | samples/s | vs SingleDevice | test accuracy | wall s |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const auto& row : rows)
      std::printf("| `%s` | %zu | %.0f | %.2fx | %.2f %% | %.1f |\n", row.policy.c_str(),
                  row.devices, row.samples_per_second,
                  row.samples_per_second / rows.front().samples_per_second, 100.0 * row.accuracy,
                  row.seconds);
    if (o.json)
      for (const auto& row : rows)
        std::printf("{\"policy\": \"%s\", \"devices\": %zu, \"samples_per_s\": %.1f, "
                    "\"test_accuracy\": %.4f, \"seconds\": %.2f, \"epochs\": %d}\n",
                    row.policy.c_str(), row.devices, row.samples_per_second, row.accuracy,
                    row.seconds, o.epochs);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return 0;
}
