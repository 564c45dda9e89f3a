// A training step allocates nothing: the arena is sized from the memory plan
// up front. Proved by counting every operator new in this executable.
#include <atomic>
#include <cstdlib>
#include <loom/loom.hpp>
#include <new>

#include "loom_test.hpp"

namespace {
std::atomic<std::size_t> allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept {
  return operator new(size, tag);
}
// Every form is replaced, so that sanitizers see malloc/free pairs only.
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

using namespace loom;

TEST_CASE("arena: a LeNet training step (loader, forward, loss, backward, SGD) allocates nothing") {
  using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                           MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
  const auto data = data::fashion_mnist(LOOM_TEST_DATA_DIR);
  Model<LeNet, float> model(0, 64);
  SGD::State<float> sgd({.lr = 0.01f, .momentum = 0.9f}, LeNet::parameter_count);
  data::Loader loader(data.test, {.batch_size = 64, .seed = 3});
  loader.start_epoch(0);
  data::Batch batch;

  auto step = [&] {
    REQUIRE(loader.next(batch));
    const float* logits = model.forward(batch.images, batch.size);
    SoftmaxCrossEntropy::evaluate<float>(logits, batch.labels, batch.size, 10, batch.size,
                                         model.output_gradient());
    model.backward();
    sgd.step(model.parameters(), model.gradients());
  };
  step();  // the first step may touch OpenBLAS's lazily created buffers
  const std::size_t before = allocations.load();
  REQUIRE(before > 0);  // the counter sees loom's allocations (dataset, model, loader)
  for (int i = 0; i < 4; ++i) step();
  const std::size_t during = allocations.load() - before;
  // Catch's REQUIRE inside step() allocates nothing on success.
  REQUIRE(during == 0);
}

namespace {

// Records the allocation counter at every step; its own storage is reserved
// up front so that recording allocates nothing.
struct AllocationProbe {
  std::vector<std::size_t>* counts;
  void on_step(const StepInfo&) { counts->push_back(allocations.load()); }
};

}  // namespace

TEST_CASE("arena: Trainer::fit allocates nothing between one step and the next") {
  using SmallCnn =
      Sequential<Input<1, 28, 28>, Conv2d<4, 5>, ReLU, MaxPool2d<2>, Flatten, Linear<10>>;
  const auto data = data::fashion_mnist(LOOM_TEST_DATA_DIR);
  std::vector<std::size_t> counts;
  counts.reserve(64);
  Trainer<SmallCnn> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  data::Dataset part = data.test;
  part.count = 20 * 32;
  part.images.resize(part.count * part.sample_size());
  part.labels.resize(part.count);
  trainer.fit(part, {.epochs = 1, .batch_size = 32}, AllocationProbe{&counts});
  REQUIRE(counts.size() == 20);
  REQUIRE(counts.back() == counts.front());
}
