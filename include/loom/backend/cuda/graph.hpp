// A training step captured once as a CUDA graph and replayed: one launch per
// step instead of one per kernel. The step must be the same sequence of work
// every time (a static network and batch size), which is what loom's
// compile-time networks give; a new key (e.g. a smaller last batch) captures
// a graph of its own. With capture off, the step runs directly (for debugging).
//
// Each key's first step runs directly, uncaptured, and only its second is
// captured. What a library sets up on first use may not be legal inside a
// stream capture: cuDNN building its first plan for a convolution, cuBLASLt's
// first call, NCCL setting up its connections lazily, CUDA loading a module
// lazily on a kernel's first launch. The direct run does all of that where
// it is allowed. It is a real step (its results count), so warming up
// changes no number, only which steps replay a graph.
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
    for (auto& [key, exec] : steps_)
      if (exec != nullptr) LOOM_CUDA_RELEASE(cudaGraphExecDestroy(exec));
  }

  // Runs step(stream): directly the first time `key` is seen, captured into
  // a graph (and that launched) the second time, the graph replayed after.
  // step must only enqueue work on `stream` (no host synchronisation, no
  // allocation), as capture requires.
  template <class Step>
  void run(const Key& key, cudaStream_t stream, Step&& step) {
    if (!capture_) {
      step(stream);
      return;
    }
    auto found = steps_.find(key);
    if (found == steps_.end()) {
      step(stream);
      // Only once it has been enqueued: a step that threw is not warmed up.
      steps_.emplace(key, nullptr);
      return;
    }
    if (found->second == nullptr) found->second = capture(stream, step);
    LOOM_CUDA_CHECK(cudaGraphLaunch(found->second, stream));
  }

  // Graphs captured so far (a key seen once has none yet).
  std::size_t graphs() const { return graphs_; }

 private:
  template <class Step>
  cudaGraphExec_t capture(cudaStream_t stream, Step& step) {
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
    graphs_ += 1;
    return exec;
  }

  bool capture_;
  // Each key seen: its graph, or null while it has run only directly.
  std::map<Key, cudaGraphExec_t> steps_;
  std::size_t graphs_ = 0;
};

}  // namespace loom::gpu
