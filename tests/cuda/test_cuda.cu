// The GPU tests' program: this unit holds Catch2's implementation and the
// main that reports "skipped" without a GPU; each test_cuda_*.cu beside it
// is an nvcc unit of its own (tests/cuda/CMakeLists.txt says why). ctc.cuh,
// which only test_cuda_ops.cu tests, is included here too, so that every
// CUDA header is in two units at least and the link finds any definition
// a header makes twice.
#define LOOM_CUDA_TEST_RUNNER
#include <loom/backend/cuda/ctc.cuh>

#include "cuda_test.hpp"

LOOM_CUDA_TEST_MAIN
