// A library to LD_PRELOAD in front of OpenBLAS for benchmarks/pytorch/gpt.py:
// its sgemm_ (the Fortran interface, which PyTorch calls) times each call
// and forwards it to OpenBLAS's, and sgemm_timer_ns() returns the time all
// calls have taken so far. gpt_bench times loom's cblas_sgemm the same
// way, so the two libraries' steps split into time inside sgemm and time
// outside it alike (benchmarks/gpt_vs_pytorch).
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {
std::atomic<std::int64_t> total_ns{0};
}  // namespace

extern "C" std::int64_t sgemm_timer_ns() { return total_ns.load(); }

extern "C" void sgemm_(const char* trans_a, const char* trans_b, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) {
  using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*,
                         const int*);
  // The BLAS behind this library, or, where Python loaded it with its
  // extension (a scope of its own, which RTLD_NEXT does not search), the
  // libblas.so.3 PyTorch links.
  static const auto blas = [] {
    void* next = dlsym(RTLD_NEXT, "sgemm_");
    if (next == nullptr)
      if (void* library = dlopen("libblas.so.3", RTLD_LAZY | RTLD_NOLOAD))
        next = dlsym(library, "sgemm_");
    return reinterpret_cast<Sgemm>(next);
  }();
  if (blas == nullptr) {
    std::fputs("sgemm_timer: no BLAS sgemm_ found behind this library\n", stderr);
    std::abort();
  }
  const auto begin = std::chrono::steady_clock::now();
  blas(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  total_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin)
          .count();
}
