// A program whose trainers the host compiler builds and whose CUDA side is
// a translation unit of its own (split_program_gpu.cu, nvcc): the host side
// must find the GPUs and the registered trainer's CUDA executor, and refuse
// a GPU to a trainer that was not registered. Runs anywhere: without a
// driver it checks that the CUDA runtime answers (and fails to query), with
// a GPU it trains a few steps there and compares them with the CPU's.
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "split_program.hpp"
// After loom.hpp, which declares data::fashion_mnist.
#include "fashion_test.hpp"

namespace {
int failures = 0;

void check(bool ok, const std::string& what) {
  if (ok) return;
  std::printf("FAILED: %s\n", what.c_str());
  ++failures;
}

// The loom::Error `f` raises ("" when none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const loom::Error& error) {
    return error.what();
  }
  return "";
}
}  // namespace

int main() {
  using namespace loom;
  using split_program::Registered;
  const Device gpu{.kind = Device::Kind::cuda, .index = 0};
  const auto gpus = devices::gpus();

  // The CUDA runtime's answers reach host-compiled code: a GPU's free
  // memory, or (no driver) an error of the query, not of a missing backend.
  const std::string memory = error_of([&] { (void)devices::memory_available(gpu); });
  check(memory.find("needs the CUDA backend") == std::string::npos,
        "memory_available(cuda:0) from host code: " + memory);
  if (gpus.empty())
    check(memory.find("cannot query cuda:0") != std::string::npos,
          "without a GPU the query fails: '" + memory + "'");

  // The registered trainer takes the GPU; the other is refused, naming the way.
  check(error_of([&] { Registered trainer({gpu}, {.lr = 0.05f}); }).empty(),
        "the registered trainer accepts cuda:0");
  const std::string refused =
      error_of([&] { split_program::Unregistered trainer({gpu}, {.lr = 0.05f}); });
  check(refused.find("device cuda:0 needs the CUDA backend") != std::string::npos &&
            refused.find("loom::gpu::register_trainers") != std::string::npos,
        "an unregistered trainer is refused: '" + refused + "'");

  if (!gpus.empty()) {
    // A few steps on the GPU and on the CPU from the same seed: the same
    // evaluation within float rounding (the CUDA tests bound each op).
    const auto train = data::head(loom::test::fashion().train, 2048);
    const auto test = data::head(loom::test::fashion().test, 1000);
    Registered on_gpu({gpus.front()}, {.lr = 0.05f}, {.seed = 3});
    Registered on_cpu(devices::cpu(1), {.lr = 0.05f}, {.seed = 3});
    on_gpu.fit(train, {.epochs = 1, .batch_size = 128, .shuffle = false});
    on_cpu.fit(train, {.epochs = 1, .batch_size = 128, .shuffle = false});
    const auto g = on_gpu.evaluate(test), c = on_cpu.evaluate(test);
    check(std::isfinite(g.loss) && std::abs(g.loss - c.loss) <= 1e-3 * std::abs(c.loss),
          "GPU loss " + std::to_string(g.loss) + " against the CPU's " + std::to_string(c.loss));
  }
  std::printf("split program: %zu GPU(s) visible from host code, %d failure(s)\n", gpus.size(),
              failures);
  return failures == 0 ? 0 : 1;
}
