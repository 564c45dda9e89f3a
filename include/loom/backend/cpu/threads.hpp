// How many threads the CPU backend uses. GEMMs, which hold nearly all of the
// work, run on OpenBLAS's thread pool; the loops around them stay on the
// calling thread. (An OpenMP pool beside OpenBLAS's made LeNet ~10x slower on
// 2 cores: both pools spin-wait and take each other's cores.)
#pragma once

#include <cblas.h>

namespace loom::cpu {

inline void set_threads(int threads) { openblas_set_num_threads(threads); }

}  // namespace loom::cpu
