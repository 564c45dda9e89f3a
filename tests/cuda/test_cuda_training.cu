// Issue 8 on the GPU: Adam and AdamW, clipping by global norm, and
// checkpoints (save, load, exact resume; across backends) against the CPU
// backend, on real Fashion-MNIST batches, FP32 without TF32 on both sides.
#include <loom/loom.hpp>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cuda_test.hpp"
#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

namespace test = loom::test;
using namespace loom;
using loom::test::fashion;
using loom::test::head;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

struct Record {
  std::vector<StepInfo>* steps;
  void on_step(const StepInfo& step) { steps->push_back(step); }
};

const std::vector<Device>& one_gpu() {
  static const std::vector<Device> gpu{devices::gpus().front()};
  return gpu;
}

// Steps of two trainers on the same data: the same positions, the losses
// to `epsilon` relative.
void same_steps(const std::vector<StepInfo>& got, const std::vector<StepInfo>& want,
                double epsilon) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i);
    REQUIRE(got[i].epoch == want[i].epoch);
    REQUIRE(got[i].step == want[i].step);
    REQUIRE(got[i].samples == want[i].samples);
    REQUIRE(got[i].loss == Approx(want[i].loss).epsilon(epsilon));
  }
}

// The CPU's update of n parameters (clipped by max_norm first, when > 0),
// as the trainer runs it.
void cpu_adam_steps(std::vector<float>& w, std::vector<float> g, std::vector<float>& m,
                    std::vector<float>& v, const AdamW::Options& o, bool decoupled,
                    std::uint64_t t, float max_norm) {
  if (max_norm > 0.0f) {
    double squares = 0.0;
    for (const float x : g) squares += static_cast<double>(x) * static_cast<double>(x);
    clip_gradients(g, std::sqrt(squares), max_norm);
  }
  cpu::adam_update(w.data(), g.data(), m.data(), v.data(), w.size(),
                   {.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps,
                    .weight_decay = o.weight_decay, .decoupled = decoupled, .t = t});
}

}  // namespace

TEST_CASE("cuda optimizers: Adam and AdamW updates, clipped or not, equal the CPU's") {
  constexpr std::size_t n = 100003;  // not a multiple of the block size
  const AdamW::Options o{.lr = 1e-2f, .weight_decay = 0.05f};
  for (const bool decoupled : {false, true}) {
    for (const float max_norm : {0.0f, 1.0f}) {
      INFO((decoupled ? "AdamW" : "Adam") << ", max_norm " << max_norm);
      auto w = test::random_vector<float>(n, 1);
      const auto g = test::random_vector<float>(n, 2);
      std::vector<float> m(n, 0.0f), v(n, 0.0f);
      auto dw = test::to_device(w);
      auto dg = test::to_device(g);
      auto dm = test::to_device(m);
      auto dv = test::to_device(v);
      gpu::DeviceBuffer<gpu::UpdateScalars> scalars(1, "test scalars");
      gpu::DeviceBuffer<double> squares(1, "test norm");
      const std::size_t bytes = gpu::squared_norm_bytes(n);
      gpu::DeviceBuffer<unsigned char> scratch(std::max<std::size_t>(bytes, 1), "test scratch");
      auto device_o = decoupled ? gpu::DeviceOptimizer::from(o)
                                : gpu::DeviceOptimizer::from(Adam::Options{
                                      .lr = o.lr, .weight_decay = o.weight_decay});
      for (std::uint64_t t = 1; t <= 3; ++t) {
        cpu_adam_steps(w, g, m, v, o, decoupled, t, max_norm);
        const auto s = gpu::update_scalars(device_o, o.lr, t, max_norm);
        LOOM_CUDA_CHECK(cudaMemcpy(scalars.data(), &s, sizeof s, cudaMemcpyHostToDevice));
        if (max_norm > 0.0f)
          gpu::squared_norm(dg.data(), n, squares.data(), scratch.data(), bytes, nullptr);
        gpu::optimizer_update(device_o, dw.data(), dg.data(), dm.data(), dv.data(), n,
                              scalars.data(), max_norm > 0.0f ? squares.data() : nullptr,
                              nullptr, nullptr);
      }
      LOOM_CUDA_CHECK(cudaDeviceSynchronize());
      if (max_norm > 0.0f) {
        // The norm of 100003 values in [-1, 1] is far above 1: clipping acted.
        double norm = 0.0;
        for (const float x : g) norm += static_cast<double>(x) * static_cast<double>(x);
        REQUIRE(std::sqrt(norm) > 10.0);
        REQUIRE(test::to_host(squares)[0] == Approx(norm).epsilon(1e-12));
      }
      // The GPU contracts multiply-adds into FMAs: a few ulps apart.
      test::require_close(test::to_host(dw), w, {1e-6, 1e-5}, "weights");
      test::require_close(test::to_host(dm), m, {1e-7, 1e-5}, "exp_avg");
      test::require_close(test::to_host(dv), v, {1e-9, 1e-5}, "exp_avg_sq");
    }
  }
}

TEST_CASE("cuda trainer: AdamW with clipping on a GPU follows the CPU trainer, step by step") {
  const auto part = head(fashion().train, 1000);  // 15 batches of 64, then 40
  const AdamW::Options adamw{.lr = 1e-3f, .weight_decay = 0.01f};
  // Small enough that every step clips.
  const FitOptions fit{.epochs = 2, .batch_size = 64, .seed = 5, .max_grad_norm = 0.5f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet, SingleDevice, AdamW> cpu_trainer(devices::cpu(1), adamw, {.seed = 4});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  Trainer<LeNet, SingleDevice, AdamW> gpu_trainer(one_gpu(), adamw, {.seed = 4});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});
  REQUIRE(gpu_steps.size() == 32);
  same_steps(gpu_steps, cpu_steps, 1e-3);
  // Adam divides each gradient by its own size: one that is near zero, and
  // whose last bits the GPU's sums round otherwise, moves its weight by up
  // to lr a step either way. Hence 1e-3 here rather than SGD's 1e-4.
  test::require_close(gpu_trainer.model().parameters(), cpu_trainer.model().parameters(),
                      {1e-3, 1e-2}, "weights after 2 epochs");
}

TEST_CASE("cuda trainer: SGD with momentum, clipped by global norm on a GPU, follows the CPU") {
  const auto part = head(fashion().train, 640);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 5, .max_grad_norm = 0.25f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet> cpu_trainer(devices::cpu(1), sgd, {.seed = 4});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  Trainer<LeNet> gpu_trainer(one_gpu(), sgd, {.seed = 4});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});
  same_steps(gpu_steps, cpu_steps, 1e-3);
  const auto gpu_weights = gpu_trainer.model().parameters();
  test::require_close(gpu_weights, cpu_trainer.model().parameters(), {1e-4, 1e-2},
                      "weights after an epoch");
  // Clipping acted: the CPU without it ends far from both.
  Trainer<LeNet> unclipped(devices::cpu(1), sgd, {.seed = 4});
  FitOptions plain = fit;
  plain.max_grad_norm = 0.0f;
  unclipped.fit(part, plain);
  const auto other = unclipped.model().parameters();
  double apart = 0.0;
  for (std::size_t i = 0; i < other.size(); ++i)
    apart = std::max(apart, static_cast<double>(std::abs(other[i] - gpu_weights[i])));
  INFO("largest difference to the unclipped run " << apart);
  REQUIRE(apart > 1e-2);
}

TEST_CASE("cuda DataParallel: Adam with weight decay on an NCCL rank follows the CPU") {
  const auto part = head(fashion().train, 640);
  const Adam::Options adam{.lr = 1e-3f, .weight_decay = 1e-3f};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 2, .max_grad_norm = 1.0f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet, SingleDevice, Adam> cpu_trainer(devices::cpu(1), adam, {.seed = 8});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  Trainer<LeNet, DataParallel<>, Adam> gpu_trainer(one_gpu(), adam, {.seed = 8});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});
  same_steps(gpu_steps, cpu_steps, 1e-3);
  // As above: Adam's near-zero gradients.
  test::require_close(gpu_trainer.model().parameters(), cpu_trainer.model().parameters(),
                      {1e-3, 1e-2}, "weights after an epoch");
}

TEST_CASE("cuda trainer: a checkpoint saved on a GPU mid-epoch resumes there as if never stopped") {
  const test::TempDir dir;
  const auto path = dir.file("gpu.safetensors");
  // 640 samples, batches of 32 two to a step: 10 steps an epoch.
  const auto part = head(fashion().train, 640);
  const AdamW::Options adamw{.lr = 2e-3f};
  const FitOptions fit{.epochs = 2, .batch_size = 32, .seed = 9, .accumulation_steps = 2,
                       .max_grad_norm = 1.0f};
  using Schedule = callbacks::LrSchedule<schedules::Warmup<schedules::Cosine>>;
  const Schedule schedule{.schedule = {.steps = 4, .start_factor = 0.3, .after = {}}};
  std::vector<StepInfo> whole_steps;
  Trainer<LeNet, SingleDevice, AdamW> whole(one_gpu(), adamw, {.seed = 3});
  whole.fit(part, fit, schedule, Record{&whole_steps});

  // Checkpoint after step 13, and stop there: the GPU waits at that step
  // rather than running step 14's first batch ahead.
  Trainer<LeNet, SingleDevice, AdamW> first(one_gpu(), adamw, {.seed = 3});
  callbacks::Checkpoint checkpoint({.path = path, .every_steps = 13, .every_epoch = false,
                                    .at_end = false});
  first.fit(part, fit, schedule, checkpoint, test::StopAfter{13});
  REQUIRE(checkpoint.saves == 1);
  REQUIRE(first.steps() == 13);

  std::vector<StepInfo> resumed_steps;
  Trainer<LeNet, SingleDevice, AdamW> second(one_gpu(), adamw, {.seed = 3});
  second.load(path);
  REQUIRE(second.steps() == 13);
  REQUIRE(second.optimizer().steps() == 13);
  REQUIRE(second.position().batches == 6);
  second.fit(part, fit, schedule, Record{&resumed_steps});
  REQUIRE(second.steps() == 20);
  REQUIRE(resumed_steps.size() == 7);
  const std::vector<StepInfo> tail(whole_steps.begin() + 13, whole_steps.end());
  // The resumed epoch's running loss includes the steps before the stop.
  same_steps(resumed_steps, tail, 1e-5);
  test::require_close(second.model().parameters(), whole.model().parameters(), {1e-6, 1e-5},
                      "weights at the end, resumed against uninterrupted");
}

TEST_CASE("cuda trainer: checkpoints move between a GPU and CPU devices and training goes on") {
  const test::TempDir dir;
  const auto part = head(fashion().train, 640);
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f, .nesterov = true};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 1};
  Trainer<LeNet> reference(devices::cpu(1), sgd, {.seed = 2});
  reference.fit(part, fit);

  SECTION("written on the GPU, finished on the CPU") {
    const auto path = dir.file("from_gpu.safetensors");
    Trainer<LeNet> gpu_trainer(one_gpu(), sgd, {.seed = 2});
    gpu_trainer.fit(part, fit, callbacks::Checkpoint({.path = path, .every_steps = 4,
                                                      .every_epoch = false, .at_end = false}),
                    test::StopAfter{4});
    Trainer<LeNet> cpu_trainer(devices::cpu(1), sgd, {.seed = 2});
    cpu_trainer.load(path);
    REQUIRE(cpu_trainer.position().batches == 4);
    // The GPU's momentum came along: without it the weights end elsewhere.
    REQUIRE(!cpu_trainer.optimizer().velocity().empty());
    REQUIRE(std::abs(cpu_trainer.optimizer().velocity()[0]) > 0.0f);
    cpu_trainer.fit(part, fit);
    test::require_close(cpu_trainer.model().parameters(), reference.model().parameters(),
                        {1e-4, 1e-2}, "weights: 4 steps on the GPU, 6 on the CPU");
  }
  SECTION("written on the CPU, finished on the GPU") {
    const auto path = dir.file("from_cpu.safetensors");
    Trainer<LeNet> cpu_trainer(devices::cpu(1), sgd, {.seed = 2});
    cpu_trainer.fit(part, fit, callbacks::Checkpoint({.path = path, .every_steps = 4,
                                                      .every_epoch = false, .at_end = false}),
                    test::StopAfter{4});
    Trainer<LeNet> gpu_trainer(one_gpu(), sgd, {.seed = 2});
    gpu_trainer.load(path);
    gpu_trainer.fit(part, fit);
    REQUIRE(gpu_trainer.steps() == 10);
    test::require_close(gpu_trainer.model().parameters(), reference.model().parameters(),
                        {1e-4, 1e-2}, "weights: 4 steps on the CPU, 6 on the GPU");
  }
}

TEST_CASE("cuda trainer: save() while the GPU runs the next step is a loom::Error saying what to do") {
  const test::TempDir dir;
  const auto part = head(fashion().train, 256);
  struct SaveEveryStep {
    std::string path;
    void on_step(const StepInfo&, Trainer<LeNet>& trainer) { trainer.save(path); }
  };
  struct SaveAtStepBegin {
    std::string path;
    void on_step_begin(const StepBegin& begin, Trainer<LeNet>& trainer) {
      if (begin.step == 3) trainer.save(path);
    }
  };
  Trainer<LeNet> trainer(one_gpu(), {.lr = 0.01f}, {.seed = 1});
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 64},
                                  SaveEveryStep{dir.file("x.safetensors")}),
                      Catch::Contains("the GPU runs a step that fit() has not reported") &&
                          Catch::Contains("needs_state_at_step"));
  // Step 2 ran on the device but was never reported: still refused.
  REQUIRE_THROWS_WITH(trainer.save(dir.file("x.safetensors")),
                      Catch::Contains("has not reported"));
  // Before step 3, step 2 is still unreported.
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 64},
                                  SaveAtStepBegin{dir.file("x.safetensors")}),
                      Catch::Contains("has not reported"));
  REQUIRE(!std::filesystem::exists(dir.file("x.safetensors")));
  // After a fit that ended nothing runs ahead: saving works.
  trainer.fit(part, {.epochs = 1, .batch_size = 64});
  trainer.save(dir.file("y.safetensors"));
  Trainer<LeNet> back(devices::cpu(1), {.lr = 0.01f}, {.seed = 1});
  back.load(dir.file("y.safetensors"));
  test::require_close(back.model().parameters(), trainer.model().parameters(), {0.0, 0.0},
                      "weights through the file");
}

TEST_CASE("cuda ModelSplit: Adam and checkpoints on GPUs are refused, naming what works") {
  const std::vector<Device> two(2, devices::gpus().front());
  REQUIRE_THROWS_WITH((Trainer<LeNet, ModelSplit<Balanced<2>>, AdamW>(two, {.lr = 1e-3f})),
                      Catch::Contains("on GPUs trains with SGD only so far"));
  Trainer<LeNet, ModelSplit<Balanced<2>>> split(two, {.lr = 0.01f});
  const test::TempDir dir;
  REQUIRE_THROWS_WITH(split.save(dir.file("s.safetensors")),
                      Catch::Contains("on GPUs are not supported yet"));
}

LOOM_CUDA_TEST_MAIN
