// Row-major GEMM through OpenBLAS: C = alpha * op(A) * op(B) + beta * C,
// with op(A) m x k and op(B) k x n. float and double (double serves the
// finite-difference gradient checks).
#pragma once

#include <cblas.h>

#include <cstddef>
#include <type_traits>

#include "../../core/meta.hpp"

namespace loom::cpu {

template <class T>
void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, T alpha,
          const T* a, std::size_t lda, const T* b, std::size_t ldb, T beta, T* c, std::size_t ldc) {
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const auto M = static_cast<blasint>(m), N = static_cast<blasint>(n), K = static_cast<blasint>(k);
  const auto LDA = static_cast<blasint>(lda), LDB = static_cast<blasint>(ldb),
             LDC = static_cast<blasint>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
  } else if constexpr (std::is_same_v<T, double>) {
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, a, LDA, b, LDB, beta, c, LDC);
  } else {
    static_assert(dependent_false<T>, "No CPU gemm for this element type; use float or double");
  }
}

}  // namespace loom::cpu
