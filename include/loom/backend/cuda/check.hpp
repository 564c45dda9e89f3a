// Status checks for every CUDA runtime, cuBLAS, cuDNN and NCCL call and every
// kernel launch. A failure becomes loom::Error naming the call, the device and
// the library's own words; nothing here exits.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>

#include <cstdio>

#include "../../core/error.hpp"

namespace loom::gpu::detail {

inline int current_device() {
  int device = -1;
  // A failure here is reported by the call being checked; -1 says "unknown".
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  return device;
}

inline bool succeeded(cudaError_t status) { return status == cudaSuccess; }
inline bool succeeded(cublasStatus_t status) { return status == CUBLAS_STATUS_SUCCESS; }
inline bool succeeded(cudnnStatus_t status) { return status == CUDNN_STATUS_SUCCESS; }
inline bool succeeded(ncclResult_t status) { return status == ncclSuccess; }
inline const char* describe(cudaError_t status) { return cudaGetErrorString(status); }
inline const char* describe(cublasStatus_t status) { return cublasGetStatusString(status); }
inline const char* describe(cudnnStatus_t status) { return cudnnGetErrorString(status); }
inline const char* describe(ncclResult_t status) { return ncclGetErrorString(status); }

// For calls that release a resource from a destructor or an unwinding error
// path, where throwing would terminate the program or hide the first error:
// a failure is written to stderr rather than lost.
template <class Status>
void check_release(Status status, const char* call) noexcept {
  if (!succeeded(status))
    std::fprintf(stderr, "loom: %s failed on cuda:%d while releasing a resource: %s\n", call,
                 current_device(), describe(status));
}

}  // namespace loom::gpu::detail

#define LOOM_CUDA_RELEASE(call) ::loom::gpu::detail::check_release((call), #call)

// LOOM_CUDA_CHECK(cudaMemcpyAsync(...)): throws if the call does not return cudaSuccess.
#define LOOM_CUDA_CHECK(call)                                                                    \
  do {                                                                                           \
    const cudaError_t loom_status_ = (call);                                                     \
    if (loom_status_ != cudaSuccess)                                                             \
      LOOM_FAIL("CUDA call ", #call, " failed on cuda:", ::loom::gpu::detail::current_device(), \
                ": ", cudaGetErrorName(loom_status_), " (", cudaGetErrorString(loom_status_),    \
                ")");                                                                            \
  } while (false)

// After every kernel launch: reports bad launch configurations at the launch.
#define LOOM_CUDA_LAUNCH_CHECK(kernel_name)                                                   \
  do {                                                                                        \
    const cudaError_t loom_status_ = cudaGetLastError();                                      \
    if (loom_status_ != cudaSuccess)                                                          \
      LOOM_FAIL("kernel ", kernel_name,                                                       \
                " failed to launch on cuda:", ::loom::gpu::detail::current_device(), ": ",   \
                cudaGetErrorName(loom_status_), " (", cudaGetErrorString(loom_status_), ")"); \
  } while (false)

#define LOOM_CUBLAS_CHECK(call)                                                                    \
  do {                                                                                             \
    const cublasStatus_t loom_status_ = (call);                                                    \
    if (loom_status_ != CUBLAS_STATUS_SUCCESS)                                                     \
      LOOM_FAIL("cuBLAS call ", #call, " failed on cuda:", ::loom::gpu::detail::current_device(), \
                ": ", cublasGetStatusName(loom_status_), " (",                                     \
                cublasGetStatusString(loom_status_), ")");                                         \
  } while (false)

#define LOOM_CUDNN_CHECK(call)                                                                    \
  do {                                                                                            \
    const cudnnStatus_t loom_status_ = (call);                                                    \
    if (loom_status_ != CUDNN_STATUS_SUCCESS)                                                     \
      LOOM_FAIL("cuDNN call ", #call, " failed on cuda:", ::loom::gpu::detail::current_device(), \
                ": ", cudnnGetErrorString(loom_status_));                                         \
  } while (false)

#define LOOM_NCCL_CHECK(call)                                                                    \
  do {                                                                                           \
    const ncclResult_t loom_status_ = (call);                                                    \
    if (loom_status_ != ncclSuccess)                                                             \
      LOOM_FAIL("NCCL call ", #call, " failed on cuda:", ::loom::gpu::detail::current_device(), \
                ": ", ncclGetErrorString(loom_status_));                                         \
  } while (false)
