// The dlib peer of lenet_throughput: the same LeNet, trained by dlib's DNN on
// the same real Fashion-MNIST batches with the same optimizer, timed the same
// way. Prints one JSON line per batch size in lenet_throughput's format, so
// benchmarks/run can divide the two.
#include <dlib/dnn.h>

#include <algorithm>
#include <cstddef>
#include <iostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../lenet_bench.hpp"

namespace {

// dlib's con<> pads by nr/2 at stride 1 ("same" convolution); loom's Conv2d
// does not pad, so the padding is spelled out as 0.
template <long Filters, class Subnet>
using Conv5 = dlib::add_layer<dlib::con_<Filters, 5, 5, 1, 1, 0, 0>, Subnet>;

using DlibLeNet = dlib::loss_multiclass_log<dlib::fc<
    10,
    dlib::relu<dlib::fc<
        500, dlib::max_pool<
                 2, 2, 2, 2,
                 dlib::relu<Conv5<50, dlib::max_pool<2, 2, 2, 2,
                                                     dlib::relu<Conv5<20, dlib::input<dlib::matrix<
                                                                              float>>>>>>>>>>>>;

constexpr std::size_t lenet_parameters = loom::bench::LeNet::parameter_count;

struct Samples {
  std::vector<dlib::matrix<float>> images;
  std::vector<unsigned long> labels;
};

// dlib trains from matrices and unsigned long labels; the pixels are loom's,
// already normalised, so both libraries see identical inputs.
Samples to_dlib(const loom::data::Dataset& set) {
  Samples samples;
  samples.images.reserve(set.count);
  samples.labels.reserve(set.count);
  const auto rows = static_cast<long>(set.height);
  const auto cols = static_cast<long>(set.width);
  for (std::size_t i = 0; i < set.count; ++i) {
    const float* pixels = set.images.data() + i * set.sample_size();
    dlib::matrix<float> image(rows, cols);
    std::copy(pixels, pixels + set.sample_size(), &image(0, 0));
    samples.images.push_back(std::move(image));
    samples.labels.push_back(static_cast<unsigned long>(set.labels[i]));
  }
  return samples;
}

// Fails loudly if the dlib network above is not loom's LeNet: a padded
// convolution or a wrong layer size changes the count.
void check_parameters(const DlibLeNet& net) {
  const std::size_t count = dlib::count_parameters(net);
  std::cerr << "dlib_lenet: dlib's LeNet has " << count << " parameters\n";
  if (count != lenet_parameters)
    throw std::runtime_error("dlib's LeNet has " + std::to_string(count) +
                             " parameters; loom's has " + std::to_string(lenet_parameters) +
                             ", so the two networks differ: check DlibLeNet's layers and padding");
}

nlohmann::json measure(const Samples& train, std::size_t batch,
                       const loom::bench::Options& options) {
  DlibLeNet net;
  // Weight decay 0: loom's run uses none. dlib's update, v = 0.9 v - lr g and
  // w += v, is loom's v = 0.9 v + g and w -= lr v at a constant lr.
  std::vector<dlib::sgd> solvers(DlibLeNet::num_computational_layers, dlib::sgd(0.0f, 0.9f));
  dlib::resizable_tensor input;
  loom::cpu::set_threads(options.threads);
  // dlib's libblas.so.3 forwards to the same libopenblas.so.0 that loom
  // links, so this reads back the thread count dlib's GEMMs run with.
  if (openblas_get_num_threads() != options.threads)
    throw std::runtime_error("OpenBLAS runs " + std::to_string(openblas_get_num_threads()) +
                             " threads, not the " + std::to_string(options.threads) + " asked for");
  const std::size_t batches = train.images.size() / batch;
  return loom::bench::time_steps("dlib", batch, options, [&](std::size_t s) {
    // Consecutive real batches, never the same memory twice in a row.
    const auto first = static_cast<std::ptrdiff_t>((s % batches) * batch);
    const auto images = train.images.begin() + first;
    // What dnn_trainer::train_one_step does, run on this thread: the trainer
    // hands steps to a background thread, which would hide their time. The
    // copy into dlib's input tensor is dlib's own input path (loom reads the
    // batch in place); it moves batch * 3 KiB, far below 1% of a step.
    net.to_tensor(images, images + static_cast<std::ptrdiff_t>(batch), input);
    net.compute_parameter_gradients(input, train.labels.begin() + first);
    net.update_parameters(solvers, 0.01);
    // dlib allocates its parameters on the first forward pass (a warm-up step).
    if (s == 0) check_parameters(net);
  });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LeNet training throughput of dlib's DNN on the CPU (JSON lines)"};
  loom::bench::Options options;
  loom::bench::add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    const Samples train = to_dlib(loom::data::fashion_mnist(options.data_dir).train);
    for (const std::size_t batch : options.batches) {
      loom::bench::check_batch(batch, train.labels.size());
      std::cout << measure(train, batch, options).dump() << std::endl;
    }
  } catch (const std::exception& error) {
    std::cerr << "dlib_lenet: " << error.what() << '\n';
    return 1;
  }
  return 0;
}
