// What loom's GPU benchmarks share: steps timed the way the PyTorch peers
// time theirs (a CUDA event before and after each step, no host wait between
// steps, after warm-up; the median step, and the mean from the first start
// to the last stop), and the name of the GPU for the JSON lines.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <loom/backend/cuda/check.hpp>
#include <loom/core/error.hpp>
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

// A timed run whose loss went non-finite skipped its updates: its figures
// would not be a training step's. (Model: a gpu::DeviceModel.)
template <class Model>
void require_trained(Model& model, const char* what) {
  const auto totals = model.wait_totals(0);
  LOOM_CHECK(totals.halted == 0, what, ": the loss stopped being finite (", loss_text(totals.halt_loss),
             ") during the timed steps, so later updates were skipped; the figures are void");
}

inline std::string gpu_name() {
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  return properties.name;
}

}  // namespace loom::bench
