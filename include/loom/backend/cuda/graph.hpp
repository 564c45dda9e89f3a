// A training step captured once as a CUDA graph and replayed: one launch per
// step instead of one per kernel. The step must be the same sequence of work
// every time (a static network and batch size), which is what loom's
// compile-time networks give; a new key (e.g. a smaller last batch) captures
// a second graph. With capture off, the step runs directly (for debugging).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <utility>

#include "check.hpp"

namespace loom::gpu {

template <class Key = std::size_t>
class StepGraphs {
 public:
  explicit StepGraphs(bool capture = true) : capture_(capture) {}
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;
  ~StepGraphs() {
    for (auto& [key, exec] : graphs_) LOOM_CUDA_RELEASE(cudaGraphExecDestroy(exec));
  }

  // Runs step(stream): captured into a graph the first time `key` is seen,
  // replayed after. step must only enqueue work on `stream` (no host
  // synchronisation, no allocation), as capture requires.
  template <class Step>
  void run(const Key& key, cudaStream_t stream, Step&& step) {
    if (!capture_) {
      step(stream);
      return;
    }
    auto found = graphs_.find(key);
    if (found == graphs_.end()) {
      cudaGraph_t graph = nullptr;
      LOOM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        step(stream);
      } catch (...) {
        // Ends the capture so the stream is usable again; the error is the step's.
        LOOM_CUDA_RELEASE(cudaStreamEndCapture(stream, &graph));
        if (graph != nullptr) LOOM_CUDA_RELEASE(cudaGraphDestroy(graph));
        throw;
      }
      LOOM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
      LOOM_CUDA_RELEASE(cudaGraphDestroy(graph));
      LOOM_CUDA_CHECK(status);
      found = graphs_.emplace(key, exec).first;
    }
    LOOM_CUDA_CHECK(cudaGraphLaunch(found->second, stream));
  }

  bool capturing() const { return capture_; }
  std::size_t graphs() const { return graphs_.size(); }

 private:
  bool capture_;
  std::map<Key, cudaGraphExec_t> graphs_;
};

}  // namespace loom::gpu
