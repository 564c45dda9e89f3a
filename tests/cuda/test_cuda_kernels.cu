// The op families' GPU tests, one program and one nvcc translation unit.
// Each translation unit pays a fixed cost whatever it holds (cudafe++ and
// cicc over loom's CUDA headers: 35 s on 2 AMD EPYC vCPUs); the six families
// as six units took 200 s to compile, as one 66 s. Each family keeps its file,
// which is a part of this unit, not a program of its own.
#include "test_cuda_ops.cu"
#include "test_cuda_runtime.cu"
#include "test_cuda_gemm.cu"
#include "test_cuda_conv.cu"
#include "test_cuda_recurrent.cu"
#include "test_cuda_layers.cu"

LOOM_CUDA_TEST_MAIN
