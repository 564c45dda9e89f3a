// cuDNN convolutions (loom::gpu::Convolution) against the CPU backend's conv
// layer on the same inputs, for LeNet's two convolutions, a padded stride-2
// 3x3 and a 1x1. Skipped (exit 77, never "passed") where no GPU is present.
//
// Tolerance abs 1e-4 + rel 1e-3 * |ref|: both sides compute in FP32 (FMA
// math, no TF32) but sum in different orders (cuDNN's tiling against
// OpenBLAS over im2col columns). The longest sums are backward-filter's,
// 16 * 24 * 24 = 9216 products of values in [-1, 1] (LeNet conv1): their
// reordering error is a few 1e-6 typically and bounded by ~6e-4, against
// sums of magnitude ~30, well inside 1e-3 relative.
#include <algorithm>
#include <cmath>
#include <limits>
#include <loom/backend/cpu/cpu.hpp>
#include <loom/backend/cuda/conv.cuh>
#include <loom/backend/cuda/memory.hpp>
#include <loom/backend/cuda/stream.hpp>
#include <loom/layers/conv2d.hpp>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

// Not `using namespace loom`: the CUDA headers define a ::cuda namespace of
// their own, so an unqualified cuda:: would be ambiguous.
namespace test = loom::test;

using test::to_device;
using test::to_host;

namespace {

constexpr test::Tolerance fp32_sums{1e-4, 1e-3};

// One geometry: the CPU conv layer at index 2 (so backward computes dx),
// without and with a fused ReLU.
template <class Conv, class In, std::size_t Batch>
struct Geometry {
  using Plain = loom::Bind<Conv, In, 2>;
  using WithRelu = loom::Bind<loom::Fused<Conv, loom::ReLU>, In, 2>;
  static constexpr std::size_t batch = Batch;
  static constexpr std::size_t out_channels = Conv::out_channels;
  static constexpr std::size_t in_size = Batch * In::size;
  static constexpr std::size_t out_size = Batch * Plain::output_shape::size;
  static constexpr std::size_t weight_count = Plain::weight_count;
  static loom::cpu::ConvGeometry geometry() { return Plain::geometry(Batch); }
};

using LeNetConv1 = Geometry<loom::Conv2d<20, 5>, loom::Shape<1, 28, 28>, 16>;
using LeNetConv2 = Geometry<loom::Conv2d<50, 5>, loom::Shape<20, 12, 12>, 16>;
using Stride2Pad1 = Geometry<loom::Conv2d<16, 3, 2, 1>, loom::Shape<8, 13, 11>, 5>;
using Pointwise = Geometry<loom::Conv2d<24, 1>, loom::Shape<32, 7, 7>, 6>;

template <class F>
void for_each_geometry(F&& f) {
  f.template operator()<LeNetConv1>();
  f.template operator()<LeNetConv2>();
  f.template operator()<Stride2Pad1>();
  f.template operator()<Pointwise>();
}

template <class Layer>
std::vector<float> cpu_forward(const std::vector<float>& params, const std::vector<float>& x,
                               std::size_t n) {
  std::vector<float> y(n * Layer::output_shape::size);
  std::vector<float> work(Layer::workspace * std::min(Layer::chunk, n));
  Layer::forward(params.data(), x.data(), y.data(), work.data(), n);
  return y;
}

// Outputs start as NaN: an op that reads what it should only write (beta or
// alpha2 = 0 not honoured) shows up as NaN.
loom::gpu::DeviceBuffer<float> nan_buffer(std::size_t n) {
  return to_device(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
}

std::vector<float> concat(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a);
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

}  // namespace

TEST_CASE("cuda conv: forward equals the CPU conv layer") {
  loom::gpu::Dnn dnn;
  for_each_geometry([&]<class G>() {
    const auto w = test::random_vector<float>(G::weight_count, 1);
    const auto x = test::random_vector<float>(G::in_size, 2);
    const auto y = cpu_forward<typename G::Plain>(
        concat(w, std::vector<float>(G::out_channels, 0.0f)), x, G::batch);

    loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels);
    INFO(conv.shape());
    REQUIRE(conv.deterministic());
    loom::gpu::DeviceBuffer<unsigned char> workspace(conv.workspace_bytes(), "conv workspace");
    auto d_x = to_device(x);
    auto d_w = to_device(w);
    auto d_y = nan_buffer(G::out_size);
    conv.forward(d_x.data(), d_w.data(), d_y.data(), workspace.data(), workspace.size());
    test::require_close(to_host(d_y), y, fp32_sums, "forward output");
  });
}

TEST_CASE(
    "cuda conv: forward_bias_act, fused and two-step, with and without ReLU, equals the CPU") {
  loom::gpu::Dnn dnn;
  // A stream of its own: the fused call and the fallback kernel must both follow it.
  loom::gpu::Stream stream;
  dnn.set_stream(stream.get());
  for_each_geometry([&]<class G>() {
    const auto w = test::random_vector<float>(G::weight_count, 3);
    const auto bias = test::random_vector<float>(G::out_channels, 4);
    const auto x = test::random_vector<float>(G::in_size, 5);
    const auto params = concat(w, bias);
    auto d_x = to_device(x);
    auto d_w = to_device(w);
    auto d_bias = to_device(bias);
    for (const bool prefer_fused : {false, true}) {
      loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels,
                                   {.prefer_fused_epilogue = prefer_fused});
      INFO(conv.shape() << (prefer_fused ? ", fused epilogue preferred" : ", heuristic's choice"));
      // IMPLICIT_PRECOMP_GEMM is expected to handle every FP32 NCHW 2-d
      // convolution, so preferring it makes the epilogue fused.
      if (prefer_fused) REQUIRE(conv.fused_epilogue());
      loom::gpu::DeviceBuffer<unsigned char> workspace(conv.workspace_bytes(), "conv workspace");
      for (const bool relu : {false, true}) {
        INFO((relu ? "ReLU" : "identity"));
        const auto y = relu ? cpu_forward<typename G::WithRelu>(params, x, G::batch)
                            : cpu_forward<typename G::Plain>(params, x, G::batch);
        auto d_y = nan_buffer(G::out_size);
        conv.forward_bias_act(d_x.data(), d_w.data(), d_bias.data(), d_y.data(), relu,
                              workspace.data(), workspace.size());
        stream.synchronize();
        test::require_close(to_host(d_y), y, fp32_sums, "forward_bias_act output");
        // cuDNN accepted the fused call rather than sending us down the fallback.
        if (prefer_fused) CHECK(conv.fused_epilogue());
      }
    }
  });
}

TEST_CASE("cuda conv: after a step of NaN inputs the fused epilogue's output is the CPU's again") {
  // A skipped step can leave y NaN; the fused call's z is a buffer of zeros,
  // not y, so the next step's output owes nothing to the NaN (0 * NaN).
  using G = LeNetConv2;
  loom::gpu::Dnn dnn;
  loom::gpu::Stream stream;
  dnn.set_stream(stream.get());
  loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels,
                              {.prefer_fused_epilogue = true});
  REQUIRE(conv.fused_epilogue());
  loom::gpu::DeviceBuffer<unsigned char> workspace(conv.workspace_bytes(), "conv workspace");
  const auto w = test::random_vector<float>(G::weight_count, 14);
  const auto bias = test::random_vector<float>(G::out_channels, 15);
  const auto x = test::random_vector<float>(G::in_size, 16);
  auto d_w = to_device(w);
  auto d_bias = to_device(bias);
  auto d_nan_x = nan_buffer(G::in_size);
  auto d_x = to_device(x);
  loom::gpu::DeviceBuffer<float> d_y(G::out_size, "test y");
  // Identity: a NaN survives it (ReLU's NOT_PROPAGATE_NAN may not).
  conv.forward_bias_act(d_nan_x.data(), d_w.data(), d_bias.data(), d_y.data(), false,
                        workspace.data(), workspace.size());
  stream.synchronize();
  const auto poisoned = to_host(d_y);
  REQUIRE(std::all_of(poisoned.begin(), poisoned.end(), [](float v) { return std::isnan(v); }));
  for (const bool relu : {false, true}) {
    INFO((relu ? "ReLU" : "identity"));
    conv.forward_bias_act(d_x.data(), d_w.data(), d_bias.data(), d_y.data(), relu,
                          workspace.data(), workspace.size());
    stream.synchronize();
    const auto params = concat(w, bias);
    const auto y = relu ? cpu_forward<typename G::WithRelu>(params, x, G::batch)
                        : cpu_forward<typename G::Plain>(params, x, G::batch);
    test::require_close(to_host(d_y), y, fp32_sums, "forward_bias_act output after a NaN step");
    CHECK(conv.fused_epilogue());
  }
}

TEST_CASE(
    "cuda conv: backward (epilogue, data, filter), overwritten and accumulated, equals the CPU") {
  loom::gpu::Dnn dnn;
  for_each_geometry([&]<class G>() {
    const auto w = test::random_vector<float>(G::weight_count, 6);
    const auto bias = test::random_vector<float>(G::out_channels, 7);
    const auto x = test::random_vector<float>(G::in_size, 8);
    const auto dy = test::random_vector<float>(G::out_size, 9);
    const auto params = concat(w, bias);
    loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels);
    INFO(conv.shape());
    REQUIRE(conv.deterministic());
    loom::gpu::DeviceBuffer<unsigned char> workspace(conv.workspace_bytes(), "conv workspace");
    auto d_x = to_device(x);
    auto d_w = to_device(w);
    auto d_dy = to_device(dy);
    loom::gpu::DeviceBuffer<float> d_dz(G::out_size, "test dz");
    for (const bool relu : {false, true})
      for (const bool accumulate : {false, true}) {
        INFO((relu ? "ReLU" : "identity") << (accumulate ? ", accumulating" : ", overwriting"));
        // The CPU's y feeds both sides, so the ReLU masks agree exactly.
        const auto y = relu ? cpu_forward<typename G::WithRelu>(params, x, G::batch)
                            : cpu_forward<typename G::Plain>(params, x, G::batch);
        auto dparams = test::random_vector<float>(params.size(), 10);
        const std::vector<float> dw0(dparams.begin(), dparams.begin() + G::weight_count);
        const std::vector<float> db0(dparams.begin() + G::weight_count, dparams.end());
        std::vector<float> dx(G::in_size);
        std::vector<float> work(G::Plain::workspace * std::min(G::Plain::chunk, G::batch));
        if (relu)
          G::WithRelu::backward(params.data(), x.data(), y.data(), dy.data(), dx.data(),
                                dparams.data(), work.data(), G::batch, accumulate);
        else
          G::Plain::backward(params.data(), x.data(), y.data(), dy.data(), dx.data(),
                             dparams.data(), work.data(), G::batch, accumulate);

        auto d_y = to_device(y);
        // Overwritten gradients start as NaN, accumulated ones from the CPU's start values.
        auto d_dw = accumulate ? to_device(dw0) : nan_buffer(dw0.size());
        auto d_db = accumulate ? to_device(db0) : nan_buffer(db0.size());
        auto d_dx = nan_buffer(G::in_size);
        conv.bias_act_backward(d_dy.data(), d_y.data(), d_dz.data(), d_db.data(), relu, accumulate);
        conv.backward_filter(d_x.data(), d_dz.data(), d_dw.data(), accumulate, workspace.data(),
                             workspace.size());
        conv.backward_data(d_w.data(), d_dz.data(), d_dx.data(), workspace.data(),
                           workspace.size());
        const std::vector<float> dw(dparams.begin(), dparams.begin() + G::weight_count);
        const std::vector<float> db(dparams.begin() + G::weight_count, dparams.end());
        test::require_close(to_host(d_dw), dw, fp32_sums, "weight gradient");
        test::require_close(to_host(d_db), db, fp32_sums, "bias gradient");
        test::require_close(to_host(d_dx), dx, fp32_sums, "input gradient");
      }
  });
}

TEST_CASE("cuda conv: the chosen algorithms repeat their results bit for bit") {
  loom::gpu::Dnn dnn;
  using G = LeNetConv2;
  loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels);
  INFO(conv.shape() << ": forward algo " << conv.forward_algorithm() << ", backward-data algo "
                    << conv.backward_data_algorithm() << ", backward-filter algo "
                    << conv.backward_filter_algorithm());
  REQUIRE(conv.deterministic());
  loom::gpu::DeviceBuffer<unsigned char> workspace(conv.workspace_bytes(), "conv workspace");
  auto d_x = to_device(test::random_vector<float>(G::in_size, 11));
  auto d_w = to_device(test::random_vector<float>(G::weight_count, 12));
  auto d_dy = to_device(test::random_vector<float>(G::out_size, 13));
  loom::gpu::DeviceBuffer<float> d_dw(G::weight_count, "test dw");
  loom::gpu::DeviceBuffer<float> d_dx(G::in_size, "test dx");
  std::vector<std::vector<float>> dw, dx;
  for (int run = 0; run < 2; ++run) {
    conv.backward_filter(d_x.data(), d_dy.data(), d_dw.data(), false, workspace.data(),
                         workspace.size());
    conv.backward_data(d_w.data(), d_dy.data(), d_dx.data(), workspace.data(), workspace.size());
    dw.push_back(to_host(d_dw));
    dx.push_back(to_host(d_dx));
  }
  test::require_equal(dw[1], dw[0], "repeated weight gradient");
  test::require_equal(dx[1], dx[0], "repeated input gradient");
}

TEST_CASE("cuda conv: rejected shapes and a short workspace are loom::Errors naming the shape") {
  loom::gpu::Dnn dnn;
  // A 7x7 window on a 4x4 image (loom's window_out reports 1 for such input).
  const loom::cpu::ConvGeometry too_small{2, 3, 4, 4, 7, 1, 0, 1, 1};
  REQUIRE_THROWS_WITH(loom::gpu::Convolution(dnn, too_small, 5),
                      Catch::Contains("input 2x3x4x4, 5 filters 7x7, stride 1, pad 0"));

  auto wrong_output = LeNetConv1::geometry();
  wrong_output.out_height = 25;
  REQUIRE_THROWS_WITH(loom::gpu::Convolution(dnn, wrong_output, 20),
                      Catch::Contains("input 16x1x28x28, 20 filters 5x5") &&
                          Catch::Contains("cuDNN computes an output of 16x20x24x24"));

  using G = LeNetConv2;
  loom::gpu::Convolution conv(dnn, G::geometry(), G::out_channels);
  const std::size_t needed = conv.workspace_bytes();
  if (needed == 0) {
    WARN("no direction of " << conv.shape() << " needs workspace: short-workspace check skipped");
    return;
  }
  loom::gpu::DeviceBuffer<unsigned char> workspace(needed, "conv workspace");
  loom::gpu::DeviceBuffer<float> d_x(G::in_size, "test x"), d_w(G::weight_count, "test w");
  loom::gpu::DeviceBuffer<float> d_y(G::out_size, "test y");
  const std::size_t short_bytes = needed - 1;
  int refused = 0;
  const auto expect_refusal_or_success = [&](auto&& op) {
    try {
      op();
    } catch (const loom::Error& e) {
      REQUIRE_THAT(e.what(), Catch::Contains(conv.shape()) &&
                                 Catch::Contains("bytes of workspace but was given " +
                                                 std::to_string(short_bytes)));
      ++refused;
    }
  };
  expect_refusal_or_success(
      [&] { conv.forward(d_x.data(), d_w.data(), d_y.data(), workspace.data(), short_bytes); });
  expect_refusal_or_success([&] {
    conv.backward_data(d_w.data(), d_y.data(), d_x.data(), workspace.data(), short_bytes);
  });
  expect_refusal_or_success([&] {
    conv.backward_filter(d_x.data(), d_y.data(), d_w.data(), false, workspace.data(), short_bytes);
  });
  // The direction that sets workspace_bytes() cannot run in one byte less.
  REQUIRE(refused >= 1);
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
}
