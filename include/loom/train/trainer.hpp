// Trainer<Net, Policy, Optimizer>: fits a network to a dataset. The policy
// says how the network is spread over devices; the optimizer how weights move.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../backend/cpu/threads.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/data.hpp"
#include "../loss/softmax_cross_entropy.hpp"
#include "../net/model.hpp"
#include "../optim/sgd.hpp"
#include "../parallel/single_device.hpp"

namespace loom {

struct TrainerOptions {
  std::uint64_t seed = 0;  // weight initialisation
};

struct FitOptions {
  int epochs = 1;
  std::size_t batch_size = 64;
  bool shuffle = true;
  std::uint64_t seed = 0;  // data order: epoch e uses the permutation keyed by (seed, e)
};

struct EvalResult {
  double loss = 0.0;      // mean cross-entropy
  double accuracy = 0.0;  // fraction in [0, 1]
  std::size_t samples = 0;
};

struct FitInfo {
  int epochs = 0;
  std::size_t steps_per_epoch = 0;
  std::size_t samples_per_epoch = 0;
  std::size_t batch_size = 0;
};

struct StepInfo {
  int epoch = 0;  // 1-based
  int epochs = 0;
  std::size_t step = 0;  // 1-based, within the epoch
  std::size_t steps = 0;
  double loss = 0.0;        // mean over the epoch so far
  double accuracy = 0.0;    // over the epoch so far
  std::size_t samples = 0;  // seen this epoch
  double seconds = 0.0;     // since the epoch began
};

struct EpochInfo {
  int epoch = 0;
  int epochs = 0;
  double loss = 0.0;
  double accuracy = 0.0;
  std::size_t samples = 0;
  double seconds = 0.0;
};

template <class Net_, class Policy_ = SingleDevice, class Optimizer_ = SGD>
class Trainer {
 public:
  using Net = Net_;
  using Policy = Policy_;
  using Optimizer = Optimizer_;
  using Loss = SoftmaxCrossEntropy;
  static constexpr std::size_t classes = Net::output_shape::size;

  static_assert(
      Net::output_shape::rank == 1,
      "Trainer: the network must end in a flat vector of class scores (end with Linear<classes>)");

  Trainer(std::vector<Device> devices, typename Optimizer::Options options = {},
          TrainerOptions trainer_options = {})
      : devices_(std::move(devices)),
        model_(trainer_options.seed),
        optimizer_(options, Net::parameter_count) {
    LOOM_CHECK(devices_.size() == Policy::devices_needed, Policy::name, " runs on ",
               Policy::devices_needed, " device(s) but ", devices_.size(),
               " were given; pass that many (e.g. devices::cpu(", Policy::devices_needed, "))");
    for (const auto& device : devices_)
      LOOM_CHECK(device.kind == Device::Kind::cpu, "device ", device.name(),
                 " needs the CUDA backend: compile with nvcc to use GPUs");
  }

  template <class... Callbacks>
  void fit(const data::Dataset& train, FitOptions options, Callbacks&&... callbacks) {
    check_dataset(train, "fit");
    LOOM_CHECK(options.epochs >= 1, "fit: epochs must be >= 1, got ", options.epochs);
    LOOM_CHECK(options.batch_size >= 1, "fit: batch size must be >= 1");
    cpu::set_threads(devices_.front().threads);
    model_.reserve(options.batch_size);

    data::Loader loader(
        train,
        {.batch_size = options.batch_size, .shuffle = options.shuffle, .seed = options.seed});
    const FitInfo info{options.epochs, loader.batches_per_epoch(), train.count, options.batch_size};
    (call_fit_begin(callbacks, info), ...);

    for (int epoch = 1; epoch <= options.epochs; ++epoch) {
      loader.start_epoch(static_cast<std::size_t>(epoch - 1));
      const auto start = std::chrono::steady_clock::now();
      StepInfo step{.epoch = epoch, .epochs = options.epochs, .steps = info.steps_per_epoch};
      double loss_sum = 0.0;
      std::size_t correct = 0;
      data::Batch batch{};
      while (loader.next(batch)) {
        const auto sums = train_step(batch, epoch, step.step + 1);
        loss_sum += sums.loss;
        correct += sums.correct;
        step.step += 1;
        step.samples += batch.size;
        step.loss = loss_sum / static_cast<double>(step.samples);
        step.accuracy = static_cast<double>(correct) / static_cast<double>(step.samples);
        step.seconds = seconds_since(start);
        (call_step(callbacks, step), ...);
      }
      [[maybe_unused]] const EpochInfo done{epoch,         options.epochs, step.loss,
                                            step.accuracy, step.samples,   seconds_since(start)};
      (call_epoch_end(callbacks, done), ...);
    }
  }

  // batch_size 0: the training batch size when fit() has run (the arena
  // already holds it), else 256.
  EvalResult evaluate(const data::Dataset& dataset, std::size_t batch_size = 0) {
    check_dataset(dataset, "evaluate");
    if (batch_size == 0) batch_size = model_.capacity() > 0 ? model_.capacity() : 256;
    cpu::set_threads(devices_.front().threads);
    EvalResult result;
    double loss_sum = 0.0;
    std::size_t correct = 0;
    const std::size_t sample = dataset.sample_size();
    for (std::size_t first = 0; first < dataset.count; first += batch_size) {
      const std::size_t n = std::min(batch_size, dataset.count - first);
      const float* logits = model_.forward(dataset.images.data() + first * sample, n);
      const auto sums =
          Loss::evaluate<float>(logits, dataset.labels.data() + first, n, classes, n, nullptr);
      loss_sum += sums.loss;
      correct += sums.correct;
    }
    result.samples = dataset.count;
    result.loss = dataset.count ? loss_sum / static_cast<double>(dataset.count) : 0.0;
    result.accuracy =
        dataset.count ? static_cast<double>(correct) / static_cast<double>(dataset.count) : 0.0;
    return result;
  }

  Model<Net, float>& model() { return model_; }
  const Model<Net, float>& model() const { return model_; }
  const std::vector<Device>& devices() const { return devices_; }
  typename Optimizer::template State<float>& optimizer() { return optimizer_; }

 private:
  cpu::LossSums train_step(const data::Batch& batch, int epoch, std::size_t step) {
    const float* logits = model_.forward(batch.images, batch.size);
    const auto sums = Loss::evaluate<float>(logits, batch.labels, batch.size, classes, batch.size,
                                            model_.output_gradient());
    // Checked before the update, so the weights stay those of the last good step.
    if (!std::isfinite(sums.loss))
      LOOM_FAIL("the training loss became ", sums.loss, " at epoch ", epoch, ", step ", step,
                "; the weights are kept from the step before. Lower the learning rate or check "
                "the input data");
    model_.backward();
    optimizer_.step(model_.parameters(), model_.gradients());
    return sums;
  }

  void check_dataset(const data::Dataset& dataset, const char* what) const {
    LOOM_CHECK(dataset.count > 0, what, ": dataset '", dataset.name, "' is empty");
    LOOM_CHECK(dataset.sample_size() == Net::input_shape::size, what, ": dataset '", dataset.name,
               "' has samples of ", dataset.channels, "x", dataset.height, "x", dataset.width,
               " = ", dataset.sample_size(), " values but the network's Input holds ",
               Net::input_shape::size);
    LOOM_CHECK(dataset.classes <= classes, what, ": dataset '", dataset.name, "' has ",
               dataset.classes, " classes but the network outputs ", classes, " scores");
    LOOM_CHECK(dataset.images.size() == dataset.count * dataset.sample_size() &&
                   dataset.labels.size() == dataset.count,
               what, ": dataset '", dataset.name, "' holds ", dataset.images.size(),
               " image values and ", dataset.labels.size(), " labels for ", dataset.count,
               " samples");
  }

  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  template <class C>
  static void call_fit_begin(C& callback, const FitInfo& info) {
    if constexpr (requires { callback.on_fit_begin(info); }) callback.on_fit_begin(info);
  }
  template <class C>
  static void call_step(C& callback, const StepInfo& info) {
    if constexpr (requires { callback.on_step(info); }) callback.on_step(info);
  }
  template <class C>
  void call_epoch_end(C& callback, const EpochInfo& info) {
    if constexpr (requires { callback.on_epoch_end(info, *this); })
      callback.on_epoch_end(info, *this);
    else if constexpr (requires { callback.on_epoch_end(info); })
      callback.on_epoch_end(info);
  }

  std::vector<Device> devices_;
  Model<Net, float> model_;
  typename Optimizer::template State<float> optimizer_;
};

}  // namespace loom
