// What every CUDA layer runner is given: the GPU's library handles
// (DeviceContext) and, per forward or backward call, the pointers into the
// owner's arena (LayerCall). DeviceLayers (a grid engine stage's) fills a
// LayerCall for each executed layer; runners never
// allocate in a step (cuDNN's RNN runner allocates its own buffers once,
// when it is made).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../backend/cuda/conv.cuh"
#include "../backend/cuda/gemm.hpp"
#include "../backend/cuda/stream.hpp"
#include "../comm/nccl_comm.hpp"
#include "../core/precision.hpp"

namespace loom::gpu {

struct DeviceContext {
  Stream stream;
  BlasLt blas;
  Dnn dnn;
  DeviceContext() { dnn.set_stream(stream.get()); }
};

// The part of loom::Pass that changes from step to step, kept in device
// memory: a captured step graph reads it at replay, so Dropout draws the
// masks of the step being run without a new capture. The owner writes it
// (enqueued) before each step.
struct DevicePass {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::uint64_t first_sample = 0;  // the first sample's index in the step's global batch
};

// What a layer's GEMMs and convolutions may do with their fp32 operands.
enum class TensorMath {
  fp32,  // FMA math: results match the CPU backend to fp32 rounding
  tf32,  // TF32 tensor cores (operands rounded to a 10-bit mantissa)
  bf16,  // a bf16 network (precision.cuh): GEMMs on bf16 tensor cores, convolutions on TF32 ones
  fp16,  // an fp16 network: GEMMs on fp16 tensor cores, convolutions on TF32 ones
};
inline TensorMath tensor_math(Precision precision, bool allow_tf32) {
  return precision == Precision::bf16   ? TensorMath::bf16
         : precision == Precision::fp16 ? TensorMath::fp16
         : allow_tf32                   ? TensorMath::tf32
                                        : TensorMath::fp32;
}

// TensorParallel's group for the layers it splits (layers/tensor_linear.hpp,
// TensorHeads): the sums and gathers of device memory over the ranks of
// the tensor group, enqueued on the layer's stream. Over NCCL where every
// rank has a GPU of its own; staged through the host's group where ranks
// share one (gpu/stage.cuh).
struct DeviceTensorGroup {
  virtual ~DeviceTensorGroup() = default;
  // `count` floats summed over the group, in place.
  virtual void sum(float* values, std::size_t count, cudaStream_t stream) = 0;
  // Every rank's `count` floats of `mine`, rank r's as the r-th block of `all`.
  virtual void gather(const float* mine, float* all, std::size_t count, cudaStream_t stream) = 0;
  std::size_t rank = 0, size = 1;
};

namespace detail {

// The GEMM options of a product under `math`, its algorithms held to
// `library_limit` bytes of workspace and pointers aligned to `alignment`.
inline GemmOptions gemm_options(TensorMath math, std::size_t library_limit,
                                std::size_t alignment = 16) {
  GemmOptions options;
  options.max_workspace_bytes = std::min(options.max_workspace_bytes, library_limit);
  options.alignment_bytes = alignment;
  options.allow_tf32 = math == TensorMath::tf32;
  options.allow_bf16 = math == TensorMath::bf16;
  options.allow_fp16 = math == TensorMath::fp16;
  return options;
}

// A product whose operands are no layer's input, weights or gradients: TF32
// where the network allows tensor cores, never bf16 or fp16.
inline TensorMath inner_math(TensorMath math) {
  return math == TensorMath::fp32 ? TensorMath::fp32 : TensorMath::tf32;
}

// One GEMM call's pointers, its workspace and stream.
inline GemmArgs gemm_call(const float* a, const float* b, float* c, unsigned char* workspace,
                          std::size_t workspace_bytes, cudaStream_t stream) {
  GemmArgs args;
  args.a = a;
  args.b = b;
  args.c = c;
  args.workspace = workspace;
  args.workspace_bytes = workspace_bytes;
  args.stream = stream;
  return args;
}

// The pointers of one layer's forward or backward call. Backward overwrites
// dweights and dbias (the owner accumulates across micro-batches itself).
struct LayerCall {
  const float* weights = nullptr;  // the layer's weight block (Layer::weight_count)
  const float* bias = nullptr;     // the rest of its parameters (param_count - weight_count)
  const float* x = nullptr;
  float* y = nullptr;
  const float* dy = nullptr;
  float* dx = nullptr;  // null when no gradient is wanted for the input
  float* dweights = nullptr;
  float* dbias = nullptr;
  void* mask = nullptr;                 // this layer's ReLU mask, when it keeps one
  const void* previous_mask = nullptr;  // layer I-1's, when this layer applies its dReLU
  float* previous_dbias = nullptr;      // layer I-1's bias gradient, likewise
  unsigned char* scratch = nullptr;     // shared by every layer, scratch_bytes() at least
  std::size_t scratch_bytes = 0;
  cudaStream_t stream = nullptr;
  // Contextual layers (Layer::contextual):
  bool training = false;               // batch statistics and dropout, or evaluation
  const DevicePass* pass = nullptr;    // device memory
  float* state = nullptr;              // Layer::state_count floats (running statistics)
  float* saved = nullptr;              // n x Layer::saved floats, forward to backward
  // SyncBatchNorm under data parallelism: sums statistics over the ranks
  // (null: this device's batch is the whole batch).
  comm::NcclComm* replicas = nullptr;
  // TensorParallel's group, for the layers it splits (null elsewhere).
  DeviceTensorGroup* tensor = nullptr;
  // What a Residual block rounds its inner layers' outputs and gradients
  // to (the owner rounds its own layers').
  Precision precision = Precision::fp32;
  // Sequences (loom::Pass::frames): each of the n samples' valid frames at
  // this layer's input, in device memory, and the same numbers on the host
  // for libraries that take lengths in a descriptor (cuDNN's RNN). Both null
  // when every sample has all its frames.
  const std::int32_t* frames = nullptr;
  const std::int32_t* host_frames = nullptr;
};

}  // namespace detail
}  // namespace loom::gpu
