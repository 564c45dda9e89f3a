// What loom's GPU benchmarks share: kernels timed the way the PyTorch peers
// time theirs (a CUDA event before and after each, no host wait between
// them, after warm-up; the median, and the mean from the first start to the
// last stop); training steps on the grid engine's GPU stages, timed on the
// host (each waits for its work); and the name of the GPU for the JSON
// lines.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <loom/backend/cuda/check.hpp>
#include <loom/core/error.hpp>
#include <loom/gpu/stage.cuh>
#include <loom/loom.hpp>
#include <string>
#include <utility>
#include <vector>

namespace loom::bench {

class TimingEvent {
 public:
  TimingEvent() { LOOM_CUDA_CHECK(cudaEventCreate(&event_)); }
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
  TimingEvent(TimingEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  ~TimingEvent() {
    if (event_ != nullptr) LOOM_CUDA_RELEASE(cudaEventDestroy(event_));
  }
  void record(cudaStream_t stream) { LOOM_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  // Milliseconds from `earlier` to this event; both must have completed.
  double since(const TimingEvent& earlier) const {
    float ms = 0.0f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, earlier.event_, event_));
    return ms;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

struct StepTimes {
  double median_ms = 0.0;
  double mean_ms = 0.0;  // first start to last stop over the steps: gaps included
};

// step(s) enqueues step s on `stream`: s = 0 .. warmup - 1 untimed, then
// `steps` timed ones.
template <class Step>
StepTimes time_gpu_steps(cudaStream_t stream, int warmup, int steps, Step&& step) {
  for (int s = 0; s < warmup; ++s) step(s);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<TimingEvent> starts(static_cast<std::size_t>(steps));
  std::vector<TimingEvent> stops(static_cast<std::size_t>(steps));
  for (int i = 0; i < steps; ++i) {
    starts[i].record(stream);
    step(warmup + i);
    stops[i].record(stream);
  }
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) ms.push_back(stops[i].since(starts[i]));
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  const double median = n % 2 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
  return {median, stops.back().since(starts.front()) / steps};
}

// step(s) runs step s whole, its host waiting for it: s = 0 .. warmup - 1
// untimed, then `steps` timed on the host's steady clock.
template <class Step>
StepTimes time_host_steps(int warmup, int steps, Step&& step) {
  using clock = std::chrono::steady_clock;
  for (int s = 0; s < warmup; ++s) step(s);
  std::vector<double> ms;
  const auto first = clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto start = clock::now();
    step(warmup + i);
    ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - start).count());
  }
  const double total = std::chrono::duration<double, std::milli>(clock::now() - first).count();
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  const double median = n % 2 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
  return {median, total / steps};
}

// One GPU's training steps as the Trainer runs them under Policy
// (SingleDevice; DataParallel<> makes the GPU one replica of its own
// group): the grid engine over gpu::DeviceStages, each step's batch taken
// from host memory, SGD. Every stage call waits for its stream, so a
// step's host time is its time. fp16 scales the loss by a fixed 1024 (the
// trainer's scaler would move it; LeNet's and the MLP's gradients do not
// overflow there).
template <class Net, class Policy = SingleDevice>
class EngineSteps {
 public:
  EngineSteps(SGD::Options sgd, gpu::DeviceStages stages)
      : engine_({devices::gpus().front()}, {}, Model<Net, float>(0), sgd, stages),
        settings_{.lr = sgd.lr,
                  .precision = stages.precision,
                  .loss_scale = stages.precision == Precision::fp16 ? 1024.0f : 1.0f} {}

  // One optimizer step on n samples; a step whose loss is not finite, or
  // which fp16 skipped, voids the figures.
  void step(const float* images, const std::int32_t* labels, std::size_t n) {
    const cpu::LossSums sums = engine_.micro_step(images, labels, n, n, false, true, settings_);
    LOOM_CHECK(std::isfinite(sums.loss) && !sums.overflowed,
               "a timed step's loss went ", loss_text(sums.loss),
               sums.overflowed ? " and its fp16 gradients overflowed" : "",
               ": the update was skipped, so the figures are void");
  }
  // Forwards and backwards captured as CUDA graphs.
  std::size_t graphs() {
    return dynamic_cast<gpu::DeviceStage<Net, SGD>&>(engine_.stage(0)).graphs();
  }

 private:
  ::loom::detail::DataParallelEngine<Net, Policy, SGD, SoftmaxCrossEntropy, gpu::DeviceStages>
      engine_;
  StepSettings settings_;
};

inline std::string gpu_name() {
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  return properties.name;
}

}  // namespace loom::bench
