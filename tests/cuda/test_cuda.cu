// Every GPU test, one program and one nvcc translation unit. Each
// translation unit pays a fixed cost whatever it holds (cudafe++ and cicc
// over loom's CUDA headers: 35 s on 2 AMD EPYC vCPUs); the six op families
// as six units took 200 s to compile, as one 66 s; with the whole-model,
// training and stage tests as three more units, the four took 358 s (host
// code at -O0, as CI builds it without a GPU), and as one unit take 192 s.
// Each family keeps its file, which is a part of this unit, not a program
// of its own; the files that say `using namespace loom` come last, each in
// a namespace of its own, because the CUDA headers define a ::cuda
// namespace too.
#include "test_cuda_ops.cu"
#include "test_cuda_runtime.cu"
#include "test_cuda_gemm.cu"
#include "test_cuda_conv.cu"
#include "test_cuda_recurrent.cu"
#include "test_cuda_layers.cu"
#include "test_cuda_model.cu"
#include "test_cuda_training.cu"
#include "test_cuda_stage.cu"
#include "test_cuda_transformer.cu"

LOOM_CUDA_TEST_MAIN
