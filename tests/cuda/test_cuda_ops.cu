// CUDA ops against the CPU backend on the same inputs. Compiled in every CI
// run; where no GPU (or no driver) is present every test exits with 77, which
// CTest reports as skipped (SKIP_RETURN_CODE), never as passed.
#include <cmath>
#include <limits>
#include <loom/backend/cpu/cpu.hpp>
#include <loom/backend/cuda/ctc.cuh>
#include <loom/backend/cuda/epilogue.cuh>
#include <loom/backend/cuda/memory.hpp>
#include <loom/backend/cuda/pool.cuh>
#include <loom/backend/cuda/sgd.cuh>
#include <loom/backend/cuda/softmax_xent.cuh>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

// Not `using namespace loom`: the CUDA headers define a ::cuda namespace of
// their own, so an unqualified cuda:: would be ambiguous.
namespace test = loom::test;
namespace cpu = loom::cpu;

using test::to_device;
using test::to_host;

TEST_CASE("cuda: SGD update with momentum, weight decay and Nesterov equals the CPU backend") {
  constexpr std::size_t n = 100003;  // not a multiple of the block size
  for (const bool nesterov : {false, true}) {
    auto w = test::random_vector<float>(n, 1);
    const auto g = test::random_vector<float>(n, 2);
    auto v = test::random_vector<float>(n, 3);
    auto dw = to_device(w);
    auto dg = to_device(g);
    auto dv = to_device(v);
    for (int step = 0; step < 3; ++step) {
      cpu::sgd_update(w.data(), g.data(), v.data(), n, 0.1f, 0.9f, 0.01f, nesterov);
      loom::gpu::sgd_update(dw.data(), dg.data(), dv.data(), n, 0.1f, 0.9f, 0.01f, nesterov,
                             nullptr);
    }
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    // The GPU contracts multiply-adds into FMAs: a few ulps apart.
    test::require_close(to_host(dw), w, {1e-6, 1e-5}, "weights");
    test::require_close(to_host(dv), v, {1e-6, 1e-5}, "velocity");
  }
}

TEST_CASE("cuda: softmax cross-entropy equals the CPU backend") {
  constexpr std::size_t batch = 1000, classes = 10;
  const auto logits = test::random_vector<float>(batch * classes, 4, -8.0, 8.0);
  std::vector<std::int32_t> labels(batch);
  for (std::size_t i = 0; i < batch; ++i) labels[i] = static_cast<std::int32_t>(i * 7 % classes);
  std::vector<float> grad(batch * classes);
  const auto expected =
      cpu::softmax_xent(logits.data(), labels.data(), batch, classes, 1.0f / 2000.0f, grad.data());

  auto d_logits = to_device(logits);
  auto d_labels = to_device(labels);
  loom::gpu::DeviceBuffer<float> d_grad(batch * classes, "test gradient");
  loom::gpu::SoftmaxXentWorkspace workspace(batch);
  const auto sums = loom::gpu::softmax_xent(d_logits.data(), d_labels.data(), batch, classes, 2000,
                                             d_grad.data(), workspace, nullptr);
  REQUIRE(sums.correct == expected.correct);
  REQUIRE(sums.loss == Approx(expected.loss).epsilon(1e-5));
  test::require_close(to_host(d_grad), grad, {1e-8, 1e-4}, "dlogits");
}

TEST_CASE("cuda: a label outside the classes and an impossible allocation are loom::Errors") {
  const std::vector<float> logits(20);
  const std::vector<std::int32_t> labels{1, 12};
  auto d_logits = to_device(logits);
  auto d_labels = to_device(labels);
  loom::gpu::SoftmaxXentWorkspace workspace(2);
  REQUIRE_THROWS_WITH(loom::gpu::softmax_xent(d_logits.data(), d_labels.data(), 2, 10, 2,
                                               static_cast<float*>(nullptr), workspace, nullptr),
                      Catch::Contains("label 12 of sample 1 is outside the network's 10 classes"));
  REQUIRE_THROWS_WITH(loom::gpu::DeviceBuffer<float>(std::size_t{1} << 50, "a test's huge buffer"),
                      Catch::Contains("out of GPU memory on cuda:0: a test's huge buffer needs") &&
                          Catch::Contains("bytes are free"));
}

TEST_CASE("cuda: convolution epilogue (bias + ReLU over NCHW) and its backward equal plain loops") {
  constexpr std::size_t batch = 5, channels = 7, plane = 37;
  const auto z = test::random_vector<float>(batch * channels * plane, 5);
  const auto bias = test::random_vector<float>(channels, 6);
  const auto dy = test::random_vector<float>(z.size(), 7);
  std::vector<float> y(z.size()), dz(z.size()), db(channels, 0.5f);
  for (std::size_t i = 0; i < z.size(); ++i) {
    const float v = z[i] + bias[i / plane % channels];
    y[i] = v < 0.0f ? 0.0f : v;
  }
  for (std::size_t c = 0; c < channels; ++c)
    for (std::size_t n = 0; n < batch; ++n)
      for (std::size_t p = 0; p < plane; ++p) {
        const std::size_t i = (n * channels + c) * plane + p;
        dz[i] = y[i] > 0.0f ? dy[i] : 0.0f;
        db[c] += dz[i];
      }
  auto d_y = to_device(z);
  auto d_bias = to_device(bias);
  auto d_dy = to_device(dy);
  loom::gpu::DeviceBuffer<float> d_dz(z.size(), "test dz");
  auto d_db = to_device(std::vector<float>(channels, 0.5f));
  loom::gpu::bias_act_nchw<loom::Act::relu>(d_y.data(), d_bias.data(), batch, channels, plane,
                                             nullptr);
  loom::gpu::bias_act_backward_nchw<loom::Act::relu>(
      d_dy.data(), d_y.data(), d_dz.data(), d_db.data(), batch, channels, plane, true, nullptr);
  test::require_equal(to_host(d_y), y, "activations");
  test::require_equal(to_host(d_dz), dz, "dz");
  test::require_close(to_host(d_db), db, {1e-6, 1e-5}, "accumulated bias gradient");
}

TEST_CASE("cuda: max and average pooling, forward and backward, equal the CPU backend") {
  for (const std::size_t k : {2, 3}) {
    const cpu::PoolGeometry g{2 * 3, 9, 8, k, 2, (9 - k) / 2 + 1, (8 - k) / 2 + 1};
    const auto x = test::random_vector<float>(g.planes * g.height * g.width, 8 + k);
    const auto dy = test::random_vector<float>(g.planes * g.out_height * g.out_width, 9 + k);
    auto d_x = to_device(x);
    auto d_dy = to_device(dy);
    loom::gpu::DeviceBuffer<float> d_y(dy.size(), "test pool output");
    loom::gpu::DeviceBuffer<float> d_dx(x.size(), "test pool input gradient");
    std::vector<float> y(dy.size()), dx(x.size());

    cpu::pool_forward<true>(g, x.data(), y.data());
    cpu::max_pool_backward(g, x.data(), dy.data(), dx.data());
    loom::gpu::pool_forward<true>(g, d_x.data(), d_y.data(), nullptr);
    loom::gpu::pool_backward<true>(g, d_x.data(), d_dy.data(), d_dx.data(), nullptr);
    test::require_equal(to_host(d_y), y, "max-pool output");
    test::require_equal(to_host(d_dx), dx, "max-pool input gradient");

    cpu::pool_forward<false>(g, x.data(), y.data());
    cpu::avg_pool_backward(g, dy.data(), dx.data());
    loom::gpu::pool_forward<false>(g, d_x.data(), d_y.data(), nullptr);
    loom::gpu::pool_backward<false>(g, d_x.data(), d_dy.data(), d_dx.data(), nullptr);
    test::require_close(to_host(d_y), y, {1e-7, 1e-6}, "average-pool output");
    test::require_close(to_host(d_dx), dx, {1e-7, 1e-6}, "average-pool input gradient");
  }
}

TEST_CASE("cuda: standalone ReLU forward and backward equal the CPU backend, NaN included") {
  auto x = test::random_vector<float>(5000, 12);
  x[17] = std::numeric_limits<float>::quiet_NaN();
  const auto dy = test::random_vector<float>(x.size(), 13);
  std::vector<float> y(x.size()), dx(x.size());
  cpu::activation_forward<loom::Act::relu>(x.data(), y.data(), x.size());
  cpu::activation_backward<loom::Act::relu>(dy.data(), y.data(), dx.data(), x.size());
  auto d_x = to_device(x);
  auto d_dy = to_device(dy);
  loom::gpu::DeviceBuffer<float> d_y(x.size(), "test relu output"), d_dx(x.size(), "test relu dx");
  loom::gpu::activation_forward<loom::Act::relu>(d_x.data(), d_y.data(), x.size(), nullptr);
  loom::gpu::activation_backward<loom::Act::relu>(d_dy.data(), d_y.data(), d_dx.data(), x.size(),
                                                   nullptr);
  const auto got = to_host(d_y);
  REQUIRE(std::isnan(got[17]));
  for (std::size_t i = 0; i < y.size(); ++i)
    if (i != 17) REQUIRE(got[i] == y[i]);
  test::require_equal(to_host(d_dx), dx, "dx");
}

TEST_CASE("cuda: CTC loss through cuDNN equals cpu::ctc_loss, padding and zero_infinity included") {
  constexpr std::size_t n = 5, max_frames = 40, classes = 12, max_target = 8;
  const std::vector<std::int32_t> frames{40, 23, 9, 40, 4};
  // Sample 4's {1, 1, 1} needs 5 frames and has 4: zeroed under
  // zero_infinity; {2, 3} fits them.
  const std::vector<std::vector<std::int32_t>> fit{
      {1, 2, 3, 4, 5, 6, 7, 8}, {7, 7, 7}, {3, 1, 4, 1, 5}, {11, 11, 2}, {2, 3}};
  auto pad = [&](std::vector<std::vector<std::int32_t>> labels,
                 std::vector<std::int32_t>& lengths) {
    std::vector<std::int32_t> padded(n * max_target, 0);
    lengths.clear();
    for (std::size_t i = 0; i < n; ++i) {
      std::copy(labels[i].begin(), labels[i].end(), padded.begin() + i * max_target);
      lengths.push_back(static_cast<std::int32_t>(labels[i].size()));
    }
    return padded;
  };
  auto too_short = fit;
  too_short[4] = {1, 1, 1};
  const auto logits = test::random_vector<float>(n * max_frames * classes, 61, -4.0, 4.0);
  auto d_logits = to_device(logits);
  loom::gpu::DeviceBuffer<float> d_grad(logits.size(), "test CTC gradient");
  loom::gpu::Dnn dnn;
  loom::gpu::CtcWorkspace workspace(dnn, n, max_frames, classes, max_target);
  for (const auto& labels : {fit, too_short}) {
    std::vector<std::int32_t> lengths;
    const auto targets = pad(labels, lengths);
    std::vector<float> grad(logits.size());
    const auto expected =
        cpu::ctc_loss(logits.data(), n, max_frames, classes, frames.data(), targets.data(),
                      max_target, lengths.data(), 1.0f / n, grad.data(), true, 0);
    // All ones is a NaN: padding cuDNN left unwritten would show.
    LOOM_CUDA_CHECK(cudaMemset(d_grad.data(), 0xff, logits.size() * sizeof(float)));
    const auto sums = loom::gpu::ctc_loss(d_logits.data(), n, max_frames, classes, frames.data(),
                                          targets.data(), max_target, lengths.data(), 1.0f / n,
                                          d_grad.data(), true, 0, workspace);
    REQUIRE(sums.infinite == expected.infinite);
    REQUIRE(sums.loss == Approx(expected.loss).epsilon(1e-4));
    test::require_close(to_host(d_grad), grad, {1e-7, 1e-4}, "CTC dlogits");
    const auto loss_only =
        loom::gpu::ctc_loss(d_logits.data(), n, max_frames, classes, frames.data(), targets.data(),
                            max_target, lengths.data(), 1.0f / n, nullptr, true, 0, workspace);
    REQUIRE(loss_only.loss == Approx(expected.loss).epsilon(1e-4));
  }
  std::vector<std::int32_t> lengths;
  const auto targets = pad(too_short, lengths);
  REQUIRE_THROWS_WITH(
      loom::gpu::ctc_loss(d_logits.data(), n, max_frames, classes, frames.data(), targets.data(),
                          max_target, lengths.data(), 1.0f, d_grad.data(), false, 10, workspace),
      Catch::StartsWith("loom: ctc_loss: sample 14 has target length 3 with 2 repeats, which "
                        "needs 5 frames, but has 4 frames"));
  REQUIRE_THROWS_WITH(
      loom::gpu::CtcWorkspace(dnn, 2, 10, 5, 300),
      Catch::Contains("targets of up to 300 labels, but cuDNN's CTC takes 1 to 255"));
}
