// LOOM_HOST_DEVICE marks small helpers that the CPU backend and CUDA kernels
// share, so both backends run the same arithmetic (but for the float
// transcendental functions a helper may pick per side, as TanhFn does).
#pragma once

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif

// LOOM_IVDEP before a loop: its iterations are independent (the caller says
// why), so g++ may vectorise it without proving it; nvcc passes the pragma
// to its host compiler. Not for clang: its equivalent
// (vectorize(assume_safety)) is an order, and clang 14 warns where it
// cannot follow it (a cell loop whose body it did not inline).
#if defined(__GNUC__) && !defined(__clang__)
#define LOOM_IVDEP _Pragma("GCC ivdep")
#else
#define LOOM_IVDEP
#endif
