// The classic: LeNet trained on Fashion-MNIST, with progress and the final
// test accuracy. The network is a type; the policy is a type too.
//
//   lenet_fashion_mnist                    one device: the GPU where there is one
//                                          (built by nvcc), else the CPU
//   lenet_fashion_mnist --devices 4        DataParallel over 4 CPU worker devices
//   mpirun -np 2 lenet_fashion_mnist       DataParallel over 2 processes (built
//                                          with loom::mpi); rank 0 reports
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

namespace {

struct Options {
  int epochs = 10;
  std::size_t batch_size = 64;
  float lr = 0.01f;
  float momentum = 0.9f;
  std::string data_dir = data::default_fashion_mnist_dir;
  std::uint64_t seed = 0;
  std::vector<int> lr_milestones{7};
  float lr_factor = 0.1f;
  int devices = 1;
};

// Trains with `Policy` on `devices`; only `out` hears about it (rank 0's
// console under mpirun, a silent stream on the other ranks).
template <class Policy>
void train(const Options& o, const data::Split& data, std::vector<Device> devices,
           comm::Comm processes, std::ostream& out) {
  const auto started = std::chrono::steady_clock::now();
  out << "loom LeNet on Fashion-MNIST: " << LeNet::parameter_count << " parameters, "
      << data.train.count << " training and " << data.test.count << " test images, "
      << Policy::name;
  if (processes) out << " over " << processes.size() << " processes, each";
  out << " on";
  for (const auto& device : devices) {
    out << ' ' << device.name();
    if (device.kind == Device::Kind::cpu) out << " (" << device.threads << " threads)";
  }
  out << '\n';

  Trainer<LeNet, Policy, SGD> trainer(devices, {.lr = o.lr, .momentum = o.momentum},
                                      {.seed = o.seed}, processes);
  callbacks::Evaluate evaluate(data.test, &out);
  trainer.fit(data.train, {.epochs = o.epochs, .batch_size = o.batch_size, .seed = o.seed},
              callbacks::Progress({.out = &out}), evaluate,
              callbacks::MultiStepLR{.milestones = o.lr_milestones, .factor = o.lr_factor, .out = &out});

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  char line[160];
  std::snprintf(line, sizeof line, "final test accuracy: %.2f%% (loss %.4f) after %d epoch(s), %.1f s\n",
                100.0 * evaluate.last.accuracy, evaluate.last.loss, o.epochs, seconds);
  out << line;
}

}  // namespace

int main(int argc, char** argv) {
#if defined(LOOM_WITH_MPI)
  // First: MPI may take its own arguments out of argv. Without mpirun this
  // is one rank of one.
  std::unique_ptr<dist::Environment> mpi;
  try {
    mpi = std::make_unique<dist::Environment>(argc, argv);
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  const bool distributed = mpi->size() > 1;
  const bool talks = mpi->rank() == 0;
#else
  const bool talks = true;
#endif
  CLI::App app{"Train LeNet on Fashion-MNIST with loom"};
  Options o;
  app.add_option("--epochs", o.epochs, "passes over the training set")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "samples per step (the global batch)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "SGD learning rate")
      ->check(CLI::Range(1e-8f, 100.0f))
      ->capture_default_str();
  app.add_option("--lr-milestones", o.lr_milestones, "epochs after which the learning rate drops")
      ->capture_default_str();
  app.add_option("--lr-factor", o.lr_factor, "learning-rate multiplier at each milestone")
      ->check(CLI::Range(1e-6f, 1.0f))
      ->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")
      ->check(CLI::Range(0.0f, 0.999f))
      ->capture_default_str();
  app.add_option("--data", o.data_dir, "folder with the Fashion-MNIST IDX files (.gz or plain)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed for weights and data order")->capture_default_str();
  app.add_option("--devices", o.devices,
                 "CPU worker devices for DataParallel in this process (1: one device with every "
                 "core, or the GPU); under mpirun each process is one")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::ostream quiet(nullptr);
  std::ostream& out = talks ? std::cout : quiet;
  try {
    const auto data = data::fashion_mnist(o.data_dir);
#if defined(LOOM_WITH_MPI)
    if (distributed) {
      LOOM_CHECK(o.devices == 1, "--devices ", o.devices,
                 " with mpirun: each process trains one replica; start more processes instead");
      train<DataParallel<>>(o, data, mpi->devices(), comm::Comm(mpi->world()), out);
      return 0;
    }
#endif
    const Device first = devices::all().front();
    if (first.kind == Device::Kind::cuda) {
      LOOM_CHECK(o.devices == 1, "--devices ", o.devices,
                 ": DataParallel on GPUs takes one process per GPU; run mpirun -np ", o.devices,
                 " lenet_fashion_mnist");
      train<SingleDevice>(o, data, {first}, {}, out);
    } else if (o.devices == 1) {
      train<SingleDevice>(o, data, {first}, {}, out);
    } else {
      train<DataParallel<>>(o, data, devices::cpu(o.devices), {}, out);
    }
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
#if defined(LOOM_WITH_MPI)
    // The other ranks may be waiting in a collective for this one, and
    // MPI_Finalize would wait for them: the program ends the whole job.
    if (distributed) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    return 1;
  }
  return 0;
}
