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

// LOOM_CPU_KERNEL before a hot CPU function of elementwise loops (GELU, a
// norm's rows, a bias epilogue): g++ compiles it for AVX2 and for the
// baseline, and the loader picks AVX2 where the CPU has it (an ifunc), as
// PyTorch picks its CPU kernels by capability. A header-only library is
// built with its user's flags, which for a program meant for any x86-64
// name no more than SSE2: a GPT's GELU, norms and softmax then ran at half
// AVX2's width (benchmarks/RESULTS.md, 2026-12-06, seventh). AVX2 and not
// AVX-512: an AVX-512 clone fuses multiplies and adds (its vector FMA comes
// with AVX512F), which changes the bits, for a few percent of a GPT's step
// at most (the same table). So every clone computes the baseline's bits:
// results do not depend on the CPU, and the tests' -O1 and sanitizer builds
// check the numbers the examples compute (tests/unit/test_cpu_dispatch.cpp
// checks the clones).
// Only where it is needed and works: g++ on x86-64 GNU/Linux (an ifunc
// needs glibc's loader), not under nvcc (its host pass keeps what the CUDA
// program was built for), clang, the sanitizers (a resolver runs before
// their runtime is up), or a build for AVX2 already (-march=native: there
// the clone could not inline the helpers built for the wider target).
// LOOM_NO_CPU_DISPATCH turns it off.
#if defined(__x86_64__) && defined(__gnu_linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__) && !defined(__AVX2__) && !defined(__SANITIZE_ADDRESS__) &&              \
    !defined(__SANITIZE_THREAD__) && !defined(LOOM_NO_CPU_DISPATCH)
#define LOOM_CPU_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define LOOM_CPU_KERNEL
#endif
