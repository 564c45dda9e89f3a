// bf16 on the GPU, as the CPU backend emulates it (core/precision.hpp):
// buffers stay fp32, and the values a bf16 network keeps (the weights a
// layer computes with, its outputs, its weight gradients, the gradients it
// passes back) are rounded to bf16 where the CPU rounds them. Operands that
// hold bf16 values lose nothing when a tensor core converts them: GEMMs run
// on bf16 tensor cores (CUBLAS_COMPUTE_32F_FAST_16BF), convolutions on TF32
// ones (a bf16 value is exact in TF32's 10-bit mantissa), both accumulating
// in fp32 as bf16 hardware does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "../../core/precision.hpp"
#include "check.hpp"
#include "launch.hpp"
#include "memory.hpp"

namespace loom::gpu {

namespace kernels {

// The hardware's conversions round to nearest, ties to even, as
// round_to_bf16 and round_to_fp16 do (fp16: infinite beyond 65504, subnormal
// below 2^-14).
template <Precision P>
__global__ void round_values(const float* from, float* to, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    if constexpr (P == Precision::bf16)
      to[i] = __bfloat162float(__float2bfloat16_rn(from[i]));
    else
      to[i] = __half2float(__float2half_rn(from[i]));
  }
}

}  // namespace kernels

// Enqueues to[i] = from[i] rounded to `precision` (from == to rounds in
// place; fp32 copies, or does nothing in place).
inline void round_copy(Precision precision, const float* from, float* to, std::size_t count,
                       cudaStream_t stream) {
  if (count == 0) return;
  if (precision == Precision::fp32) {
    if (from != to) copy_async(to, from, count, cudaMemcpyDeviceToDevice, stream);
    return;
  }
  if (precision == Precision::bf16)
    kernels::round_values<Precision::bf16>
        <<<grid_blocks(count), block_threads, 0, stream>>>(from, to, count);
  else
    kernels::round_values<Precision::fp16>
        <<<grid_blocks(count), block_threads, 0, stream>>>(from, to, count);
  LOOM_CUDA_LAUNCH_CHECK("round_values");
}

inline void round_values(Precision precision, float* values, std::size_t count,
                         cudaStream_t stream) {
  round_copy(precision, values, values, count, stream);
}

}  // namespace loom::gpu
