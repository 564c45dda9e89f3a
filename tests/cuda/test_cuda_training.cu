// Issue 8 on the GPU: Adam and AdamW, clipping by global norm, and
// checkpoints (save, load, exact resume; across backends) against the CPU
// backend, on real Fashion-MNIST batches, FP32 without TF32 on both sides;
// bf16 and fp16 on tensor cores against the CPU's emulation of them.
#include <loom/loom.hpp>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test.hpp"
#include "fashion_test.hpp"
#include "garment_sequences.hpp"
#include "loom_test.hpp"
#include "nonfinite_test.hpp"
#include "one_device.hpp"
#include "stop_after.hpp"
#include "temp_dir.hpp"

// A namespace of its own: other test files have helpers of the same names
// (each file is a unit of its own, but one program).
namespace cuda_training_tests {

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

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;
// BatchNorm, a Residual block with an identity shortcut and one with a
// strided 1 x 1 projection, global pooling.
using SmallResNet =
    Sequential<Input<1, 28, 28>, Conv2d<8, 3, 1, 1>, BatchNorm2d, ReLU,
               Residual<Conv2d<8, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<8, 3, 1, 1>, BatchNorm2d>,
               ReLU, Residual<Conv2d<16, 3, 2, 1>, ReLU, Conv2d<16, 3, 1, 1>>, ReLU,
               GlobalAvgPool, Linear<10>>;

std::vector<float> copy_of(std::span<const float> values) { return {values.begin(), values.end()}; }

double l1_distance(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += std::abs(static_cast<double>(a[i]) - b[i]);
  return sum;
}

// A pipeline's `ranks` ranks, all on the first GPU.
std::vector<Device> first_gpu_times(std::size_t ranks) {
  return std::vector<Device>(ranks, devices::gpus().front());
}

// A bf16 or fp16 network trained on a GPU and on CPU devices (and, for
// contrast, in fp32 on CPU devices) from the same seed on the same batches.
// fp16's loss scale takes the same course on both: the same steps skipped.
// A pipeline's `ranks` ranks share the first GPU; the CPU runs CpuPolicy
// on as many devices (BatchNorm normalises each micro-batch: a pipeline's
// statistics are not one device's).
template <class Net, class Policy = SingleDevice, class CpuPolicy = SingleDevice>
void reduced_follows_cpu(Precision precision, std::size_t samples, const SGD::Options& sgd,
                         double loss_epsilon, test::Tolerance weights,
                         const LossScaling& scaling = {}, std::size_t ranks = 1) {
  INFO(precision_name(precision));
  const auto part = head(fashion().train, samples);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  const TrainerOptions options{.seed = 6, .precision = precision, .loss_scaling = scaling};
  std::vector<StepInfo> cpu_steps, gpu_steps, fp32_steps;
  Trainer<Net, CpuPolicy> cpu_reduced(devices::cpu(ranks), sgd, options);
  cpu_reduced.fit(part, fit, Record{&cpu_steps});
  Trainer<Net, CpuPolicy> cpu_fp32(devices::cpu(ranks), sgd, {.seed = 6});
  cpu_fp32.fit(part, fit, Record{&fp32_steps});
  Trainer<Net, Policy> gpu_reduced(first_gpu_times(ranks), sgd, options);
  gpu_reduced.fit(part, fit, Record{&gpu_steps});
  same_steps(gpu_steps, cpu_steps, loss_epsilon);
  for (std::size_t i = 0; i < cpu_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(gpu_steps[i].skipped == cpu_steps[i].skipped);
  }
  REQUIRE(gpu_reduced.loss_scale() == cpu_reduced.loss_scale());
  REQUIRE(gpu_reduced.skipped_steps() == cpu_reduced.skipped_steps());
  const auto gpu = gpu_reduced.model().parameters();
  test::require_close(gpu, cpu_reduced.model().parameters(), weights, "weights after an epoch");
  test::require_close(gpu_reduced.model().state(), cpu_reduced.model().state(), weights,
                      "running statistics after an epoch");
  // The precision is in effect: it changes every gradient a little, while
  // the two backends' roundings part only where a sum lands near a tie, so
  // the GPU is much nearer the CPU's run in its precision than its fp32 one.
  const double to_reduced = l1_distance(gpu, cpu_reduced.model().parameters());
  const double to_fp32 = l1_distance(gpu, cpu_fp32.model().parameters());
  INFO("L1 distance to the CPU's run in that precision " << to_reduced << ", to its fp32 run "
                                                        << to_fp32);
  REQUIRE(to_reduced < 0.5 * to_fp32);
}

// LeNet's first loss gradients (up to 1/64 of a batch of 64) overflow fp16
// at 2^24 and 2^23: steps are skipped until the scale has come down, and it
// grows again after four good steps, to overflow again (unit/test_precision.cpp
// checks that this course skips and grows on the CPU).
constexpr LossScaling overflowing{.initial_scale = 0x1p24f, .growth_interval = 4};

// One step (SGD, lr 1) of a network on 64 real images: the CPU emulation's
// weights against one GPU's in `precision` (fp16 with a loss scale of
// `scale`). Each weight moves by its gradient, w - g, the same float
// operation on both sides; the GPU rounds where the CPU does, so its
// gradients part from the CPU's only where a sum summed in another order
// lands on the other side of a tie.
template <class Net>
void one_step_like_cpu(Precision precision, float scale = 1.0f) {
  INFO(precision_name(precision));
  const auto data = head(fashion().train, 64);
  Model<Net, float> cpu(7);
  cpu.set_precision(precision);
  const float* logits = cpu.forward(data.images.data(), 64, 0, {.training = true});
  SoftmaxCrossEntropy::evaluate<float>(logits, data.labels.data(), 64, 10, 64,
                                       cpu.output_gradient(), scale);
  cpu.backward();
  REQUIRE(unscale_gradients(cpu.gradients(), scale));
  auto want = copy_of(cpu.parameters());
  const auto g = cpu.gradients();
  for (std::size_t i = 0; i < want.size(); ++i) want[i] -= g[i];

  const Model<Net, float> initial(7);
  test::OneGpu<Net> device(test::gpu0, initial, SGD::Options{.lr = 1.0f},
                           {.precision = precision}, precision);
  device.settings().loss_scale = scale;
  device.train_step(data.images.data(), data.labels.data(), 64);
  const Model<Net, float> after = device.model();
  const auto got = after.parameters();
  std::size_t same = 0, moved = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    same += std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want[i]);
    moved += g[i] != 0.0f;
  }
  INFO(same << " of " << want.size() << " weights bit for bit, " << moved << " moved");
  REQUIRE(moved > want.size() / 2);
  REQUIRE(same >= want.size() * 9 / 10);
  // The rest are a rounding step of the gradient apart at most.
  test::require_close(got, want, {1e-4, 1e-2}, "weights after one step");
}

}  // namespace

TEST_CASE("cuda bf16: the rounding kernels round as the CPU's emulation does, bit for bit") {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> values{0.0f,  -0.0f,  1.0f,     1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f,
                            1.0f + 0x1p-11f, 65504.0f, 65519.0f, 65520.0f, -7e4f,
                            0x1p-24f, 0x1p-25f, 3 * 0x1p-25f, 0x1p-130f, -0x1p-140f,
                            std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                            inf, -inf, std::numeric_limits<float>::quiet_NaN()};
  // Every exponent and many mantissas: random bit patterns.
  std::mt19937 bits(42);
  for (int i = 0; i < 200000; ++i) values.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits())));
  const auto source = test::to_device(values);
  for (const Precision p : {Precision::bf16, Precision::fp16}) {
    INFO(precision_name(p));
    gpu::DeviceBuffer<float> rounded(values.size(), "test rounded");
    gpu::round_copy(p, source.data(), rounded.data(), values.size(), nullptr);
    auto in_place = test::to_device(values);
    gpu::round_values(p, in_place.data(), values.size(), nullptr);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = test::to_host(rounded);
    REQUIRE(test::to_host(in_place) == got);
    REQUIRE(test::to_host(source) == values);  // round_copy leaves its source alone
    std::size_t nans = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float want = p == Precision::bf16 ? round_to_bf16(values[i]) : round_to_fp16(values[i]);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got[i]));
        ++nans;
        continue;
      }
      INFO("value " << i << ": " << values[i]);
      REQUIRE(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want));
    }
    REQUIRE(nans > 0);
  }
}

TEST_CASE("cuda bf16: a GEMM on bf16 tensor cores is exact for bf16 operands, up to fp32 sums") {
  // LeNet's fc1 shape: a batch of 64 images' 800 features by 500 outputs.
  constexpr std::size_t m = 64, k = 800, n = 500;
  const auto images = head(fashion().test, 64).images;  // 64 x 784 real pixels
  std::vector<float> a(m * k), b(n * k);
  for (std::size_t i = 0; i < m * k; ++i) a[i] = images[(i / k) * 784 + i % k % 784];
  b = test::random_vector<float>(n * k, 9, -0.05, 0.05);
  std::vector<float> a16 = a, b16 = b;
  round_to(Precision::bf16, a16.data(), a16.size());
  round_to(Precision::bf16, b16.data(), b16.size());
  // The exact products of the bf16 operands, summed in double.
  const auto reference = [&](const std::vector<float>& x, const std::vector<float>& w) {
    std::vector<double> out(m * n);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double sum = 0.0;
        for (std::size_t q = 0; q < k; ++q) sum += static_cast<double>(x[i * k + q]) * w[j * k + q];
        out[i * n + j] = sum;
      }
    return out;
  };
  const auto exact = reference(a16, b16);
  gpu::BlasLt lt;
  gpu::GemmOptions options;
  options.allow_bf16 = true;
  gpu::GemmPlan plan(lt, {.trans_a = false, .trans_b = true, .m = m, .n = n, .k = k, .lda = k,
                          .ldb = k, .ldc = n},
                     gpu::Epilogue::none, options);
  REQUIRE_THAT(plan.describe(), Catch::Contains(", bf16)"));
  gpu::DeviceBuffer<std::byte> workspace(std::max<std::size_t>(plan.workspace_bytes(), 1),
                                         "test workspace");
  const auto run = [&](const std::vector<float>& x, const std::vector<float>& w) {
    const auto dx = test::to_device(x);
    const auto dw = test::to_device(w);
    gpu::DeviceBuffer<float> dc(m * n, "test C");
    plan.run({.a = dx.data(), .b = dw.data(), .c = dc.data(), .workspace = workspace.data(),
              .workspace_bytes = plan.workspace_bytes()});
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    return test::to_host(dc);
  };
  // The sums reach about 4 (|x| <= 2.03, |w| <= 0.05); fp32 sums of 800
  // terms are good to well under 1e-3 there.
  const auto from_bf16 = run(a16, b16);
  double worst = 0.0;
  for (std::size_t i = 0; i < m * n; ++i) worst = std::max(worst, std::abs(from_bf16[i] - exact[i]));
  REQUIRE(worst < 1e-3);
  // fp32 operands are converted to bf16 inside, so the result is far from
  // the fp32 product (the bf16 operands' is 0.0104 away at most on these
  // data, measured on the CPU in double): the tensor cores are bf16's.
  const auto from_fp32 = run(a, b);
  const auto fp32_exact = reference(a, b);
  double converted = 0.0, apart = 0.0;
  for (std::size_t i = 0; i < m * n; ++i) {
    converted = std::max(converted, std::abs(from_fp32[i] - fp32_exact[i]));
    apart = std::max(apart, std::abs(fp32_exact[i] - exact[i]));
  }
  REQUIRE(apart > 5e-3);
  REQUIRE(converted > 10 * worst);
}

TEMPLATE_TEST_CASE("cuda bf16: one step's weight gradients are the CPU emulation's, nearly all "
                   "bit for bit", "", LeNet, Mlp, SmallResNet) {
  one_step_like_cpu<TestType>(Precision::bf16);
}

TEMPLATE_TEST_CASE("cuda fp16: one loss-scaled step's weight gradients are the CPU emulation's, "
                   "nearly all bit for bit", "", LeNet, Mlp, SmallResNet) {
  // 1024: fp16's small gradients are kept, and none overflows.
  one_step_like_cpu<TestType>(Precision::fp16, 1024.0f);
}

TEST_CASE("cuda trainer: bf16 LeNet on a GPU follows the CPU's bf16 emulation") {
  reduced_follows_cpu<LeNet>(Precision::bf16, 640, {.lr = 0.05f, .momentum = 0.9f}, 1e-2,
                             {1e-3, 1e-2});
}

TEST_CASE("cuda trainer: a bf16 MLP under DataParallel on an NCCL rank follows the CPU") {
  reduced_follows_cpu<Mlp, DataParallel<>>(Precision::bf16, 640, {.lr = 0.1f}, 1e-2, {1e-3, 1e-2});
}

TEST_CASE("cuda trainer: a bf16 ResNet (BatchNorm, residual blocks) on a GPU follows the CPU") {
  reduced_follows_cpu<SmallResNet>(Precision::bf16, 640, {.lr = 0.05f, .momentum = 0.9f}, 1e-2,
                                   {2e-3, 2e-2});
}

TEST_CASE("cuda trainer: fp16 LeNet on a GPU skips and scales as the CPU's fp16 emulation") {
  reduced_follows_cpu<LeNet>(Precision::fp16, 1280, {.lr = 0.05f, .momentum = 0.9f}, 1e-2,
                             {1e-3, 1e-2}, overflowing);
}

TEST_CASE("cuda trainer: an fp16 MLP under DataParallel on an NCCL rank follows the CPU") {
  reduced_follows_cpu<Mlp, DataParallel<>>(Precision::fp16, 1280, {.lr = 0.1f}, 1e-2,
                                           {1e-3, 1e-2}, overflowing);
}

TEST_CASE("cuda trainer: an fp16 ResNet's skipped steps keep its running statistics, as on the "
          "CPU") {
  reduced_follows_cpu<SmallResNet>(Precision::fp16, 1280, {.lr = 0.05f, .momentum = 0.9f}, 1e-2,
                                   {2e-3, 2e-2}, overflowing);
}

// parallel/test_nonfinite_policies.cpp's fp16 overflow at the minimum loss
// scale, under a pipeline on GPUs: the same steps skipped, then the error
// naming a gradient as the CPU's pipelines do, and no weight moved.
template <class Policy>
void pipeline_overflow_at_min_scale(std::size_t ranks) {
  const TrainerOptions fp16{
      .seed = 1,
      .precision = Precision::fp16,
      .loss_scaling = {.initial_scale = 0x1p30f, .min_scale = 0x1p28f, .max_scale = 0x1p30f}};
  Trainer<Mlp, Policy> trainer(first_gpu_times(ranks), {.lr = 0.05f, .momentum = 0.9f}, fp16);
  const auto before = copy_of(trainer.model().parameters());
  const auto error =
      test::error_of(trainer, head(fashion().train, 1200), {.epochs = 1, .batch_size = 50});
  REQUIRE_THAT(error, Catch::Contains("the gradients became non-finite at epoch 1, step 3 under "
                                      "a finite loss, even at fp16's minimum loss scale "
                                      "268435456 (LossScaling::min_scale): the gradient of "
                                      "layer ") &&
                          Catch::Contains("; the weights are kept from the step before"));
  REQUIRE(trainer.skipped_steps() == 2);
  test::require_equal(trainer.model().parameters(), before, "weights");
}

TEST_CASE("cuda ModelSplit and Hybrid: fp16 overflowing at its minimum scale names its gradient") {
  pipeline_overflow_at_min_scale<ModelSplit<Balanced<2>, OneFOneB<2>>>(2);
  pipeline_overflow_at_min_scale<Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<2>>>>(4);
}

TEST_CASE("cuda trainer: fp16 overflowing at its minimum scale raises the CPU's error, weights "
          "kept") {
  const test::TempDir dir;
  const auto part = head(fashion().train, 256);
  const TrainerOptions options{
      .seed = 6,
      .precision = Precision::fp16,
      .loss_scaling = {.initial_scale = 0x1p24f, .min_scale = 0x1p24f}};
  const std::string want = "the gradients became non-finite at epoch 1, step 1 under a finite "
                           "loss, even at fp16's minimum loss scale 16777216 "
                           "(LossScaling::min_scale)";
  Trainer<LeNet> cpu(devices::cpu(1), {.lr = 0.05f}, options);
  REQUIRE_THROWS_WITH(cpu.fit(part, {.epochs = 1, .batch_size = 64}), Catch::Contains(want));
  Trainer<LeNet> gpu(one_gpu(), {.lr = 0.05f}, options);
  REQUIRE_THROWS_WITH(gpu.fit(part, {.epochs = 1, .batch_size = 64}),
                      Catch::Contains(want + "; the weights are kept from the step before"));
  REQUIRE(gpu.steps() == 0);
  // The device's weights, through a checkpoint: neither that step nor the
  // one enqueued after it updated them.
  const auto path = dir.file("kept.safetensors");
  gpu.save(path);
  Trainer<LeNet> read(devices::cpu(1), {.lr = 0.05f}, {.seed = 1});
  read.load(path, false);
  const Model<LeNet, float> initial(6);
  test::require_equal(read.model().parameters(), initial.parameters(), "weights after the error");
}

TEST_CASE("cuda trainer: fp16 with AdamW takes only the steps it does not skip, as the CPU") {
  // Adam's update depends on its step number: a skipped step must not count.
  const test::TempDir dir;
  const auto part = head(fashion().train, 1280);
  const AdamW::Options adamw{.lr = 1e-3f};
  const TrainerOptions options{.seed = 6, .precision = Precision::fp16,
                               .loss_scaling = overflowing};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet, SingleDevice, AdamW> cpu(devices::cpu(1), adamw, options);
  cpu.fit(part, fit, Record{&cpu_steps});
  Trainer<LeNet, SingleDevice, AdamW> gpu(one_gpu(), adamw, options);
  gpu.fit(part, fit, Record{&gpu_steps});
  same_steps(gpu_steps, cpu_steps, 1e-2);
  for (std::size_t i = 0; i < cpu_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(gpu_steps[i].skipped == cpu_steps[i].skipped);
  }
  REQUIRE(cpu.skipped_steps() > 0);
  REQUIRE(gpu.skipped_steps() == cpu.skipped_steps());
  gpu.save(dir.file("adamw.safetensors"));  // brings the device's step count to the host
  REQUIRE(cpu.optimizer().steps() == cpu_steps.size() - cpu.skipped_steps());
  REQUIRE(gpu.optimizer().steps() == cpu.optimizer().steps());
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), {2e-3, 2e-2},
                      "weights after an epoch");
}

TEST_CASE("cuda trainer: fp16's loss scale goes into checkpoints and comes back onto a GPU") {
  const test::TempDir dir;
  const auto path = dir.file("fp16.safetensors");
  const auto part = head(fashion().train, 1280);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  const TrainerOptions options{.seed = 6, .precision = Precision::fp16,
                               .loss_scaling = overflowing};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  Trainer<LeNet> first(one_gpu(), sgd, options);
  first.fit(part, fit);
  REQUIRE(first.skipped_steps() > 0);
  first.save(path);
  Trainer<LeNet> on_cpu(devices::cpu(1), sgd, options);
  on_cpu.load(path);
  REQUIRE(on_cpu.loss_scale() == first.loss_scale());
  REQUIRE(on_cpu.skipped_steps() == first.skipped_steps());
  // A second epoch from the checkpoint on a fresh GPU trainer skips the
  // steps the first trainer's second epoch skips, and ends at its scale.
  Trainer<LeNet> second(one_gpu(), sgd, options);
  second.load(path, false);
  REQUIRE(second.loss_scale() == first.loss_scale());
  std::vector<StepInfo> first_steps, second_steps;
  first.fit(part, fit, Record{&first_steps});
  second.fit(part, fit, Record{&second_steps});
  REQUIRE(second_steps.size() == first_steps.size());
  for (std::size_t i = 0; i < first_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(second_steps[i].skipped == first_steps[i].skipped);
  }
  REQUIRE(second.loss_scale() == first.loss_scale());
  REQUIRE(second.skipped_steps() == first.skipped_steps());
  test::require_close(second.model().parameters(), first.model().parameters(), {1e-6, 1e-5},
                      "weights after the second epoch");
}

// Pipelines on GPUs against the CPU's pipelines in the same precision
// (the same stages and micro-batches): LeNet's two stages, a ResNet's
// (running statistics), and an MLP's 2 x 2 grid, whose replicas' fp16
// gradients are summed before they are unscaled.
TEST_CASE("cuda ModelSplit: bf16 LeNet over two stages follows the CPU's bf16 pipeline") {
  using Split = ModelSplit<Balanced<2>, OneFOneB<4>>;
  reduced_follows_cpu<LeNet, Split, Split>(Precision::bf16, 640, {.lr = 0.05f, .momentum = 0.9f},
                                           1e-2, {1e-3, 1e-2}, {}, 2);
}

TEST_CASE("cuda ModelSplit: an fp16 ResNet over two stages skips and scales as the CPU's") {
  using Split = ModelSplit<Balanced<2>, GPipe<2>>;
  reduced_follows_cpu<SmallResNet, Split, Split>(Precision::fp16, 1280,
                                                 {.lr = 0.05f, .momentum = 0.9f}, 1e-2,
                                                 {2e-3, 2e-2}, overflowing, 2);
}

TEST_CASE("cuda Hybrid: an fp16 MLP on a 2 x 2 grid skips and scales as the CPU's") {
  using Grid = Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<2>>>;
  reduced_follows_cpu<Mlp, Grid, Grid>(Precision::fp16, 1280, {.lr = 0.1f}, 1e-2, {1e-3, 1e-2},
                                       overflowing, 4);
}

using SmallCnn = Sequential<Input<1, 28, 28>, Conv2d<4, 5>, ReLU, MaxPool2d<2>, Flatten,
                            Linear<32>, ReLU, Linear<10>>;

namespace {

// Whether `text` says that the step `at` (" at epoch E, step S") went
// non-finite, followed by `rest`: by its loss, as on the CPU, or by its
// gradients under a finite loss, where a library-fused ReLU (cuBLASLt's
// epilogue, cuDNN's fused convolution: gemm.hpp, conv.cuh) turned a NaN
// into 0 on its way to the loss (the NaN still reaches the weight
// gradients: 0 x NaN). Either way the same step is skipped.
bool says_nonfinite_step(const std::string& text, const std::string& at, const std::string& rest) {
  return text.starts_with("the training loss became nan" + at + rest) ||
         text.starts_with("the gradients became non-finite" + at + " under a finite loss" + rest);
}

// A loom::Error's words without its "loom: " prefix.
std::string words_of(const std::string& error) {
  REQUIRE(error.starts_with("loom: "));
  return error.substr(6);
}

}  // namespace

// The faults of parallel/test_nonfinite_policies.cpp under a pipeline on
// GPUs (`ranks` of them; SmallCnn cut as CnnPolicy says, OverflowingNet as
// OverflowingPolicy): the step and the spot one CPU device names, where
// the host can see it (the input batch, the weights, the summed gradients;
// the layers' outputs stay on the GPUs), and the weights of the step
// before on every stage. (A NaN may go through a fused ReLU as 0, so the
// GPU may find the gradients non-finite first: says_nonfinite_step.)
template <class CnnPolicy, class OverflowingPolicy>
void pipeline_faults_like_one_device(std::size_t ranks) {
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  const auto clean = head(fashion().train, 256);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .shuffle = false};
  const auto gpus = first_gpu_times(ranks);
  // The pipeline's error names step `at` and `spot` as one CPU device's does.
  const auto names_like_one_device = [&](auto& pipeline, auto& one, const data::Dataset& data,
                                         const std::string& at, const std::string& spot) {
    const auto error = words_of(test::error_of(pipeline, data, fit));
    INFO(error);
    REQUIRE(says_nonfinite_step(error, at, spot));
    REQUIRE_THAT(test::error_of(one, data, fit),
                 Catch::Contains("the training loss became nan" + at + spot));
  };
  {
    INFO("a NaN pixel in step 2");
    auto bad = clean;
    bad.images[(64 + 37) * 784 + 100] = std::numeric_limits<float>::quiet_NaN();
    Trainer<SmallCnn, CnnPolicy> pipeline(gpus, sgd);
    Trainer<SmallCnn> one(devices::cpu(1), sgd);
    names_like_one_device(pipeline, one, bad, " at epoch 1, step 2",
                          ": the input batch holds nan (sample 37, element 100 of 784); the "
                          "weights are kept from the step before");
    test::require_close(pipeline.model().parameters(), one.model().parameters(), {1e-5, 1e-3},
                        "weights of step 1");
  }
  {
    INFO("the first layer's weights are not finite");
    Trainer<SmallCnn, CnnPolicy> pipeline(gpus, sgd);
    Trainer<SmallCnn> one(devices::cpu(1), sgd);
    for (auto* model : {&pipeline.model(), &one.model()})
      test::set_tensor<SmallCnn>(model->parameters(), "1.conv.bias",
                                 std::numeric_limits<float>::infinity());
    names_like_one_device(pipeline, one, clean, " at epoch 1, step 1",
                          ": layer 1 (conv) holds a weight that is inf (its bias, element 0 of "
                          "4); the weights are kept from the step before");
  }
  {
    INFO("a layer's output overflows: the host cannot see it, the step is skipped all the same");
    Trainer<SmallCnn, CnnPolicy> pipeline(gpus, sgd);
    test::set_tensor<SmallCnn>(pipeline.model().parameters(), "5.linear.weight", 1e37f);
    const auto before = copy_of(std::as_const(pipeline).model().parameters());
    const auto error = test::error_of(pipeline, clean, fit);
    REQUIRE_THAT(error, Catch::StartsWith("loom: the training loss became ") &&
                            Catch::Contains(" at epoch 1, step 1; the weights are kept from the "
                                            "step before"));
    test::require_equal(pipeline.model().parameters(), before, "weights");
  }
  {
    INFO("a gradient overflows under a finite loss");
    Trainer<test::OverflowingNet, OverflowingPolicy> pipeline(gpus, sgd);
    Trainer<test::OverflowingNet> one(devices::cpu(1), sgd);
    test::overflowing_gradient(pipeline.model().parameters());
    test::overflowing_gradient(one.model().parameters());
    const auto before = copy_of(std::as_const(pipeline).model().parameters());
    const auto error = test::error_of(pipeline, test::ones(64), fit);
    REQUIRE_THAT(error, Catch::Contains("the gradients became non-finite at epoch 1, step 1 "
                                        "under a finite loss: the gradient of layer 2 (linear) "
                                        "became inf (its weight, element 0 of 6272)"));
    REQUIRE(error == test::error_of(one, test::ones(64), fit));
    test::require_equal(pipeline.model().parameters(), before, "weights");
  }
}

TEST_CASE("cuda ModelSplit: a non-finite step raises one device's error and keeps the weights") {
  pipeline_faults_like_one_device<ModelSplit<At<4>, OneFOneB<4>>, ModelSplit<At<3>, GPipe<4>>>(2);
}

TEST_CASE("cuda Hybrid: a non-finite step raises one device's error and keeps the weights") {
  pipeline_faults_like_one_device<Hybrid<2, ModelSplit<At<4>, OneFOneB<2>>>,
                                  Hybrid<2, ModelSplit<At<3>, OneFOneB<2>>>>(4);
}

// 256 unshuffled samples in batches of 64, a NaN pixel in step 2: with
// NonFinite::skip the GPU skips the step the CPU skips, and the run goes
// on as the CPU's does (weights, running statistics, the steps' losses).
// A pipeline's `ranks` ranks share the first GPU; the CPU runs CpuPolicy
// (BatchNorm normalises each micro-batch: a pipeline's statistics are not
// one device's).
template <class Net, class Policy, class Optimizer, class CpuPolicy = SingleDevice>
void skips_nan_step_as_cpu(const typename Optimizer::Options& options, test::Tolerance tolerance,
                           std::size_t ranks = 1) {
  auto bad = head(fashion().train, 256);
  bad.images[(64 + 5) * 784 + 100] = std::numeric_limits<float>::quiet_NaN();
  const FitOptions fit{
      .epochs = 1, .batch_size = 64, .shuffle = false, .on_nonfinite = NonFinite::skip};
  Trainer<Net, Policy, Optimizer> gpu(first_gpu_times(ranks), options, {.seed = 2});
  Trainer<Net, CpuPolicy, Optimizer> cpu(devices::cpu(ranks), options, {.seed = 2});
  std::vector<StepInfo> gpu_steps, cpu_steps;
  gpu.fit(bad, fit, Record{&gpu_steps});
  cpu.fit(bad, fit, Record{&cpu_steps});
  REQUIRE(cpu.nonfinite_steps() == 1);
  REQUIRE(gpu.nonfinite_steps() == 1);
  REQUIRE(gpu_steps.size() == 4);
  for (std::size_t i = 0; i < gpu_steps.size(); ++i) {
    INFO("step " << i + 1);
    REQUIRE(gpu_steps[i].skipped == cpu_steps[i].skipped);
  }
  INFO(gpu_steps[1].nonfinite);
  REQUIRE(says_nonfinite_step(gpu_steps[1].nonfinite, " at epoch 1, step 2", ""));
  REQUIRE(std::isnan(gpu_steps[1].step_loss) ==
          gpu_steps[1].nonfinite.starts_with("the training loss"));
  REQUIRE(gpu_steps[2].nonfinite.empty());
  // The skipped step's batch leaves the epoch's mean (its samples count).
  same_steps(gpu_steps, cpu_steps, 1e-4);
  REQUIRE(gpu_steps.back().accuracy == Approx(cpu_steps.back().accuracy).margin(1.0 / 192));
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), tolerance, "weights");
  test::require_close(gpu.model().state(), cpu.model().state(), tolerance, "running statistics");
}

TEST_CASE("cuda trainer: NonFinite::skip skips a NaN step as the CPU does (SGD, one GPU)") {
  skips_nan_step_as_cpu<LeNet, SingleDevice, SGD>({.lr = 0.01f, .momentum = 0.9f}, {1e-5, 1e-3});
}

TEST_CASE("cuda trainer: NonFinite::skip keeps a ResNet's running statistics, as the CPU") {
  skips_nan_step_as_cpu<SmallResNet, SingleDevice, SGD>({.lr = 0.05f, .momentum = 0.9f},
                                                        {2e-5, 2e-3});
}

TEST_CASE("cuda ModelSplit: NonFinite::skip keeps a ResNet's running statistics, as the CPU") {
  using Split = ModelSplit<Balanced<2>, OneFOneB<2>>;
  skips_nan_step_as_cpu<SmallResNet, Split, SGD, Split>({.lr = 0.05f, .momentum = 0.9f},
                                                        {2e-5, 2e-3}, 2);
}

TEST_CASE("cuda Hybrid: NonFinite::skip with AdamW skips as the CPU") {
  using Grid = Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>;
  skips_nan_step_as_cpu<Mlp, Grid, AdamW, Grid>({.lr = 1e-3f, .weight_decay = 0.01f},
                                                {1e-3, 1e-2}, 4);
}

TEST_CASE("cuda DataParallel: NonFinite::skip with AdamW on an NCCL rank skips as the CPU") {
  // Adam's bias corrections count the steps taken: the skipped one must not
  // count. (Adam moves a weight whose gradient is near zero by up to lr
  // either way, whatever its size: hence the tolerance.)
  skips_nan_step_as_cpu<Mlp, DataParallel<>, AdamW>({.lr = 1e-3f, .weight_decay = 0.01f},
                                                    {1e-3, 1e-2});
}

// Gradients that overflow under a finite loss (nonfinite_test.hpp): the
// update is skipped before it is made, as on the CPU.
template <class Policy>
void overflowing_gradients_on_gpu() {
  const std::string expected =
      "the gradients became non-finite at epoch 1, step 1 under a finite loss; the weights are "
      "kept from the step before";
  {
    Trainer<test::OverflowingNet, Policy> trainer(one_gpu(), {.lr = 0.01f});
    test::overflowing_gradient(trainer.model().parameters());
    const auto before = copy_of(trainer.model().parameters());
    REQUIRE_THAT(test::error_of(trainer, test::ones(64), {.batch_size = 64}),
                 Catch::Contains(expected));
    test::require_equal(trainer.model().parameters(), before, "weights after the error");
  }
  {
    Trainer<test::OverflowingNet, Policy> trainer(one_gpu(), {.lr = 0.01f, .momentum = 0.9f});
    test::overflowing_gradient(trainer.model().parameters());
    const auto before = copy_of(trainer.model().parameters());
    std::vector<StepInfo> steps;
    trainer.fit(test::ones(192), {.batch_size = 64, .on_nonfinite = NonFinite::skip},
                Record{&steps});
    REQUIRE(trainer.nonfinite_steps() == 3);
    REQUIRE(steps.size() == 3);
    REQUIRE(steps[2].skipped);
    REQUIRE(steps[2].nonfinite ==
            "the gradients became non-finite at epoch 1, step 3 under a finite loss");
    REQUIRE(std::isfinite(steps[2].step_loss));
    REQUIRE(steps[2].loss == 0.0);  // no step counted
    test::require_equal(trainer.model().parameters(), before, "weights after skipped steps");
  }
}

TEST_CASE("cuda trainer: gradients that overflow under a finite loss raise or are skipped") {
  overflowing_gradients_on_gpu<SingleDevice>();
}

TEST_CASE("cuda DataParallel: gradients that overflow under a finite loss raise or are skipped") {
  overflowing_gradients_on_gpu<DataParallel<>>();
}

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
      auto device_o = decoupled ? gpu::device_optimizer(o)
                                : gpu::device_optimizer(Adam::Options{
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

TEMPLATE_TEST_CASE("cuda trainer: AdamW with clipping on GPUs follows the CPU trainer, step by "
                   "step", "", SingleDevice, ModelSplit<Balanced<2>>) {
  const auto part = head(fashion().train, 1000);  // 15 batches of 64, then 40
  const AdamW::Options adamw{.lr = 1e-3f, .weight_decay = 0.01f};
  // Small enough that every step clips (ModelSplit: the stages' squared
  // norms must be summed).
  const FitOptions fit{.epochs = 2, .batch_size = 64, .seed = 5, .max_grad_norm = 0.5f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet, SingleDevice, AdamW> cpu_trainer(devices::cpu(1), adamw, {.seed = 4});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  // ModelSplit's stages share the one GPU.
  const std::vector<Device> gpus(std::max<std::size_t>(TestType::devices_needed, 1),
                                 devices::gpus().front());
  Trainer<LeNet, TestType, AdamW> gpu_trainer(gpus, adamw, {.seed = 4});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});
  REQUIRE(gpu_steps.size() == 32);
  same_steps(gpu_steps, cpu_steps, 1e-3);
  // Adam divides each gradient by its own size: one that is near zero, and
  // whose last bits the GPU's sums round otherwise, moves its weight by up
  // to lr a step either way. Hence 1e-3 here rather than SGD's 1e-4.
  test::require_close(gpu_trainer.model().parameters(), cpu_trainer.model().parameters(),
                      {1e-3, 1e-2}, "weights after 2 epochs");
}

TEMPLATE_TEST_CASE("cuda trainer: SGD with momentum, clipped by global norm on GPUs, follows "
                   "the CPU", "", SingleDevice, ModelSplit<Balanced<2>>,
                   (Hybrid<2, ModelSplit<Balanced<2>>>)) {
  // ModelSplit and Hybrid: the stages' squared norms (after Hybrid's copies
  // are summed) make one global norm; each stage clipping by its own would
  // end elsewhere. Their stages share the one GPU.
  const auto part = head(fashion().train, 640);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f};
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 5, .max_grad_norm = 0.25f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<LeNet> cpu_trainer(devices::cpu(1), sgd, {.seed = 4});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  const std::vector<Device> gpus(std::max<std::size_t>(TestType::devices_needed, 1),
                                 devices::gpus().front());
  Trainer<LeNet, TestType> gpu_trainer(gpus, sgd, {.seed = 4});
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

TEST_CASE("cuda trainer: evaluate() from a step callback runs and leaves the fit's reports as "
          "they would be") {
  const auto part = head(fashion().train, 512);
  const auto held_out = head(fashion().test, 500);
  struct EvaluateAtStep3 {
    const data::Dataset* data;
    std::vector<StepInfo> steps;
    double accuracy = -1.0;  // the evaluation's, once it ran
    void on_step(const StepInfo& s, Trainer<LeNet>& trainer) {
      steps.push_back(s);
      if (s.step == 3) accuracy = trainer.evaluate(*data).accuracy;
    }
  };
  Trainer<LeNet> evaluating(one_gpu(), {.lr = 0.01f}, {.seed = 1});
  Trainer<LeNet> plain(one_gpu(), {.lr = 0.01f}, {.seed = 1});
  EvaluateAtStep3 with{&held_out, {}};
  struct Steps {
    std::vector<StepInfo> steps;
    void on_step(const StepInfo& s) { steps.push_back(s); }
  } without;
  evaluating.fit(part, {.epochs = 1, .batch_size = 64}, with);
  plain.fit(part, {.epochs = 1, .batch_size = 64}, without);
  REQUIRE(with.accuracy >= 0.0);
  REQUIRE(with.steps.size() == 8);
  // The evaluation's sums stay out of the fit's (cuDNN may pick other
  // algorithms from one trainer to the next: equal to 1e-5).
  same_steps(with.steps, without.steps, 1e-5);
  REQUIRE(evaluating.position().loss_sum ==
          Approx(plain.position().loss_sum).epsilon(1e-5));
}

TEST_CASE("cuda trainer: save() from every step callback writes the step's weights") {
  const test::TempDir dir;
  const auto part = head(fashion().train, 256);
  struct SaveEveryStep {
    std::string path;
    void on_step(const StepInfo&, Trainer<LeNet>& trainer) { trainer.save(path); }
  };
  Trainer<LeNet> trainer(one_gpu(), {.lr = 0.01f}, {.seed = 1});
  trainer.fit(part, {.epochs = 1, .batch_size = 64}, SaveEveryStep{dir.file("x.safetensors")});
  Trainer<LeNet> back(devices::cpu(1), {.lr = 0.01f}, {.seed = 1});
  back.load(dir.file("x.safetensors"));
  test::require_close(back.model().parameters(), trainer.model().parameters(), {0.0, 0.0},
                      "the last step's weights through the file");
}

TEST_CASE("cuda ModelSplit: a checkpoint saved on GPUs mid-epoch resumes on GPUs and on CPU "
          "devices") {
  const test::TempDir dir;
  const auto path = dir.file("split.safetensors");
  const auto part = head(fashion().train, 640);  // 10 steps an epoch
  const AdamW::Options adamw{.lr = 2e-3f};
  const FitOptions fit{.epochs = 2, .batch_size = 64, .seed = 9, .max_grad_norm = 1.0f};
  const std::vector<Device> two(2, devices::gpus().front());
  using Split = Trainer<LeNet, ModelSplit<Balanced<2>>, AdamW>;
  std::vector<StepInfo> whole_steps;
  Split whole(two, adamw, {.seed = 3});
  whole.fit(part, fit, Record{&whole_steps});

  Split first(two, adamw, {.seed = 3});
  callbacks::Checkpoint checkpoint({.path = path, .every_steps = 13, .every_epoch = false,
                                    .at_end = false});
  first.fit(part, fit, checkpoint, test::StopAfter{13});
  REQUIRE(checkpoint.saves == 1);
  REQUIRE(first.optimizer().steps() == 13);  // save() brought the stages' state to the host
  const std::vector<StepInfo> tail(whole_steps.begin() + 13, whole_steps.end());

  // Loaded before its first fit: the stages that fit makes start from it.
  std::vector<StepInfo> gpu_steps;
  Split second(two, adamw, {.seed = 3});
  second.load(path);
  REQUIRE(second.optimizer().steps() == 13);
  second.fit(part, fit, Record{&gpu_steps});
  same_steps(gpu_steps, tail, 1e-5);
  test::require_close(second.model().parameters(), whole.model().parameters(), {1e-6, 1e-5},
                      "weights at the end, resumed on GPUs against uninterrupted");

  // Loaded into stages that have gone on 7 steps past it: their weights,
  // moments and step count go back to step 13's.
  const auto end = copy_of(whole.model().parameters());
  std::vector<StepInfo> again_steps;
  whole.load(path);
  whole.fit(part, fit, Record{&again_steps});
  same_steps(again_steps, tail, 1e-5);
  test::require_close(whole.model().parameters(), end, {1e-6, 1e-5},
                      "weights at the end, resumed into stages that had moved on");

  std::vector<StepInfo> cpu_steps;
  Trainer<LeNet, SingleDevice, AdamW> cpu(devices::cpu(1), adamw, {.seed = 3});
  cpu.load(path);
  cpu.fit(part, fit, Record{&cpu_steps});
  same_steps(cpu_steps, tail, 1e-3);
  // Adam at lr 2e-3: a near-zero gradient's weight may move by up to lr a
  // step either way on the two backends.
  test::require_close(cpu.model().parameters(), end, {2e-3, 2e-2},
                      "weights at the end, resumed on a CPU device");
}

namespace {

// Net split over 2 tensor ranks sharing the first GPU against one CPU
// device, on the same batches: each rank computes its share of every sum
// one device computes whole, so they agree to fp32 rounding.
template <class Net>
void tensor_follows_cpu() {
  const auto part = head(fashion().train, 640);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 3};
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<Net> cpu(devices::cpu(1), sgd, {.seed = 6});
  cpu.fit(part, fit, Record{&cpu_steps});
  Trainer<Net, TensorParallel<2>> gpu(first_gpu_times(2), sgd, {.seed = 6});
  gpu.fit(part, fit, Record{&gpu_steps});
  REQUIRE(gpu_steps.size() == 10);
  same_steps(gpu_steps, cpu_steps, 1e-4);
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), {1e-5, 1e-3},
                      "weights after an epoch");
}

}  // namespace

TEST_CASE("cuda TensorParallel: ReLU MLPs and LeNet over 2 tensor ranks follow one CPU device") {
  // The column-parallel Linear's ReLU runs in its GEMM's epilogue and its
  // derivative before the weight GEMM; the row-parallel one adds its bias
  // (and ReLU) after the ranks' sum. The deeper MLP's last Linear follows
  // a row-parallel one: its scores are gathered (TensorGather).
  using DeepMlp =
      Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<32>, ReLU, Linear<10>>;
  tensor_follows_cpu<Mlp>();
  tensor_follows_cpu<DeepMlp>();
  tensor_follows_cpu<LeNet>();
}

namespace {

// The speech example's layers, small: a Conv1d halving the frames, BatchNorm
// over the valid frames, a bidirectional GRU on cuDNN and a Linear per frame,
// into CTC.
using GarmentReader =
    Sequential<Input<56, 28>, Conv1d<16, 5, 2, 2>, BatchNorm1d, ReLU, BiGRU<12>, Linear<11>>;

// CTCLoss over garment sequences of 56 and 28 frames (real data, the short
// ones padded), trained by the Trainer under Policy on `ranks` ranks sharing
// the GPU and on as many CPU workers: the same grouping of samples, so the
// same batch statistics. The loss runs on the host from the output copied
// back; the lengths reach every layer on the device.
template <class Policy>
void ctc_follows_cpu(const char* what, std::size_t ranks) {
  INFO(what);
  static const data::Dataset sequences = test::garment_sequences(fashion().train, 96);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  const FitOptions fit{.epochs = 2, .batch_size = 32, .seed = 3};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  Trainer<GarmentReader, Policy, SGD, CTCLoss> cpu(devices::cpu(ranks), sgd, {.seed = 11});
  cpu.fit(sequences, fit, Record{&cpu_steps});
  Trainer<GarmentReader, Policy, SGD, CTCLoss> gpu(std::vector<Device>(ranks, one_gpu().front()),
                                                   sgd, {.seed = 11});
  gpu.fit(sequences, fit, Record{&gpu_steps});
  REQUIRE(cpu_steps.size() == 6);
  same_steps(gpu_steps, cpu_steps, 1e-4);
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), {1e-5, 1e-3},
                      "weights after 6 steps");
  test::require_close(gpu.model().state(), cpu.model().state(), {1e-5, 1e-4},
                      "running statistics after 6 steps");
  const EvalResult a = gpu.evaluate(sequences, 48), b = cpu.evaluate(sequences, 48);
  REQUIRE(a.samples == 96);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-4));
}

}  // namespace

TEST_CASE(
    "cuda trainer: CTCLoss over sequences of two lengths trains a speech reader's layers "
    "as on CPU devices") {
  ctc_follows_cpu<SingleDevice>("one GPU", 1);
  ctc_follows_cpu<ModelSplit<Balanced<2>, OneFOneB<4>>>("2 stages sharing a GPU", 2);
}

}  // namespace cuda_training_tests
