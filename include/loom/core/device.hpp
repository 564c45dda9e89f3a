// Devices a network runs on. A CPU device is a worker with its own thread
// budget; a CUDA device is one GPU, in a program with a translation unit nvcc compiles.
#pragma once

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "error.hpp"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace loom {

struct Device {
  enum class Kind { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;
  // Threads this device may use for BLAS and elementwise loops. Worker
  // devices split the machine's cores so that several do not oversubscribe it.
  int threads = 1;

  std::string name() const {
    return (kind == Kind::cpu ? "cpu:" : "cuda:") + std::to_string(index);
  }
};

// What a policy needs to know of a device: its kind, its index among its
// kind, the threads it may use, and a name for messages.
template <class D>
concept DeviceDescription = requires(const D& d) {
  { d.kind } -> std::convertible_to<Device::Kind>;
  { d.index } -> std::convertible_to<int>;
  { d.threads } -> std::convertible_to<int>;
  { d.name() } -> std::convertible_to<std::string>;
};
static_assert(DeviceDescription<Device>);

namespace devices {

// The cores loom's CPU work may use: those this process may run on (its
// affinity: taskset, a container's cpuset, mpirun's binding), and no more
// than OPENBLAS_NUM_THREADS when that is set, since the work runs on
// OpenBLAS's threads. Without the limit, a program run beside others (a
// test runner's parallel jobs, several ranks on one node) would set
// OpenBLAS back to every core and oversubscribe them: on 2 cores a GRU's
// per-step GEMMs then ran 14 times slower than alone.
inline int hardware_threads() {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) n = CPU_COUNT(&allowed);
  if (const char* limit = std::getenv("OPENBLAS_NUM_THREADS")) {
    int value = 0;
    const char* end = limit + std::strlen(limit);
    const auto [at, error] = std::from_chars(limit, end, value);
    if (error == std::errc{} && at == end && value > 0) n = std::min(n, value);
  }
  return std::max(n, 1);
}

// n CPU worker devices sharing the machine's cores evenly (at least one each).
inline std::vector<Device> cpu(int n = 1) {
  LOOM_CHECK(n >= 1, "devices::cpu(", n, "): need at least one device");
  const int threads = hardware_threads() / n > 0 ? hardware_threads() / n : 1;
  std::vector<Device> list;
  for (int i = 0; i < n; ++i) list.push_back(Device{Device::Kind::cpu, i, threads});
  return list;
}

}  // namespace devices

namespace detail {
// The CUDA runtime's answers, set by every translation unit nvcc compiles
// (below), so that code the host compiler built finds the GPUs as well, in
// a program that links a CUDA translation unit. Unset: no CUDA in the program.
struct CudaRuntime {
  int (*device_count)() = nullptr;  // 0 without a driver (a build machine)
  bool (*free_memory)(int, std::size_t&) = nullptr;
};
inline constinit CudaRuntime cuda_runtime{};
}  // namespace detail

namespace devices {

// The GPUs present, in a program with a translation unit nvcc compiled;
// none otherwise, and none where the driver is missing (a build machine),
// which is not an error.
inline std::vector<Device> gpus() {
  std::vector<Device> list;
  const int count = detail::cuda_runtime.device_count ? detail::cuda_runtime.device_count() : 0;
  for (int i = 0; i < count; ++i) list.push_back(Device{Device::Kind::cuda, i, 1});
  return list;
}

// Bytes a device can give a model now: a GPU's free memory, or the
// machine's available memory (/proc/meminfo's MemAvailable) for a CPU
// device, which its workers share.
inline std::size_t memory_available(const Device& device) {
  if (device.kind == Device::Kind::cuda) {
    LOOM_CHECK(detail::cuda_runtime.free_memory != nullptr, "devices::memory_available: ",
               device.name(), " needs the CUDA backend (a translation unit nvcc compiles)");
    std::size_t free = 0;
    LOOM_CHECK(detail::cuda_runtime.free_memory(device.index, free),
               "devices::memory_available: cannot query ", device.name());
    return free;
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  std::size_t available = 0;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") available = kib * 1024;
  LOOM_CHECK(available > 0, "devices::memory_available: /proc/meminfo has no MemAvailable line");
  // In a container the cgroup's limit is what counts (v2: memory.max less
  // memory.current; "max" means none).
  std::ifstream limit_file("/sys/fs/cgroup/memory.max"), used_file("/sys/fs/cgroup/memory.current");
  std::string limit;
  std::size_t used = 0;
  if (limit_file >> limit && limit != "max" && used_file >> used) {
    const std::size_t cap = std::stoull(limit);
    available = std::min(available, cap > used ? cap - used : 0);
  }
  return available;
}

// Every device the trainer can use: the GPUs when compiled by nvcc and any
// is present, else one CPU device with all cores.
inline std::vector<Device> all() {
  std::vector<Device> list = gpus();
  return list.empty() ? cpu(1) : list;
}

}  // namespace devices

#if defined(__CUDACC__)
namespace detail {
inline int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // leaves no error behind for the next checked call
    return 0;
  }
  return count;
}
inline bool cuda_free_memory(int index, std::size_t& free) {
  std::size_t total = 0;
  int previous = 0;
  return cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(index) == cudaSuccess &&
         cudaMemGetInfo(&free, &total) == cudaSuccess && cudaSetDevice(previous) == cudaSuccess;
}
// Set before main() by each translation unit nvcc compiles (one is enough).
inline const bool cuda_runtime_set =
    (cuda_runtime = {.device_count = &cuda_device_count, .free_memory = &cuda_free_memory}, true);
}  // namespace detail
#endif

}  // namespace loom
