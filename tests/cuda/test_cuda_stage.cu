// The grid engine's GPU stage (gpu/stage.cuh) against the CPU's: LeNet's
// DeviceStage and StageOf made from one Model take one micro-batch of
// Fashion-MNIST through forward, loss, backward and an SGD update, FP32
// without TF32 on both; and HostStagedComm moves device buffers over a
// LocalComm of two ranks exactly; Hybrid 2 x 2 on the grid engine with
// DeviceStages against the CPU's stages; and the clipping squares a stage
// sums per layer on its GPU against the host's sums of its gradients.
#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <loom/comm/staged_comm.hpp>
#include <loom/gpu/stage.cuh>
#include <loom/loom.hpp>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_test.hpp"
#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "tiny_gpt.hpp"

// A namespace of its own: other test files have helpers of the same names
// (each file is a unit of its own, but one program).
namespace cuda_stage_tests {

namespace test = loom::test;
using namespace loom;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
using Buffer = detail::PipelineStage::Buffer;

// Per value: within 1e-4 of the reference, relative to it or (near zero)
// to the largest reference value.
void require_close_relative(const std::vector<float>& got, const std::vector<float>& ref,
                            const char* what) {
  float largest = 0.0f;
  for (const float r : ref) largest = std::max(largest, std::abs(r));
  test::require_close(got, ref, {1e-4 * largest, 1e-4}, what);
}

// Three clipped steps of Grid on its engine, its stages made by `Stages`
// on `devices`; the whole network's weights after them and an
// evaluation's sums.
template <class Grid, class Stages>
std::pair<std::vector<float>, cpu::LossSums> engine_steps(const data::Dataset& data,
                                                          const std::vector<Device>& devices) {
  const Model<LeNet, float> initial(7);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  detail::PipelineEngine<LeNet, typename Grid::partition, SGD, SoftmaxCrossEntropy, Stages> engine(
      devices, {}, initial, sgd, pipeline_grid<Grid>(Grid::devices_needed), {}, Stages{});
  const Targets targets = data::targets_of(data);
  for (std::size_t step = 0; step < 3; ++step) {
    const std::size_t first = step * 60;
    engine.micro_step(data.images.data() + first * data.sample_size(), targets.from(first), 60, 60,
                      false, true, {.lr = sgd.lr, .max_grad_norm = 0.5f});
  }
  Model<LeNet, float> whole(0);
  engine.gather(whole);
  const cpu::LossSums sums = engine.evaluate(data, 60, Precision::fp32);
  return {{whole.parameters().begin(), whole.parameters().end()}, sums};
}

}  // namespace

TEST_CASE("cuda stage: Hybrid 2 x 2 of DeviceStages on one GPU trains as on CPU workers") {
  // Four ranks on one GPU: their links are the host's groups staged through
  // host memory; the stages' copies all-reduce buckets of device memory.
  using Grid = Hybrid<2, ModelSplit<Balanced<2>, OneFOneB<4>>>;
  const auto part = test::head(test::fashion().train, 180);
  const std::vector<Device> gpus(4, Device{.kind = Device::Kind::cuda, .index = 0});
  const auto [gpu_weights, gpu_sums] = engine_steps<Grid, gpu::DeviceStages>(part, gpus);
  const auto [cpu_weights, cpu_sums] =
      engine_steps<Grid, detail::HostStages>(part, devices::cpu(4));
  require_close_relative(gpu_weights, cpu_weights, "weights after three steps");
  const Model<LeNet, float> initial(7);
  CHECK(cpu_weights !=
        std::vector<float>(initial.parameters().begin(), initial.parameters().end()));
  CHECK(gpu_sums.correct == cpu_sums.correct);
  CHECK(std::abs(gpu_sums.loss - cpu_sums.loss) <= 1e-4 * std::abs(cpu_sums.loss));
}

TEST_CASE("cuda stage: LeNet's DeviceStage steps one micro-batch as the CPU's StageOf does") {
  constexpr std::size_t n = 32;
  const auto& train = test::fashion().train;
  const Model<LeNet, float> initial(3);
  const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
  auto cpu = detail::make_stage_of<LeNet, SGD, LeNet>(initial, sgd, default_bucket_bytes, Device{});
  auto gpu = detail::make_stage_of<LeNet, SGD, LeNet, gpu::DeviceStages>(
      initial, sgd, default_bucket_bytes, Device{.kind = Device::Kind::cuda, .index = 0},
      Model<LeNet>::all_layers, gpu::DeviceStages{});
  const auto& ops = detail::loss_ops<SoftmaxCrossEntropy, LeNet::output_shape>();
  const Pass pass{.training = true, .seed = 7};
  const Targets targets(train.labels.data());

  std::array<cpu::LossSums, 2> sums;
  std::vector<std::size_t> done_order;
  for (std::size_t k = 0; k < 2; ++k) {
    detail::PipelineStage& stage = k == 0 ? *cpu : *gpu;
    stage.reserve(n, 1, false);
    stage.set_precision(Precision::fp32);
    stage.forward(train.images.data(), n, 0, pass);
    sums[k] = stage.loss(ops, 0, n, targets, 1.0f / n, true);
    if (k == 0)
      stage.backward(0, false, nullptr);
    else
      stage.backward(0, false, nullptr, [&](std::size_t layer) { done_order.push_back(layer); });
  }
  CHECK(sums[1].correct == sums[0].correct);
  CHECK(std::abs(sums[1].loss - sums[0].loss) <= 1e-4 * std::abs(sums[0].loss));

  // Every executed layer's gradients are final, announced last layer first.
  std::vector<std::size_t> expected_order(LeNet::executed::size);
  for (std::size_t i = 0; i < expected_order.size(); ++i)
    expected_order[i] = expected_order.size() - 1 - i;
  CHECK(done_order == expected_order);

  const std::vector<float> cpu_gradients(cpu->gradients().begin(), cpu->gradients().end());
  std::vector<float> gpu_gradients(cpu_gradients.size());
  static_cast<gpu::DeviceStage<LeNet, SGD>&>(*gpu).read_gradients(gpu_gradients);
  require_close_relative(gpu_gradients, cpu_gradients, "gradients");

  cpu->update(sgd.lr);
  gpu->update(sgd.lr);
  std::vector<float> cpu_weights(cpu->parameter_size), gpu_weights(gpu->parameter_size);
  cpu->read(Buffer::parameters, 0, cpu_weights);
  gpu->read(Buffer::parameters, 0, gpu_weights);
  require_close_relative(gpu_weights, cpu_weights, "updated weights");
  CHECK(gpu->optimizer_steps() == 1);
  CHECK(gpu->optimizer_buffers() == cpu->optimizer_buffers());
}

namespace {

// Blocks of each kind: a Residual with a strided 1 x 1 projection, a
// Series, a Residual over Linear with an identity shortcut.
using Blocks = Sequential<Input<1, 28, 28>, Conv2d<8, 3, 1, 1>, BatchNorm2d, ReLU,
                          Residual<Conv2d<16, 3, 2, 1>, BatchNorm2d, ReLU, Conv2d<16, 3, 1, 1>>,
                          ReLU, GlobalAvgPool, Series<Linear<24>, ReLU, Linear<24>>,
                          Residual<Linear<24>, Tanh>, Linear<10>>;

// One wide layer: 78,500 weights, more than one chunk of the device's sums.
using Wide = Sequential<Input<1, 28, 28>, Flatten, Linear<100>, ReLU, Linear<10>>;

// The clipping squares each DeviceStage of Net sums per layer on the GPU,
// after one micro-batch of n samples of `data` through the network (cut
// before executed layer `cut` into two stages, unless 0: the first's output
// carried to the second's input, the second's input gradient back), against
// the same layers' squares of its gradients read back and summed on the
// host (detail::add_layer_squares, the CPU's).
template <class Net, class Loss>
void device_squares_equal_host(const data::Dataset& data, std::size_t n, std::size_t cut) {
  INFO("cut before layer " << cut);
  const Model<Net, float> initial(3);
  const std::vector<LayerRange> ranges =
      cut == 0 ? std::vector<LayerRange>{Model<Net>::all_layers}
               : std::vector<LayerRange>{{0, cut}, {cut, Model<Net>::layer_count}};
  std::vector<std::unique_ptr<detail::PipelineStage>> stages;
  for (const LayerRange& range : ranges) {
    stages.push_back(detail::make_stage_of<Net, SGD, Net, gpu::DeviceStages>(
        initial, {.lr = 0.05f}, default_bucket_bytes,
        Device{.kind = Device::Kind::cuda, .index = 0}, range, gpu::DeviceStages{}));
    stages.back()->reserve(n, 1, range.first > 0);
    stages.back()->set_precision(Precision::fp32);
  }
  const auto device_copy = [](float* to, const float* from, std::size_t count) {
    LOOM_CUDA_CHECK(cudaMemcpy(to, from, count * sizeof(float), cudaMemcpyDeviceToDevice));
    // The stages' streams do not wait for the default stream's copy.
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  };
  detail::PipelineStage& first = *stages.front();
  detail::PipelineStage& last = *stages.back();
  const Pass pass{.training = true, .seed = 7};
  const float* output = first.forward(data.images.data(), n, 0, pass);
  if (&last != &first) {
    device_copy(last.input_slot(0), output, n * last.input_size);
    last.forward(last.input_slot(0), n, 0, pass);
  }
  last.loss(detail::loss_ops<Loss, typename Net::output_shape>(), 0, n, data::targets_of(data),
            1.0f / static_cast<float>(n), true);
  last.backward(0, false, &last != &first ? last.input_gradient() : nullptr);
  if (&last != &first) {
    device_copy(first.output_gradient(), last.input_gradient(), n * first.output_size);
    first.backward(0, false, nullptr);
  }

  const auto& starts = detail::norm_segments<Net>;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    INFO("stage " << s);
    std::vector<double> on_device(starts.size()), on_host(starts.size());
    stages[s]->add_layer_squares(starts, on_device);
    std::vector<float> gradients(stages[s]->parameter_size);
    static_cast<gpu::DeviceStage<Net, SGD>&>(*stages[s]).read_gradients(gradients);
    detail::add_layer_squares<Net>(gradients, stages[s]->parameter_offset, starts, on_host,
                                   ranges[s]);
    std::size_t summed = 0;
    for (std::size_t k = 0; k < starts.size(); ++k) {
      INFO("the layer whose parameters start at " << starts[k]);
      REQUIRE(on_device[k] == Approx(on_host[k]).epsilon(1e-12).margin(0.0));
      summed += on_host[k] > 0.0 ? 1 : 0;
    }
    REQUIRE(summed > 0);
  }
}

}  // namespace

TEST_CASE("cuda stage: the clipping squares summed per layer on the GPU equal the host's sums") {
  // Blocks (a Residual's body and projection in its device block, with the
  // gaps between them), two stages (the second's layers at an offset), a
  // layer of two chunks, the last one short, and a tied copy (left out).
  const auto images = test::head(test::fashion().train, 16);
  device_squares_equal_host<Blocks, SoftmaxCrossEntropy>(images, 16, 0);
  device_squares_equal_host<Blocks, SoftmaxCrossEntropy>(images, 16, 3);
  device_squares_equal_host<Wide, SoftmaxCrossEntropy>(images, 16, 0);
  device_squares_equal_host<Wide, SoftmaxCrossEntropy>(images, 16, 2);
  device_squares_equal_host<test::TinyGptTied, PositionCrossEntropy>(test::gpt_text().train, 8, 0);
}

TEST_CASE("cuda stage: HostStagedComm over two LocalComm ranks moves device buffers exactly") {
  auto ranks = comm::LocalComm::create(2);
  std::array<std::vector<float>, 2> reduced, broadcast;
  std::vector<float> received;
  std::array<std::exception_ptr, 2> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      comm::Comm inner(std::move(ranks[static_cast<std::size_t>(r)]));
      try {
        comm::HostStagedComm c(inner, 0);
        const float x = static_cast<float>(r);
        auto summed = test::to_device(std::vector<float>{1.0f + x, 2.0f * (x + 1.0f), -3.5f * x});
        c.all_reduce(std::span<float>(summed.data(), summed.size()), comm::ReduceOp::sum);
        reduced[static_cast<std::size_t>(r)] = test::to_host(summed);
        auto sent =
            test::to_device(std::vector<float>{r == 1 ? 7.25f : 0.0f, r == 1 ? -1.5f : 0.0f});
        c.broadcast(std::span<float>(sent.data(), sent.size()), 1);
        broadcast[static_cast<std::size_t>(r)] = test::to_host(sent);
        if (r == 0) {
          const auto message = test::to_device(std::vector<float>{4.0f, -5.0f, 6.5f});
          c.send(std::span<const float>(message.data(), message.size()), 1);
        } else {
          gpu::DeviceBuffer<float> into(3, "test receive");
          c.recv(std::span<float>(into.data(), into.size()), 0);
          received = test::to_host(into);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        inner.cancel("the other rank of the test failed");
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& error : errors)
    if (error) std::rethrow_exception(error);
  for (const auto& values : reduced) CHECK(values == std::vector<float>{3.0f, 6.0f, -3.5f});
  for (const auto& values : broadcast) CHECK(values == std::vector<float>{7.25f, -1.5f});
  CHECK(received == std::vector<float>{4.0f, -5.0f, 6.5f});
}

}  // namespace cuda_stage_tests
