// What every CUDA test file shares: Catch2 with a main that reports "skipped"
// (exit code 77, CTest's SKIP_RETURN_CODE) when no usable GPU is present,
// and helpers to move vectors to and from the device. Of a test program's
// units, the one that holds Catch2's implementation (test_cuda.cu) defines
// LOOM_CUDA_TEST_RUNNER before it includes this and writes
// LOOM_CUDA_TEST_MAIN.
#pragma once

#if defined(LOOM_CUDA_TEST_RUNNER)
#define CATCH_CONFIG_RUNNER
#endif
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <loom/backend/cuda/memory.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

namespace loom::test {

template <class T>
loom::gpu::DeviceBuffer<T> to_device(const std::vector<T>& host) {
  loom::gpu::DeviceBuffer<T> buffer(host.size(), "test input");
  LOOM_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T),
                             cudaMemcpyHostToDevice));
  // cudaMemcpy from pageable memory may return before the data lands, and
  // loom's streams are non-blocking (not ordered after the copy): wait here.
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  return buffer;
}

template <class T>
std::vector<T> to_host(const loom::gpu::DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  LOOM_CUDA_CHECK(cudaMemcpy(host.data(), buffer.data(), host.size() * sizeof(T),
                             cudaMemcpyDeviceToHost));
  return host;
}

#if defined(LOOM_CUDA_TEST_RUNNER)
// Listing the tests (catch_discover_tests, at build time) needs no GPU.
inline int run_or_skip(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing = listing || std::strncmp(argv[i], "--list", 6) == 0;
  int devices = 0;
  const cudaError_t status = listing ? cudaSuccess : cudaGetDeviceCount(&devices);
  if (!listing && (status != cudaSuccess || devices == 0)) {
    std::printf("skipped: no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "none found");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
#endif

}  // namespace loom::test

#if defined(LOOM_CUDA_TEST_RUNNER)
#define LOOM_CUDA_TEST_MAIN \
  int main(int argc, char** argv) { return ::loom::test::run_or_skip(argc, argv); }
#endif
