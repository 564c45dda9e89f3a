// Whole training steps on the GPU against the CPU backend: the same initial
// weights, the same real Fashion-MNIST batches, FP32 without TF32 on both
// sides, the GPU's on the grid engine's stage as the Trainer runs it; graph
// replay against direct launches; the Trainer on a GPU.
#include <loom/loom.hpp>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_test.hpp"
#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "one_device.hpp"

// A namespace of its own: other test files have helpers of the same names
// (each file is a unit of its own, but one program).
namespace cuda_model_tests {

namespace test = loom::test;
using namespace loom;
using loom::test::fashion;
using loom::test::head;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
// Three Linear+ReLU layers in a row, each handing its ReLU mask to the next
// Linear's DRELU_BGRAD epilogue.
using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<200>, ReLU, Linear<130>, ReLU, Linear<64>,
                       ReLU, Linear<10>>;
// A Linear+ReLU with no Linear after it: the separate dReLU kernel and the
// weight GEMM's bias-gradient (BGRADB) epilogue.
using ReluLast = Sequential<Input<1, 28, 28>, Flatten, Linear<96>, ReLU, Linear<10>, ReLU>;
// No ReLU between the input and the loss: a NaN pixel surely makes the loss
// NaN (cuDNN's fused ReLU need not pass NaN on, as loom's own kernels do).
using Logistic = Sequential<Input<1, 28, 28>, Flatten, Linear<10>>;

// The layers of issue 7 on the GPU: a stem with BatchNorm (fused with its
// ReLU), an identity block and a strided block with a 1 x 1 projection,
// global average pooling, Dropout and GELU; a Linear block (its projection a
// Linear) after a BatchNorm1d.
using SmallResNet =
    Sequential<Input<1, 28, 28>, Conv2d<8, 3, 1, 1>, BatchNorm2d, ReLU,
               Residual<Conv2d<8, 3, 1, 1>, BatchNorm2d, ReLU, Conv2d<8, 3, 1, 1>, BatchNorm2d>, ReLU,
               Residual<Conv2d<16, 3, 2, 1>, BatchNorm2d, ReLU, Conv2d<16, 3, 1, 1>, BatchNorm2d>,
               ReLU, GlobalAvgPool, Dropout<0.25>, Linear<30>, BatchNorm1d, GELU,
               Residual<Linear<18>, Tanh>, Linear<10>>;
// Rows of the image as a sequence: a GRU handing every step to an LSTM,
// then Tanh, Sigmoid and a synchronised BatchNorm1d (a plain one off
// DataParallel). Sizes that are not multiples of 4 test the GEMMs'
// alignment inside the saved gate blocks.
using RowRnn = Sequential<Input<1, 28, 28>, Reshape<28, 28>, GRU<30, true>, LSTM<21>, Tanh,
                          SyncBatchNorm1d, Sigmoid, Dropout<0.1>, Linear<10>>;

// Batches of the given sizes taken in order from the training set, trained
// on one CPU and one GPU (the grid engine's stages, as the Trainer's
// SingleDevice runs them) from the same initial weights, each step with the
// same Pass (BatchNorm's batch statistics, Dropout's masks); checks each
// step's loss and returns both models (weights and running statistics)
// after the steps. `slack`: predictions allowed to differ.
template <class Net>
std::pair<Model<Net, float>, Model<Net, float>> train_both(const std::vector<std::size_t>& sizes,
                                                           bool graphs, std::uint64_t seed = 3,
                                                           long slack = 0) {
  const auto& train = fashion().train;
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  const Model<Net, float> initial(seed);
  test::OneCpu<Net> cpu(devices::cpu(1).front(), initial, sgd);
  test::OneGpu<Net> gpu(test::gpu0, initial, sgd, {.graphs = graphs});
  const Targets targets = data::targets_of(train);
  const std::size_t sample = train.sample_size();
  std::size_t first = 0;
  for (std::size_t step = 0; step < sizes.size(); ++step) {
    const std::size_t n = sizes[step];
    INFO("step " << step << " of " << n << " samples");
    const float* images = train.images.data() + first * sample;
    const Pass pass{.seed = seed, .step = step};
    const auto cpu_sums = cpu.train_step(images, targets.from(first), n, pass);
    const auto gpu_sums = gpu.train_step(images, targets.from(first), n, pass);
    first += n;
    // Sums over the batch in another order: the loss to 1e-4 relative.
    REQUIRE(gpu_sums.loss == Approx(cpu_sums.loss).epsilon(1e-4));
    REQUIRE(std::abs(static_cast<long>(gpu_sums.correct) - static_cast<long>(cpu_sums.correct)) <=
            slack);
  }
  return {cpu.model(), gpu.model()};
}

// The same for networks whose layers take a Pass, then their running
// statistics and an evaluation with them. erf, BatchNorm's sums and the
// GEMMs round in another order than the CPU's: a near-tie may flip one
// prediction.
template <class Net>
void contextual_follows_cpu(const std::vector<std::size_t>& sizes, bool graphs) {
  const auto [cpu_model, gpu_model] = train_both<Net>(sizes, graphs, 11, 1);
  test::require_close(gpu_model.parameters(), cpu_model.parameters(), {1e-5, 1e-3},
                      "weights after the steps");
  test::require_close(gpu_model.state(), cpu_model.state(), {1e-5, 1e-4},
                      "running statistics after the steps");

  // Evaluation: the running statistics, no dropout.
  const auto& test_set = fashion().test;
  const std::size_t n = 200;
  test::OneCpu<Net> cpu(devices::cpu(1).front(), cpu_model, {.lr = 0.01f});
  test::OneGpu<Net> gpu(test::gpu0, gpu_model, {.lr = 0.01f}, {.graphs = graphs});
  const auto cpu_eval = cpu.evaluate(test_set.images.data(), test_set.labels.data(), n);
  const auto gpu_eval = gpu.evaluate(test_set.images.data(), test_set.labels.data(), n);
  REQUIRE(gpu_eval.loss == Approx(cpu_eval.loss).epsilon(1e-4));
  REQUIRE(std::abs(static_cast<long>(gpu_eval.correct) - static_cast<long>(cpu_eval.correct)) <= 1);
}

}  // namespace

TEST_CASE("cuda model: BatchNorm, Residual blocks, GlobalAvgPool, Dropout and GELU follow the CPU") {
  contextual_follows_cpu<SmallResNet>({64, 64, 23, 64}, true);
}

TEST_CASE("cuda model: the ResNet blocks launched directly follow the CPU as the graphs do") {
  contextual_follows_cpu<SmallResNet>({32, 17}, false);
}

TEST_CASE("cuda model: GRU, LSTM, Tanh, Sigmoid and BatchNorm1d follow the CPU") {
  contextual_follows_cpu<RowRnn>({64, 64, 9, 64}, true);
}

namespace {

// A speech front end's shape: Conv1d (stride 2) over Frames x Features,
// BatchNorm1d over time fused with its ReLU, Linear per position; the
// softmax over all 12 x 6 outputs stands in for a sequence loss.
using Conv1dSeq = Sequential<Input<24, 10>, Conv1d<12, 5, 2, 2>, BatchNorm1d, ReLU, Linear<6>>;
// The same with a GRU over the convolution's frames: cuDNN's RNN takes the
// lengths from the host, so its steps with lengths run uncaptured.
using Conv1dGru =
    Sequential<Input<24, 10>, Conv1d<12, 5, 2, 2>, BatchNorm1d, ReLU, GRU<9, true>, Linear<6>>;

constexpr std::size_t seq_frames = 24, seq_features = 10, seq_sample = seq_frames * seq_features;

// A batch of n random sequences, NaN in every padded input frame.
std::vector<float> sequences(const std::vector<std::int32_t>& lengths, std::size_t n,
                             std::uint64_t seed) {
  auto x = test::random_vector<float>(n * seq_sample, seed);
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t i = static_cast<std::size_t>(lengths[s]) * seq_features; i < seq_sample; ++i)
      x[s * seq_sample + i] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

// Training steps of Net (Conv1dSeq or Conv1dGru) with the given lengths per
// step (empty: no lengths) on the CPU and the GPU from the same weights;
// then an evaluation with the first step's lengths.
template <class Net>
void sequences_follow_cpu(const std::vector<std::vector<std::int32_t>>& steps,
                          std::size_t batch, bool graphs) {
  constexpr std::size_t classes = Net::output_shape::size;
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  const Model<Net, float> initial(7);
  test::OneCpu<Net> cpu(devices::cpu(1).front(), initial, sgd);
  test::OneGpu<Net> gpu(test::gpu0, initial, sgd, {.graphs = graphs});
  const auto labels_of = [&](std::size_t n, std::uint64_t seed) {
    std::vector<std::int32_t> labels(n);
    for (std::size_t s = 0; s < n; ++s)
      labels[s] = static_cast<std::int32_t>((s * 37 + seed * 11) % classes);
    return labels;
  };
  for (std::size_t step = 0; step < steps.size(); ++step) {
    const auto& lengths = steps[step];
    const std::size_t n = lengths.empty() ? batch : lengths.size();
    const Pass pass{.frames = lengths.empty() ? nullptr : lengths.data()};
    INFO("step " << step << " of " << n << " samples" << (lengths.empty() ? ", no lengths" : ""));
    const auto x = sequences(lengths, n, 100 + step);
    const auto labels = labels_of(n, step);
    const auto cpu_sums = cpu.train_step(x.data(), labels.data(), n, pass);
    const auto gpu_sums = gpu.train_step(x.data(), labels.data(), n, pass);
    // FP32 sums in another order: the loss to 1e-4 relative (a NaN from
    // the padding fails it).
    REQUIRE(gpu_sums.loss == Approx(cpu_sums.loss).epsilon(1e-4));
  }
  const auto cpu_model = cpu.model();
  const auto gpu_model = gpu.model();
  // As the other networks' steps: FP32 rounding carried through a few SGD steps.
  test::require_close(gpu_model.parameters(), cpu_model.parameters(), {1e-5, 1e-3},
                      "weights after the steps");
  test::require_close(gpu_model.state(), cpu_model.state(), {1e-5, 1e-4},
                      "running statistics after the steps");

  const auto& lengths = steps.front();
  const std::size_t n = lengths.size();
  const auto x = sequences(lengths, n, 99);
  const auto labels = labels_of(n, 99);
  const auto cpu_eval = cpu.evaluate(x.data(), labels.data(), n, lengths.data());
  const auto gpu_eval = gpu.evaluate(x.data(), labels.data(), n, lengths.data());
  REQUIRE(gpu_eval.loss == Approx(cpu_eval.loss).epsilon(1e-4));
}

}  // namespace

TEST_CASE(
    "cuda model: Conv1d, BatchNorm1d over time, a GRU and Linear per position follow the CPU "
    "on sequences with lengths") {
  // Three steps of 8 with other lengths (the second captures the graphs
  // of the first's shape, the third replays them, which must read its own
  // lengths), a short batch, a step without lengths.
  const std::vector<std::vector<std::int32_t>> steps{{24, 17, 5, 11, 24, 9, 3, 20},
                                                     {8, 24, 24, 1, 13, 6, 19, 22},
                                                     {2, 21, 16, 24, 4, 10, 24, 7},
                                                     {24, 2, 15, 7, 10},
                                                     {}};
  for (const bool graphs : {true, false}) {
    INFO((graphs ? "graphs" : "direct launches"));
    sequences_follow_cpu<Conv1dSeq>(steps, 8, graphs);
    sequences_follow_cpu<Conv1dGru>(steps, 8, graphs);
  }
}

TEST_CASE("cuda model: lengths a sequence network cannot take are a loom::Error") {
  test::OneGpu<Conv1dSeq> gpu(test::gpu0, Model<Conv1dSeq, float>(1), {.lr = 0.01f});
  const auto x = sequences({}, 2, 5);
  const std::vector<std::int32_t> labels{0, 1};
  const std::vector<std::int32_t> too_long{24, 25};
  REQUIRE_THROWS_WITH(gpu.train_step(x.data(), labels.data(), 2, {.frames = too_long.data()}),
                      Catch::Contains("sample 1 of the batch has length 25, outside 0..24"));
  // Padded by 2 at both ends, 0 frames leave the window of 5 no output frame.
  const std::vector<std::int32_t> empty{24, 0};
  REQUIRE_THROWS_WITH(gpu.train_step(x.data(), labels.data(), 2, {.frames = empty.data()}),
                      Catch::Contains("sample 1 of the batch has 0 frames"));
}

TEST_CASE("cuda model: three LeNet training steps equal the CPU backend's") {
  const auto [cpu, gpu] = train_both<LeNet>({64, 64, 64}, true);
  // After three steps the weights differ by FP32 summation order only.
  test::require_close(gpu.parameters(), cpu.parameters(), {1e-5, 1e-3}, "weights after 3 steps");
}

TEST_CASE("cuda model: batches of several sizes (a short last batch) follow the CPU") {
  const auto [cpu, gpu] = train_both<LeNet>({128, 17, 128, 1}, true);
  test::require_close(gpu.parameters(), cpu.parameters(), {1e-5, 1e-3}, "weights after 4 steps");
}

TEST_CASE("cuda model: Linear+ReLU chains (DRELU_BGRAD epilogues) follow the CPU") {
  const auto [cpu, gpu] = train_both<Mlp>({64, 64, 64, 31}, true);
  test::require_close(gpu.parameters(), cpu.parameters(), {1e-5, 1e-3},
                      "MLP weights after 4 steps");
}

TEST_CASE("cuda model: a Linear+ReLU without a Linear after it follows the CPU") {
  const auto [cpu, gpu] = train_both<ReluLast>({64, 64, 20}, true);
  test::require_close(gpu.parameters(), cpu.parameters(), {1e-5, 1e-3}, "weights after 3 steps");
}

TEST_CASE("cuda model: steps replayed from CUDA graphs equal the steps launched directly") {
  const auto replayed = train_both<LeNet>({64, 64, 40, 64}, true).second;
  const auto direct = train_both<LeNet>({64, 64, 40, 64}, false).second;
  test::require_equal(replayed.parameters(), direct.parameters(),
                      "weights after 4 steps, graphs on and off");
}

TEST_CASE("cuda model: each forward and backward shape runs uncaptured once, is captured next, then "
          "replayed") {
  const auto& train = fashion().train;
  test::OneGpu<LeNet> gpu(test::gpu0, Model<LeNet, float>(1), {.lr = 0.01f});
  auto& stage = dynamic_cast<gpu::DeviceStage<LeNet, SGD>&>(gpu.stage());
  const float* images = train.images.data();
  const std::int32_t* labels = train.labels.data();
  gpu.train_step(images, labels, 32);
  REQUIRE(stage.graphs() == 0);
  // The second step captures its forward and its backward.
  for (int i = 0; i < 2; ++i) gpu.train_step(images, labels, 32);
  REQUIRE(stage.graphs() == 2);
  gpu.train_step(images, labels, 5);
  REQUIRE(stage.graphs() == 2);
  // An evaluation's forward is another shape (no training).
  gpu.evaluate(images, labels, 32);
  gpu.evaluate(images, labels, 32);
  REQUIRE(stage.graphs() == 3);
}

TEST_CASE("cuda trainer: fit on a GPU follows fit on the CPU, step by step") {
  const auto part = head(fashion().train, 1000);  // 15 batches of 64, then 40
  const auto gpu_devices = devices::gpus();
  REQUIRE(!gpu_devices.empty());
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  const FitOptions fit{.epochs = 2, .batch_size = 64, .seed = 5};

  std::vector<StepInfo> cpu_steps, gpu_steps;
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& step) { steps->push_back(step); }
  };
  Trainer<LeNet> cpu_trainer(devices::cpu(1), sgd, {.seed = 4});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  Trainer<LeNet> gpu_trainer({gpu_devices.front()}, sgd, {.seed = 4});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});

  REQUIRE(gpu_steps.size() == cpu_steps.size());
  REQUIRE(gpu_steps.size() == 32);
  for (std::size_t i = 0; i < cpu_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(gpu_steps[i].epoch == cpu_steps[i].epoch);
    REQUIRE(gpu_steps[i].step == cpu_steps[i].step);
    REQUIRE(gpu_steps[i].samples == cpu_steps[i].samples);
    // 32 steps of FP32 drift: 1e-3 relative on the running mean loss.
    REQUIRE(gpu_steps[i].loss == Approx(cpu_steps[i].loss).epsilon(1e-3));
  }
  test::require_close(gpu_trainer.model().parameters(), cpu_trainer.model().parameters(),
                      {1e-4, 1e-2}, "weights after 2 epochs");
  const auto cpu_eval = cpu_trainer.evaluate(fashion().test);
  const auto gpu_eval = gpu_trainer.evaluate(fashion().test, 1000);
  REQUIRE(gpu_eval.samples == 10000);
  REQUIRE(gpu_eval.loss == Approx(cpu_eval.loss).epsilon(1e-3));
  REQUIRE(std::abs(gpu_eval.accuracy - cpu_eval.accuracy) <= 0.002);
}

TEST_CASE("cuda trainer: one epoch of LeNet on a GPU reaches 85% test accuracy") {
  Trainer<LeNet> trainer({devices::all().front()}, {.lr = 0.01f, .momentum = 0.9f}, {.seed = 0});
  REQUIRE(trainer.devices().front().kind == Device::Kind::cuda);
  trainer.fit(fashion().train, {.epochs = 1, .batch_size = 32});
  const auto result = trainer.evaluate(fashion().test);
  INFO("test accuracy " << result.accuracy);
  REQUIRE(result.accuracy >= 0.85);
}

// 256 samples, unshuffled batches of 32, a NaN pixel in sample `poisoned`
// (of step 6): fit on GPU 0 (every device the policy takes) stops at step 6,
// as the CPU's does, with the weights of step 5 (within `tolerance`).
template <class Net, class Policy>
void nan_stops_at_step_6(std::size_t poisoned, test::Tolerance tolerance) {
  auto part = head(fashion().train, 256);
  part.images[poisoned * 784 + 3] = std::numeric_limits<float>::quiet_NaN();
  const FitOptions fit{.epochs = 1, .batch_size = 32, .shuffle = false};
  const std::vector<Device> gpus(std::max<std::size_t>(Policy::devices_needed, 1),
                                 devices::gpus().front());
  Trainer<Net, Policy> trainer(gpus, {.lr = 0.01f}, {.seed = 1});
  REQUIRE_THROWS_WITH(trainer.fit(part, fit), Catch::Contains("the training loss became nan") &&
                                                  Catch::Contains("at epoch 1, step 6"));
  Trainer<Net> reference(devices::cpu(1), {.lr = 0.01f}, {.seed = 1});
  REQUIRE_THROWS_WITH(reference.fit(part, fit), Catch::Contains("at epoch 1, step 6"));
  test::require_close(trainer.model().parameters(), reference.model().parameters(), tolerance,
                      "weights kept after the NaN step");
}

TEST_CASE("cuda trainer: a NaN loss stops fit with the epoch and step, weights kept") {
  nan_stops_at_step_6<Logistic, SingleDevice>(5 * 32, {1e-6, 1e-4});
}

TEST_CASE("cuda trainer: a label outside the classes is the CPU's loom::Error") {
  auto part = head(fashion().test, 100);
  part.labels[42] = 11;
  const auto message = [&](const std::vector<Device>& devices) {
    Trainer<Logistic> trainer(devices, {.lr = 0.01f});
    try {
      trainer.evaluate(part, 64);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string cpu = message(devices::cpu(1));
  REQUIRE_THAT(cpu, Catch::Contains("11"));
  REQUIRE(message({devices::gpus().front()}) == cpu);
}

TEST_CASE("cuda DataParallel: an NCCL rank on one GPU follows single-device training") {
  const std::vector<Device> gpus{devices::gpus().front()};
  const auto part = head(fashion().train, 1000);  // 15 batches of 64, then 40
  const FitOptions fit{.epochs = 2, .batch_size = 64, .seed = 9};
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  Trainer<LeNet> single({gpus.front()}, sgd, {.seed = 4});
  single.fit(part, fit);
  Trainer<LeNet, DataParallel<>> parallel(gpus, sgd, {.seed = 4});
  std::vector<StepInfo> steps;
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  parallel.fit(part, fit, Record{&steps});
  REQUIRE(steps.size() == 32);
  REQUIRE(steps.back().samples == 1000);
  // The same arithmetic: a one-rank all-reduce leaves the gradients as they are.
  test::require_close(parallel.model().parameters(), single.model().parameters(), {1e-7, 1e-6},
                      "weights after 2 epochs");
  const auto a = parallel.evaluate(fashion().test, 500);
  const auto b = single.evaluate(fashion().test);
  REQUIRE(a.samples == 10000);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-4));
  REQUIRE(std::abs(a.accuracy - b.accuracy) <= 0.002);
}

TEST_CASE("cuda DataParallel: a NaN loss halts every rank at the same step") {
  auto part = head(fashion().train, 256);
  part.images[5 * 32 * 784 + 3] = std::numeric_limits<float>::quiet_NaN();  // step 6
  Trainer<Logistic, DataParallel<>> trainer({devices::gpus().front()}, {.lr = 0.01f}, {.seed = 1});
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 32, .shuffle = false}),
                      Catch::Contains("the training loss became nan") &&
                          Catch::Contains("at epoch 1, step 6"));
}

TEST_CASE("cuda trainer: gradient accumulation on a GPU equals one step on the whole batch") {
  const auto part = head(fashion().train, 290);  // 4 steps of 60, then 50 (20 + 20 + 10)
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  const std::vector<Device> gpu{devices::gpus().front()};
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  std::vector<StepInfo> whole_steps;
  Trainer<LeNet> whole(gpu, sgd, {.seed = 6});
  whole.fit(part, {.epochs = 2, .batch_size = 60, .seed = 6}, Record{&whole_steps});
  const FitOptions accumulated{.epochs = 2, .batch_size = 20, .seed = 6, .accumulation_steps = 3};
  const auto check = [&](const auto& trainer, const std::vector<StepInfo>& steps,
                         const std::string& what) {
    REQUIRE(steps.size() == 10);
    for (std::size_t i = 0; i < steps.size(); ++i) {
      INFO(what << ", step " << i);
      REQUIRE(steps[i].step == i % 5 + 1);
      REQUIRE(steps[i].steps == 5);
      REQUIRE(steps[i].samples == std::min<std::size_t>(60 * (i % 5 + 1), 290));
      // Every batch of a step runs on the same weights: the same losses.
      REQUIRE(steps[i].loss == Approx(whole_steps[i].loss).epsilon(1e-4));
      REQUIRE(steps[i].accuracy == Approx(whole_steps[i].accuracy).margin(1e-9));
    }
    test::require_close(trainer.model().parameters(), whole.model().parameters(), {1e-6, 1e-4},
                        what);
  };
  std::vector<StepInfo> steps;
  Trainer<LeNet> single(gpu, sgd, {.seed = 6});
  single.fit(part, accumulated, Record{&steps});
  check(single, steps, "3 x 20 against 60");
  steps.clear();
  Trainer<LeNet, DataParallel<>> parallel(gpu, sgd, {.seed = 6});
  parallel.fit(part, accumulated, Record{&steps});
  check(parallel, steps, "DataParallel, 3 x 20 against 60");
}

// ModelSplit (and Hybrid) with every rank on the one GPU (its own
// streams): the stages' passes, the device-to-device links between them,
// and Hybrid's sums over each stage's copies.
// CpuPolicy: the reference is the same policy on CPU worker devices (a
// pipeline's BatchNorm normalises each micro-batch on its own), else one
// CPU device.
template <class Policy, class Net = LeNet, bool CpuPolicy = false>
void split_follows_cpu(const char* what, PipelineSchedule schedule,
                       FitOptions fit = {.epochs = 2, .batch_size = 60, .seed = 3},
                       std::size_t samples = 490) {
  INFO(what);
  // DataParallel takes any number: one rank here (NCCL refuses two on one GPU).
  const std::vector<Device> gpus(std::max<std::size_t>(1, Policy::devices_needed),
                                 devices::gpus().front());
  const auto part = head(fashion().train, samples);  // by default 8 steps of 60, then 10
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  std::vector<StepInfo> cpu_steps, gpu_steps;
  struct Record {
    std::vector<StepInfo>* steps;
    void on_step(const StepInfo& s) { steps->push_back(s); }
  };
  using Reference = std::conditional_t<CpuPolicy, Trainer<Net, Policy>, Trainer<Net>>;
  Reference cpu_trainer(devices::cpu(CpuPolicy ? gpus.size() : 1), sgd,
                        {.seed = 7, .schedule = schedule});
  cpu_trainer.fit(part, fit, Record{&cpu_steps});
  Trainer<Net, Policy> gpu_trainer(gpus, sgd, {.seed = 7, .schedule = schedule});
  gpu_trainer.fit(part, fit, Record{&gpu_steps});
  REQUIRE(gpu_steps.size() == cpu_steps.size());
  for (std::size_t i = 0; i < cpu_steps.size(); ++i) {
    INFO("step " << i);
    REQUIRE(gpu_steps[i].samples == cpu_steps[i].samples);
    REQUIRE(gpu_steps[i].loss == Approx(cpu_steps[i].loss).epsilon(1e-3));
  }
  test::require_close(gpu_trainer.model().parameters(), cpu_trainer.model().parameters(),
                      {1e-4, 1e-2}, "weights after 2 epochs");
  test::require_close(gpu_trainer.model().state(), cpu_trainer.model().state(), {1e-4, 1e-3},
                      "running statistics after 2 epochs");
  // Evaluated in pieces of the planned batch, forward only through the links.
  const auto a = gpu_trainer.evaluate(fashion().test, 500);
  const auto b = cpu_trainer.evaluate(fashion().test);
  REQUIRE(a.samples == 10000);
  REQUIRE(a.loss == Approx(b.loss).epsilon(1e-3));
  REQUIRE(std::abs(a.accuracy - b.accuracy) <= 0.002);
}

TEST_CASE("cuda ModelSplit: stages sharing one GPU follow single-device training on the CPU") {
  split_follows_cpu<ModelSplit<Balanced<2>, OneFOneB<4>>>("Balanced<2>, 1F1B, 4 micro-batches",
                                                         OneFOneB<4>::schedule);
  split_follows_cpu<ModelSplit<Balanced<2>, OneFOneB<4>>>("Balanced<2>, GPipe, 6 micro-batches",
                                                         {PipelineKind::gpipe, 6});
  // Stage 2 starts with Flatten (its gradient passes through); stage 1
  // ends with a pool whose output the link reads.
  split_follows_cpu<ModelSplit<At<4, 7>, OneFOneB<5>>>("At<4, 7>, 1F1B, 5 micro-batches",
                                                      OneFOneB<5>::schedule);
  // Stage 1 starts with a standalone ReLU after a Linear without its own;
  // in Balanced<2> above, Linear+ReLU feeds Linear within stage 2 (a ReLU
  // mask per micro-batch in flight).
  split_follows_cpu<ModelSplit<At<9>, GPipe<3>>>("At<9>, GPipe, 3 micro-batches",
                                                 GPipe<3>::schedule);
}

TEST_CASE("cuda Hybrid: replicas of pipelines on one GPU follow single-device training on the CPU") {
  split_follows_cpu<Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>>(
      "2 x Balanced<2>, 1F1B, 4 micro-batches", OneFOneB<4>::schedule);
  split_follows_cpu<Hybrid<3, ModelSplit<At<4, 7>, GPipe<3>>>>("3 x At<4, 7>, GPipe, 3 micro-batches",
                                                              GPipe<3>::schedule);
  // One stage: DataParallel's arithmetic, summed over copies by the leader.
  split_follows_cpu<Hybrid<2, ModelSplit<At<>, GPipe<2>>>>("2 x one stage, GPipe, 2 micro-batches",
                                                          GPipe<2>::schedule);
  // Batches of 2 over 3 replicas: replica 2 has no sample in any step.
  split_follows_cpu<Hybrid<3, ModelSplit<At<7>, OneFOneB<2>>>>(
      "3 x At<7>, batches of 2", OneFOneB<2>::schedule, {.epochs = 1, .batch_size = 2, .seed = 5},
      24);
}

TEST_CASE("cuda Hybrid<replicas_from_devices>: R from the GPUs named, the numbers of Hybrid<R>") {
  using Split = ModelSplit<Balanced<2>, OneFOneB<4>>;
  const std::vector<Device> four(4, devices::gpus().front());
  const auto part = head(fashion().train, 250);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  Trainer<LeNet, Hybrid<replicas_from_devices, Split>> any(four, sgd, {.seed = 7});
  Trainer<LeNet, Hybrid<2, Split>> fixed(four, sgd, {.seed = 7});
  REQUIRE(any.placement().back().replica == 1);
  any.fit(part, fit);
  fixed.fit(part, fit);
  // Equal but for cuDNN's choice of algorithms, which each trainer makes.
  test::require_close(any.model().parameters(), fixed.model().parameters(), {1e-5, 1e-3},
                      "replicas_from_devices against Hybrid<2> on 4 ranks of one GPU");
  REQUIRE_THROWS_WITH((Trainer<LeNet, Hybrid<replicas_from_devices, Split>>(
                          std::vector<Device>(3, devices::gpus().front()), sgd)),
                      Catch::Contains("give a multiple of 2, not 3"));
}

TEST_CASE("cuda Hybrid: a NaN loss stops fit at the same step on every replica, weights kept") {
  // Sample 20 of step 6: in replica 1's share.
  nan_stops_at_step_6<LeNet, Hybrid<2, ModelSplit<At<8>, OneFOneB<4>>>>(5 * 32 + 20, {1e-5, 1e-3});
}

TEST_CASE("cuda ModelSplit: a NaN loss stops fit at the same step, every stage keeps its weights") {
  nan_stops_at_step_6<LeNet, ModelSplit<At<8>, OneFOneB<4>>>(5 * 32, {1e-5, 1e-3});
}

TEST_CASE("cuda DataParallel: two ranks sharing a GPU train as two CPU workers do; "
          "SyncBatchNorm there is refused with what to do") {
  const std::vector<Device> two{devices::gpus().front(), devices::gpus().front()};
  const auto part = head(fashion().train, 256);
  const FitOptions fit{.epochs = 1, .batch_size = 64, .seed = 9};
  const SGD::Options sgd{.lr = 0.01f, .momentum = 0.9f};
  // NCCL refuses two ranks on one GPU: their buckets are summed through
  // host memory (comm::HostStagedComm), in LocalComm's order.
  Trainer<LeNet, DataParallel<>> gpu(two, sgd, {.seed = 4});
  gpu.fit(part, fit);
  Trainer<LeNet, DataParallel<>> cpu(devices::cpu(2), sgd, {.seed = 4});
  cpu.fit(part, fit);
  test::require_close(gpu.model().parameters(), cpu.model().parameters(), {1e-5, 1e-3},
                      "weights after 4 steps");
  Trainer<RowRnn, DataParallel<>> synced(two, sgd, {.seed = 4});
  REQUIRE_THROWS_WITH(synced.fit(part, fit),
                      Catch::Contains("SyncBatchNorm sums its statistics over the replicas with "
                                      "NCCL, which needs a GPU per rank"));
}


TEST_CASE("cuda ModelSplit and Hybrid: BatchNorm, Residual, Dropout and GRU/LSTM stages follow the CPU") {
  // Each micro-batch normalises with its own statistics and draws its own
  // masks, on the CPU's pipeline as here; the reference is the CPU pipeline.
  split_follows_cpu<ModelSplit<Balanced<2>, OneFOneB<4>>, SmallResNet, true>(
      "ResNet blocks, Balanced<2>, 1F1B", OneFOneB<4>::schedule);
  split_follows_cpu<Hybrid<2, ModelSplit<Balanced<2>, GPipe<3>>>, RowRnn, true>(
      "GRU/LSTM, 2 x Balanced<2>, GPipe", GPipe<3>::schedule);
}

TEST_CASE("cuda trainer: a ResNet and a GRU/LSTM network fit on a GPU as on the CPU") {
  split_follows_cpu<SingleDevice, SmallResNet>("ResNet blocks, one GPU", {});
  // One NCCL rank: SyncBatchNorm's all-reduce runs and sums one rank.
  split_follows_cpu<DataParallel<>, RowRnn>("GRU/LSTM, DataParallel, one rank", {});
}

}  // namespace cuda_model_tests
