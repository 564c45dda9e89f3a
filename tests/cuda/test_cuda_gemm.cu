// gpu::GemmPlan (cuBLASLt) against the CPU backend (cpu::gemm + the row
// epilogues) on the same inputs, for the three GEMMs of a fused Linear+ReLU
// layer: forward with bias + ReLU and its mask, the weight gradient with the
// bias gradient, and the input gradient through the previous layer's ReLU mask
// with that layer's bias gradient. FP32 throughout, TF32 off. Without a GPU
// the binary exits with 77 and CTest reports the tests as skipped.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <loom/backend/cpu/cpu.hpp>
#include <loom/backend/cuda/gemm.hpp>
#include <loom/backend/cuda/memory.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test.hpp"
#include "loom_test.hpp"

// Not `using namespace loom`: the CUDA headers define a ::cuda namespace of
// their own, so an unqualified cuda:: would be ambiguous.
namespace test = loom::test;
namespace cpu = loom::cpu;
using loom::gpu::Epilogue;
using test::to_device;
using test::to_host;

// The mask's row stride is the output width rounded up to cuBLASLt's 128 bits.
static_assert(loom::gpu::relu_mask_ld(5) == 128 && loom::gpu::relu_mask_ld(128) == 128 &&
              loom::gpu::relu_mask_ld(129) == 256);
static_assert(loom::gpu::relu_mask_bytes(64, 500) == 64 * 512 / 8);

namespace {

// A Linear layer in -> out over a batch, and the width of the layer before it
// (whose ReLU mask the input-gradient GEMM applies).
struct LinearShape {
  std::size_t batch, in, out, prev_in;
};
// LeNet's fc1 (800 -> 500), and sizes that fit no tile or vector width.
constexpr LinearShape shapes[] = {{64, 800, 500, 120}, {3, 7, 5, 4}};

// Same products, other summation order than OpenBLAS: FP32 rounding only.
constexpr test::Tolerance fp32{1e-5, 1e-4};

// Uniform in +-1/sqrt(fan_in), as a Linear layer initialises its parameters,
// so activations are O(1) and the absolute tolerance stays meaningful.
std::vector<float> parameters(std::size_t count, std::size_t fan_in, std::uint64_t seed) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return test::random_vector<float>(count, seed, -bound, bound);
}

loom::gpu::DeviceBuffer<std::byte> workspace_for(const loom::gpu::GemmPlan& plan) {
  return loom::gpu::DeviceBuffer<std::byte>(plan.workspace_bytes(), "test GEMM workspace");
}

// ReLU decisions must agree exactly, not only within the tolerance.
void require_same_zeros(const std::vector<float>& got, const std::vector<float>& ref,
                        const std::string& what) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if ((got[i] == 0.0f) != (ref[i] == 0.0f)) {
      std::ostringstream msg;
      msg << what << ": zero pattern differs at index " << i << ": got " << got[i] << ", expected "
          << ref[i];
      FAIL(msg.str());
    }
  }
  SUCCEED();
}

}  // namespace

TEST_CASE("cuda gemm: Linear forward Y = X W^T + b, plain and with ReLU, equals the CPU backend") {
  loom::gpu::BlasLt lt;
  for (const auto& s : shapes) {
    CAPTURE(s.batch, s.in, s.out);
    const auto x = test::random_vector<float>(s.batch * s.in, 11);
    const auto w = parameters(s.out * s.in, s.in, 12);
    const auto b = parameters(s.out, s.in, 13);
    std::vector<float> z(s.batch * s.out);
    cpu::gemm(false, true, s.batch, s.out, s.in, 1.0f, x.data(), s.in, w.data(), s.in, 0.0f,
              z.data(), s.out);
    auto y_linear = z;
    cpu::bias_act_rows<loom::Act::identity>(y_linear.data(), b.data(), s.batch, s.out);
    auto y_relu = z;
    cpu::bias_act_rows<loom::Act::relu>(y_relu.data(), b.data(), s.batch, s.out);

    const auto d_x = to_device(x);
    const auto d_w = to_device(w);
    const auto d_b = to_device(b);
    const loom::gpu::GemmShape shape{.trans_a = false,
                                      .trans_b = true,
                                      .m = s.batch,
                                      .n = s.out,
                                      .k = s.in,
                                      .lda = s.in,
                                      .ldb = s.in,
                                      .ldc = s.out};
    for (const Epilogue epilogue :
         {Epilogue::none, Epilogue::bias, Epilogue::relu_bias, Epilogue::relu_aux_bias}) {
      const std::string name = loom::gpu::epilogue_name(epilogue);
      CAPTURE(name);
      loom::gpu::GemmPlan plan(lt, shape, epilogue);
      const bool with_mask = epilogue == Epilogue::relu_aux_bias;
      REQUIRE(plan.relu_mask_bytes() ==
              (with_mask ? loom::gpu::relu_mask_bytes(s.batch, s.out) : 0));
      // Garbage in Y: with beta = 0 every element must be overwritten.
      auto d_y = to_device(test::random_vector<float>(s.batch * s.out, 14));
      loom::gpu::DeviceBuffer<std::uint8_t> d_mask(plan.relu_mask_bytes(), "test ReLU mask");
      auto workspace = workspace_for(plan);
      plan.run({.a = d_x.data(),
                .b = d_w.data(),
                .c = d_y.data(),
                .bias = epilogue == Epilogue::none ? nullptr : d_b.data(),
                .relu_mask_out = with_mask ? d_mask.data() : nullptr,
                .workspace = workspace.data(),
                .workspace_bytes = workspace.size()});
      LOOM_CUDA_CHECK(cudaDeviceSynchronize());
      const auto y = to_host(d_y);
      const bool relu = epilogue == Epilogue::relu_bias || with_mask;
      const auto& expected = epilogue == Epilogue::none ? z : relu ? y_relu : y_linear;
      test::require_close(y, expected, fp32, "Y, epilogue " + name);
      if (relu) require_same_zeros(y, expected, "ReLU of Y, epilogue " + name);
    }
  }
}

TEST_CASE(
    "cuda gemm: weight gradient dW = dZ^T X with db = column sums of dZ (bgrad_a) equals the "
    "CPU backend") {
  loom::gpu::BlasLt lt;
  for (const auto& s : shapes) {
    CAPTURE(s.batch, s.in, s.out);
    const auto dz = test::random_vector<float>(s.batch * s.out, 21);
    const auto x = test::random_vector<float>(s.batch * s.in, 22);
    std::vector<float> dw(s.out * s.in), dz_copy(dz.size()), db(s.out);
    cpu::gemm(true, false, s.out, s.in, s.batch, 1.0f, dz.data(), s.out, x.data(), s.in, 0.0f,
              dw.data(), s.in);
    cpu::bias_act_backward_rows<loom::Act::identity>(dz.data(), dz.data(), dz_copy.data(),
                                                     db.data(), s.batch, s.out, false);

    const auto d_dz = to_device(dz);
    const auto d_x = to_device(x);
    auto d_dw = to_device(test::random_vector<float>(dw.size(), 23));
    auto d_db = to_device(test::random_vector<float>(db.size(), 24));
    loom::gpu::GemmPlan plan(lt,
                              {.trans_a = true,
                               .trans_b = false,
                               .m = s.out,
                               .n = s.in,
                               .k = s.batch,
                               .lda = s.out,
                               .ldb = s.in,
                               .ldc = s.in},
                              Epilogue::bgrad_a);
    auto workspace = workspace_for(plan);
    loom::gpu::GemmArgs args{.a = d_dz.data(),
                              .b = d_x.data(),
                              .c = d_dw.data(),
                              .bias_grad = d_db.data(),
                              .workspace = workspace.data(),
                              .workspace_bytes = workspace.size()};
    plan.run(args);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    test::require_close(to_host(d_dw), dw, fp32, "dW");
    test::require_close(to_host(d_db), db, fp32, "db");

    // Accumulating into dW (beta = 1) writes db afresh: it is not summed.
    args.beta = 1.0f;
    plan.run(args);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> dw_twice(dw.size());
    for (std::size_t i = 0; i < dw.size(); ++i) dw_twice[i] = 2.0f * dw[i];
    test::require_close(to_host(d_dw), dw_twice, fp32, "dW accumulated twice");
    test::require_close(to_host(d_db), db, fp32, "db after the accumulating run");
  }
}

TEST_CASE(
    "cuda gemm: input gradient dX = dZ W through the previous layer's ReLU mask, with its "
    "bias gradient (drelu_bgrad), equals the CPU backend") {
  loom::gpu::BlasLt lt;
  for (const auto& s : shapes) {
    CAPTURE(s.batch, s.in, s.out, s.prev_in);
    // The previous layer, prev_in -> in with ReLU: its output H is this
    // layer's input, and its forward GEMM leaves the mask the backward reads.
    const auto x0 = test::random_vector<float>(s.batch * s.prev_in, 31);
    const auto w0 = parameters(s.in * s.prev_in, s.prev_in, 32);
    const auto b0 = parameters(s.in, s.prev_in, 33);
    std::vector<float> h(s.batch * s.in);
    cpu::gemm(false, true, s.batch, s.in, s.prev_in, 1.0f, x0.data(), s.prev_in, w0.data(),
              s.prev_in, 0.0f, h.data(), s.in);
    cpu::bias_act_rows<loom::Act::relu>(h.data(), b0.data(), s.batch, s.in);

    const auto d_x0 = to_device(x0);
    const auto d_w0 = to_device(w0);
    const auto d_b0 = to_device(b0);
    loom::gpu::DeviceBuffer<float> d_h(h.size(), "test H");
    loom::gpu::GemmPlan forward(lt,
                                 {.trans_a = false,
                                  .trans_b = true,
                                  .m = s.batch,
                                  .n = s.in,
                                  .k = s.prev_in,
                                  .lda = s.prev_in,
                                  .ldb = s.prev_in,
                                  .ldc = s.in},
                                 Epilogue::relu_aux_bias);
    loom::gpu::DeviceBuffer<std::uint8_t> d_mask(forward.relu_mask_bytes(), "test ReLU mask");
    auto forward_workspace = workspace_for(forward);
    forward.run({.a = d_x0.data(),
                 .b = d_w0.data(),
                 .c = d_h.data(),
                 .bias = d_b0.data(),
                 .relu_mask_out = d_mask.data(),
                 .workspace = forward_workspace.data(),
                 .workspace_bytes = forward_workspace.size()});
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    require_same_zeros(to_host(d_h), h, "the previous layer's ReLU");

    // This layer's backward: dH = dZ W, then the mask and db0 = column sums.
    const auto dz = test::random_vector<float>(s.batch * s.out, 34);
    const auto w = parameters(s.out * s.in, s.in, 35);
    std::vector<float> dh(s.batch * s.in), dz0(dh.size()), db0(s.in);
    cpu::gemm(false, false, s.batch, s.in, s.out, 1.0f, dz.data(), s.out, w.data(), s.in, 0.0f,
              dh.data(), s.in);
    cpu::bias_act_backward_rows<loom::Act::relu>(dh.data(), h.data(), dz0.data(), db0.data(),
                                                 s.batch, s.in, false);

    const auto d_dz = to_device(dz);
    const auto d_w = to_device(w);
    auto d_dx = to_device(test::random_vector<float>(dh.size(), 36));
    auto d_db0 = to_device(test::random_vector<float>(db0.size(), 37));
    loom::gpu::GemmPlan backward(lt,
                                  {.trans_a = false,
                                   .trans_b = false,
                                   .m = s.batch,
                                   .n = s.in,
                                   .k = s.out,
                                   .lda = s.out,
                                   .ldb = s.in,
                                   .ldc = s.in},
                                  Epilogue::drelu_bgrad);
    REQUIRE(backward.relu_mask_bytes() == forward.relu_mask_bytes());
    auto workspace = workspace_for(backward);
    backward.run({.a = d_dz.data(),
                  .b = d_w.data(),
                  .c = d_dx.data(),
                  .relu_mask_in = d_mask.data(),
                  .bias_grad = d_db0.data(),
                  .workspace = workspace.data(),
                  .workspace_bytes = workspace.size()});
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    const auto dx = to_host(d_dx);
    test::require_close(dx, dz0, fp32, "dX through the ReLU mask");
    require_same_zeros(dx, dz0, "the ReLU mask applied to dX");
    test::require_close(to_host(d_db0), db0, fp32, "the previous layer's db");
  }
}

TEST_CASE("cuda gemm: an impossible plan and a wrong run are loom::Errors naming the call") {
  loom::gpu::BlasLt lt;
  // W is Out x In = 5 x 7 and read transposed: its row stride cannot be 3.
  const loom::gpu::GemmShape bad{
      .trans_a = false, .trans_b = true, .m = 3, .n = 5, .k = 7, .lda = 7, .ldb = 3, .ldc = 5};
  REQUIRE_THROWS_AS(loom::gpu::GemmPlan(lt, bad, Epilogue::relu_aux_bias), loom::Error);
  REQUIRE_THROWS_WITH(
      loom::gpu::GemmPlan(lt, bad, Epilogue::relu_aux_bias),
      Catch::Contains("loom::gpu::GemmPlan(trans_a=0, trans_b=1, m=3, n=5, k=7, lda=7, ldb=3, "
                      "ldc=5, epilogue=relu_aux_bias): ldb 3 is smaller than the 7 columns of "
                      "row-major B (n x k, trans_b)"));

  loom::gpu::GemmShape good = bad;
  good.ldb = 7;
  loom::gpu::GemmPlan plan(lt, good, Epilogue::relu_aux_bias);
  loom::gpu::DeviceBuffer<float> x(3 * 7 + 1, "test X"), w(5 * 7, "test W"), y(3 * 5, "test Y"),
      b(5, "test b"), db(5, "test db");
  loom::gpu::DeviceBuffer<std::uint8_t> mask(plan.relu_mask_bytes(), "test ReLU mask");
  auto workspace = workspace_for(plan);
  loom::gpu::GemmArgs args{.a = x.data(),
                            .b = w.data(),
                            .c = y.data(),
                            .bias = b.data(),
                            .relu_mask_out = mask.data(),
                            .workspace = workspace.data(),
                            .workspace_bytes = workspace.size()};

  auto no_bias = args;
  no_bias.bias = nullptr;
  REQUIRE_THROWS_WITH(plan.run(no_bias),
                      Catch::Contains("epilogue=relu_aux_bias).run: epilogue relu_aux_bias needs "
                                      "bias; pass it in GemmArgs"));
  auto stray_grad = args;
  stray_grad.bias_grad = db.data();
  REQUIRE_THROWS_WITH(plan.run(stray_grad),
                      Catch::Contains("epilogue relu_aux_bias does not use bias_grad"));
  auto misaligned = args;
  misaligned.a = x.data() + 1;  // 4 bytes past a 256-byte boundary
  REQUIRE_THROWS_WITH(plan.run(misaligned), Catch::Contains(".run: a (") &&
                                                Catch::Contains("is not aligned to 16 bytes"));
}
