// What the policy tests share: the networks, the example's optimizer recipe,
// and the single-device weights every policy must reproduce.
#pragma once

#include <cstddef>
#include <limits>
#include <memory>
#include <span>
#include <loom/loom.hpp>
#include <utility>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"

namespace loom::test {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
using Logistic = Sequential<Input<1, 28, 28>, Flatten, Linear<10>>;

// The example's recipe. (At lr 0.02 the first steps of LeNet are chaotic
// enough to grow FP32 rounding differences to 1e-5 in 9 steps.)
inline const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};

// The weights after fit().
template <class Net, class Policy>
std::vector<float> trained(Trainer<Net, Policy>& trainer, const data::Dataset& data,
                           FitOptions fit) {
  trainer.fit(data, fit);
  const auto p = trainer.model().parameters();
  return {p.begin(), p.end()};
}

// One device, seed 7; `threads` BLAS threads (0: every core). GEMMs split
// their sums by thread, so a bit-for-bit comparison needs the same count.
template <class Net>
std::vector<float> single_device(const data::Dataset& data, FitOptions fit, int threads = 0) {
  auto device = devices::cpu(1);
  if (threads > 0) device.front().threads = threads;
  Trainer<Net> trainer(device, sgd, {.seed = 7});
  return trained(trainer, data, fit);
}

// Fits `trainer` (seed 7) and one device on the same data: the loss,
// accuracy and sample count each optimizer step reports to callbacks, and
// the evaluation of the test set, must match.
template <class Net, class Policy>
void require_same_reports(Trainer<Net, Policy>& trainer, const data::Dataset& data,
                          FitOptions fit, const data::Dataset& test, std::size_t steps) {
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  std::vector<StepInfo> policy_steps, single_steps;
  trainer.fit(data, fit, Record{&policy_steps});
  Trainer<Net> single(devices::cpu(1), sgd, {.seed = 7});
  single.fit(data, fit, Record{&single_steps});
  REQUIRE(policy_steps.size() == steps);
  REQUIRE(single_steps.size() == steps);
  for (std::size_t i = 0; i < steps; ++i) {
    REQUIRE(policy_steps[i].samples == single_steps[i].samples);
    REQUIRE(policy_steps[i].loss == Approx(single_steps[i].loss).epsilon(1e-5));
    REQUIRE(policy_steps[i].accuracy == single_steps[i].accuracy);
  }
  const auto a = trainer.evaluate(test);
  const auto b = single.evaluate(test);
  REQUIRE(a.samples == test.count);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-5));
  REQUIRE(a.accuracy == Approx(b.accuracy).margin(1e-4));
}

// A NaN pixel in step 4 of 40-sample batches, unshuffled: `trainer` (made
// with seed 2) stops there as one device does, keeps the weights of step 3
// (within `tolerance`), and trains on afterwards: every rank skipped the
// update together.
template <class Net, class Policy>
void require_nan_stops_like_one_device(Trainer<Net, Policy>& trainer, Tolerance tolerance) {
  auto part = head(fashion().train, 200);
  part.images[3 * 40 * 784 + 17] = std::numeric_limits<float>::quiet_NaN();
  const FitOptions fit{.epochs = 1, .batch_size = 40, .shuffle = false};
  REQUIRE_THROWS_WITH(trainer.fit(part, fit), Catch::Contains("the training loss became nan") &&
                                                  Catch::Contains("at epoch 1, step 4"));
  Trainer<Net> single(devices::cpu(1), sgd, {.seed = 2});
  REQUIRE_THROWS_WITH(single.fit(part, fit), Catch::Contains("at epoch 1, step 4"));
  require_close(trainer.model().parameters(), single.model().parameters(), tolerance,
                "weights of step 3");
  trainer.fit(head(fashion().train, 200), fit);
}

// The CPU's stage over links split from the world per direction, as a GPU
// stage makes them over NCCL (detail::split_links; StageLinks::own, so the
// outboxes send from threads of their own).
template <class StageNet, class Optimizer>
class OwnLinkStage final : public detail::StageOf<StageNet, Optimizer> {
 public:
  using detail::StageOf<StageNet, Optimizer>::StageOf;
  detail::StageLinks links(const MeshGroups& groups, const Mesh& mesh,
                           std::size_t rank) override {
    return detail::split_links(groups.world, mesh, rank);
  }
};

struct OwnLinkStages {
  template <class StageNet, class Optimizer>
  std::unique_ptr<detail::PipelineStage> make(std::span<const float> weights,
                                              std::span<const float> state,
                                              typename Optimizer::Options options,
                                              std::size_t offset, std::size_t state_at,
                                              LayerRange range, const Device&) const {
    return std::make_unique<OwnLinkStage<StageNet, Optimizer>>(weights, state, options, offset,
                                                               state_at, range);
  }
};

// Three clipped steps of 60 samples of LeNet under Grid (a pipelined
// policy) straight on its engine over `Stages`' links, on `devices` of this
// process (and the other processes of `processes`, if any); the weights.
template <class Grid, class Stages>
std::vector<float> engine_steps(const data::Dataset& data, const std::vector<Device>& devices,
                                comm::Comm processes) {
  const Model<LeNet, float> initial(7);
  const std::size_t ranks =
      devices.size() * (processes ? static_cast<std::size_t>(processes.size()) : 1);
  detail::PipelineEngine<LeNet, typename Grid::partition, SGD, SoftmaxCrossEntropy, Stages> engine(
      devices, std::move(processes), initial, sgd, pipeline_grid<Grid>(ranks), {}, Stages{});
  const Targets targets = data::targets_of(data);
  for (std::size_t step = 0; step < 3; ++step) {
    const std::size_t first = step * 60;
    engine.micro_step(data.images.data() + first * data.sample_size(), targets.from(first), 60,
                      60, false, true, {.lr = sgd.lr, .max_grad_norm = 0.5f});
  }
  Model<LeNet, float> whole(0);
  engine.gather(whole);
  return {whole.parameters().begin(), whole.parameters().end()};
}

}  // namespace loom::test
