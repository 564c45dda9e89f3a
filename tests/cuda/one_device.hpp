// Training on one device as the Trainer runs it under SingleDevice: the
// grid engine over one stage of the whole network (gpu::DeviceStages on a
// GPU, detail::HostStages on a CPU), driven a step at a time from batches
// in host memory, so a GPU test holds the GPU's steps against the CPU's
// through the same engine.
#pragma once

#include <loom/gpu/stage.cuh>
#include <loom/loom.hpp>

#include <cstdint>
#include <vector>

namespace loom::test {

inline const Device gpu0{.kind = Device::Kind::cuda, .index = 0};

template <class Net, class Stages, class Optimizer = SGD>
class OneDevice {
 public:
  OneDevice(const Device& device, const Model<Net, float>& initial,
            typename Optimizer::Options options, Stages stages = {},
            Precision precision = Precision::fp32)
      : engine_({device}, {}, initial, options, stages),
        settings_{.lr = options.lr, .precision = precision} {}

  // One optimizer step on the n samples at `images` (host memory).
  cpu::LossSums train_step(const float* images, const Targets& targets, std::size_t n,
                           Pass pass = {}) {
    pass.training = true;
    return engine_.micro_step(images, targets, n, n, false, true, settings_, pass);
  }
  // The loss over n samples in one batch, with the running statistics.
  cpu::LossSums evaluate(const float* images, const std::int32_t* labels, std::size_t n,
                         const std::int32_t* frames = nullptr) {
    data::Dataset set;
    set.count = n;
    set.height = 1;
    set.width = Net::input_shape::size;
    set.images.assign(images, images + n * Net::input_shape::size);
    set.labels.assign(labels, labels + n);
    if (frames != nullptr) set.frames.assign(frames, frames + n);
    return engine_.evaluate(set, n, settings_.precision);
  }
  // The weights and running statistics now.
  Model<Net, float> model() {
    Model<Net, float> whole(0);
    engine_.gather(whole);
    return whole;
  }
  StepSettings& settings() { return settings_; }
  detail::PipelineStage& stage() { return engine_.stage(0); }

 private:
  detail::DataParallelEngine<Net, SingleDevice, Optimizer, SoftmaxCrossEntropy, Stages> engine_;
  StepSettings settings_;
};

template <class Net, class Optimizer = SGD>
using OneGpu = OneDevice<Net, gpu::DeviceStages, Optimizer>;
template <class Net, class Optimizer = SGD>
using OneCpu = OneDevice<Net, detail::HostStages, Optimizer>;

// The weights of a model, as a vector.
template <class Net>
std::vector<float> weights_of(const Model<Net, float>& model) {
  return {model.parameters().begin(), model.parameters().end()};
}

}  // namespace loom::test
