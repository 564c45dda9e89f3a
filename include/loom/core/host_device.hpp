// LOOM_HOST_DEVICE marks small helpers that the CPU backend and CUDA kernels
// share, so both backends run the very same arithmetic.
#pragma once

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif
