// gpu::GemmPlan (cuBLASLt) against the CPU backend (cpu::gemm + the row
// epilogues) on the same inputs, for the three GEMMs of a fused Linear+ReLU
// layer: forward with bias + ReLU and its mask, the weight gradient with the
// bias gradient, and the input gradient through the previous layer's ReLU mask
// with that layer's bias gradient, in FP32; then every epilogue under every
// compute type a layer may plan (TF32, bf16, fp16) at both alignments the
// layers use, against the exact product within the type's rounding. Without
// a GPU the binary exits with 77 and CTest reports the tests as skipped.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <loom/backend/cpu/cpu.hpp>
#include <loom/backend/cuda/gemm.hpp>
#include <loom/backend/cuda/memory.hpp>
#include <loom/core/precision.hpp>
#include <optional>
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

// The layer's GEMMs, row-major: Y = X W^T forward, dW = dZ^T X and
// dX = dZ W backward, and the previous layer's forward (prev_in -> in),
// whose ReLU mask dX's GEMM applies.
loom::gpu::GemmShape forward_of(const LinearShape& s) {
  return {.trans_a = false,
          .trans_b = true,
          .m = s.batch,
          .n = s.out,
          .k = s.in,
          .lda = s.in,
          .ldb = s.in,
          .ldc = s.out};
}
loom::gpu::GemmShape weight_gradient_of(const LinearShape& s) {
  return {.trans_a = true,
          .trans_b = false,
          .m = s.out,
          .n = s.in,
          .k = s.batch,
          .lda = s.out,
          .ldb = s.in,
          .ldc = s.in};
}
loom::gpu::GemmShape input_gradient_of(const LinearShape& s) {
  return {.trans_a = false,
          .trans_b = false,
          .m = s.batch,
          .n = s.in,
          .k = s.out,
          .lda = s.out,
          .ldb = s.in,
          .ldc = s.in};
}
loom::gpu::GemmShape previous_forward_of(const LinearShape& s) {
  return {.trans_a = false,
          .trans_b = true,
          .m = s.batch,
          .n = s.in,
          .k = s.prev_in,
          .lda = s.prev_in,
          .ldb = s.prev_in,
          .ldc = s.in};
}

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

// ReLU decisions must agree, except where the value one side keeps lies
// within `near_zero` of zero: two sums of another order may round to
// either side there, and ReLU rightly parts them (0: exactly).
void require_same_zeros(const std::vector<float>& got, const std::vector<float>& ref,
                        const std::string& what, double near_zero) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const float kept = got[i] == 0.0f ? ref[i] : got[i];
    if ((got[i] == 0.0f) != (ref[i] == 0.0f) && !(std::abs(kept) <= near_zero)) {
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
    const loom::gpu::GemmShape shape = forward_of(s);
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
      if (relu) require_same_zeros(y, expected, "ReLU of Y, epilogue " + name, fp32.abs);
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
    loom::gpu::GemmPlan plan(lt, weight_gradient_of(s), Epilogue::bgrad_a);
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
    loom::gpu::GemmPlan forward(lt, previous_forward_of(s), Epilogue::relu_aux_bias);
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
    const auto gpu_h = to_host(d_h);
    require_same_zeros(gpu_h, h, "the previous layer's ReLU", fp32.abs);

    // This layer's backward: dH = dZ W, then the mask and db0 = column sums,
    // through the GPU's ReLU decisions (its H), which may part from the
    // CPU's where a sum lies within rounding of zero.
    const auto dz = test::random_vector<float>(s.batch * s.out, 34);
    const auto w = parameters(s.out * s.in, s.in, 35);
    std::vector<float> dh(s.batch * s.in), dz0(dh.size()), db0(s.in);
    cpu::gemm(false, false, s.batch, s.in, s.out, 1.0f, dz.data(), s.out, w.data(), s.in, 0.0f,
              dh.data(), s.in);
    cpu::bias_act_backward_rows<loom::Act::relu>(dh.data(), gpu_h.data(), dz0.data(), db0.data(),
                                                 s.batch, s.in, false);

    const auto d_dz = to_device(dz);
    const auto d_w = to_device(w);
    auto d_dx = to_device(test::random_vector<float>(dh.size(), 36));
    auto d_db0 = to_device(test::random_vector<float>(db0.size(), 37));
    loom::gpu::GemmPlan backward(lt, input_gradient_of(s), Epilogue::drelu_bgrad);
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
    // The reference went through the GPU's H: the same zeros exactly.
    require_same_zeros(dx, dz0, "the ReLU mask applied to dX", 0.0);
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

namespace {

// A compute type a layer may plan its GEMMs in.
struct ComputeType {
  const char* name;
  bool tf32, bf16, fp16;
};
constexpr ComputeType compute_types[] = {{"fp32", false, false, false},
                                         {"tf32", true, false, false},
                                         {"bf16", false, true, false},
                                         {"fp16", false, false, true}};

// Values every compute type holds exactly: bf16's (7 bits, which TF32's and
// fp16's 10 hold too), none in fp16's subnormal range. Converted exactly,
// however cuBLAS converts (it documents that the fast types may, not how),
// and multiplied exactly in fp32, they leave each type only the fp32 sums'
// rounding: a dropped bias or a wrong bias gradient stands out in all four.
std::vector<float> exact_in_every_type(std::vector<float> values) {
  for (float& v : values) {
    v = loom::round_to_bf16(v);
    if (std::abs(v) < 0x1p-14f) v = 0.0f;
  }
  return values;
}
// The relative bound on a sum of k terms' rounding in fp32, twice the
// worst a truncating accumulator gives (tensor cores need not round).
double sum_bound(std::size_t k) { return static_cast<double>(k + 1) * 0x1p-22; }

// Values on the device `offset` floats past their allocation's start
// (256-byte aligned), so that a plan promised 4-byte alignment gets it.
class Operand {
 public:
  Operand(const std::vector<float>& values, std::size_t offset)
      : buffer_(values.size() + offset, "test operand"),
        at_(buffer_.data() + offset),
        count_(values.size()) {
    LOOM_CUDA_CHECK(cudaMemcpy(at_, values.data(), count_ * sizeof(float), cudaMemcpyHostToDevice));
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());  // the copy from pageable memory has landed
  }
  float* get() const { return at_; }
  std::vector<float> read() const {
    std::vector<float> host(count_);
    LOOM_CUDA_CHECK(cudaMemcpy(host.data(), at_, count_ * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  loom::gpu::DeviceBuffer<float> buffer_;
  float* at_;
  std::size_t count_;
};

// The row-major product op(A) op(B) of `shape` in double, and each
// element's bound for a GPU: the fp32 sum of its k exact products (a bias
// added after it is the caller's).
struct Product {
  std::vector<double> value, bound;
};
Product product(const loom::gpu::GemmShape& s, const std::vector<float>& a,
                const std::vector<float>& b) {
  Product p{std::vector<double>(s.m * s.n), std::vector<double>(s.m * s.n)};
  for (std::size_t i = 0; i < s.m; ++i)
    for (std::size_t j = 0; j < s.n; ++j) {
      double sum = 0.0, magnitude = 0.0;
      for (std::size_t l = 0; l < s.k; ++l) {
        const double x = s.trans_a ? a[l * s.lda + i] : a[i * s.lda + l];
        const double y = s.trans_b ? b[j * s.ldb + l] : b[l * s.ldb + j];
        sum += x * y;
        magnitude += std::abs(x * y);
      }
      p.value[i * s.n + j] = sum;
      p.bound[i * s.n + j] = sum_bound(s.k) * magnitude + 1e-7;
    }
  return p;
}

// The first element of `got` outside want ± bound (NaN included), in `failures`.
void check_within(const std::vector<float>& got, const std::vector<double>& want,
                  const std::vector<double>& bound, const std::string& what,
                  std::vector<std::string>& failures) {
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= bound[i])) {
      std::ostringstream message;
      message << what << ": element " << i << " is " << got[i] << ", not " << want[i] << " +- "
              << bound[i];
      failures.push_back(message.str());
      return;
    }
}

}  // namespace

// The risk the GPU-truth issue names second: cuBLASLt is allowed, not
// bound, to offer the fused epilogues under the fast compute types and at
// 4-byte alignment. Every combination a layer may plan (the ReLU epilogues
// only at 16 bytes: they belong to a fused Linear, whose blocks
// DeviceLayers aligns; bias, bgrad_a and none also at 4, as attention's
// plans take them) is planned and run on LeNet's fc1 and on sizes that fit
// no tile, and every refusal, error and result outside the fp32 sums'
// rounding of the exact product is listed at once.
TEST_CASE(
    "cuda gemm: every epilogue a layer plans runs under fp32, TF32, bf16 and fp16 tensor "
    "cores, at 16 and 4 bytes' alignment, within the type's rounding") {
  loom::gpu::BlasLt lt;
  std::vector<std::string> failures;
  std::size_t runs = 0;
  for (const auto& s : shapes)
    for (const ComputeType& type : compute_types)
      for (const std::size_t alignment : {std::size_t{16}, std::size_t{4}}) {
        const loom::gpu::GemmOptions options{.alignment_bytes = alignment,
                                             .allow_tf32 = type.tf32,
                                             .allow_bf16 = type.bf16,
                                             .allow_fp16 = type.fp16};
        const std::size_t offset = alignment == 4 ? 1 : 0;  // 4 bytes past a 256-byte boundary
        std::ostringstream named;
        named << s.batch << " x " << s.in << " -> " << s.out << ", " << type.name << ", "
              << alignment << "-byte aligned";
        const std::string where = named.str();
        // An error outside a plan's run (an allocation or copy after a run
        // left the device failing) ends this combination, listed.
        try {
          const auto plan = [&](const loom::gpu::GemmShape& shape,
                                Epilogue epilogue) -> std::optional<loom::gpu::GemmPlan> {
            try {
              return loom::gpu::GemmPlan(lt, shape, epilogue, options);
            } catch (const loom::Error& error) {
              failures.push_back(where + ": " + error.what());
              return std::nullopt;
            }
          };
          // Runs a plan on the default stream and waits; a failure is listed.
          const auto run = [&](loom::gpu::GemmPlan& made, loom::gpu::GemmArgs args) {
            loom::gpu::DeviceBuffer<std::byte> workspace(made.workspace_bytes(), "test workspace");
            args.workspace = workspace.data();
            args.workspace_bytes = workspace.size();
            try {
              made.run(args);
              LOOM_CUDA_CHECK(cudaDeviceSynchronize());
              ++runs;
              return true;
            } catch (const loom::Error& error) {
              failures.push_back(where + ": " + error.what());
              return false;
            }
          };
          // Forward, Y = X W^T (+ b) (+ ReLU), and the same with the mask.
          const auto x = exact_in_every_type(test::random_vector<float>(s.batch * s.in, 41));
          const auto w = exact_in_every_type(parameters(s.out * s.in, s.in, 42));
          const auto b = exact_in_every_type(parameters(s.out, s.in, 43));
          const Operand d_x(x, offset), d_w(w, offset), d_b(b, offset);
          const loom::gpu::GemmShape forward = forward_of(s);
          const Product z = product(forward, x, w);
          std::vector<Epilogue> forwards{Epilogue::none, Epilogue::bias};
          if (alignment >= 16)
            forwards.insert(forwards.end(), {Epilogue::relu_bias, Epilogue::relu_aux_bias});
          for (const Epilogue epilogue : forwards) {
            auto made = plan(forward, epilogue);
            if (!made) continue;
            const bool biased = epilogue != Epilogue::none;
            const bool relu =
                epilogue == Epilogue::relu_bias || epilogue == Epilogue::relu_aux_bias;
            const Operand d_y(test::random_vector<float>(s.batch * s.out, 44), offset);
            loom::gpu::DeviceBuffer<std::uint8_t> mask(made->relu_mask_bytes(), "test ReLU mask");
            if (!run(*made, {.a = d_x.get(),
                             .b = d_w.get(),
                             .c = d_y.get(),
                             .bias = biased ? d_b.get() : nullptr,
                             .relu_mask_out =
                                 epilogue == Epilogue::relu_aux_bias ? mask.data() : nullptr}))
              continue;
            std::vector<double> want = z.value, bound = z.bound;
            for (std::size_t i = 0; i < want.size(); ++i) {
              const double bias = biased ? b[i % s.out] : 0.0;
              want[i] += bias;
              bound[i] += sum_bound(1) * std::abs(bias);
              if (relu) want[i] = std::max(want[i], 0.0);  // 1-Lipschitz: the bound holds
            }
            check_within(d_y.read(), want, bound,
                         where + ", Y with epilogue " + loom::gpu::epilogue_name(epilogue),
                         failures);
          }

          // The weight gradient dW = dZ^T X with db = dZ's column sums (bgrad_a).
          const auto dz = exact_in_every_type(test::random_vector<float>(s.batch * s.out, 45));
          const Operand d_dz(dz, offset);
          const loom::gpu::GemmShape weight_grad = weight_gradient_of(s);
          if (auto made = plan(weight_grad, Epilogue::bgrad_a)) {
            const Operand d_dw(test::random_vector<float>(s.out * s.in, 46), offset);
            const Operand d_db(test::random_vector<float>(s.out, 47), offset);
            if (run(*made,
                    {.a = d_dz.get(), .b = d_x.get(), .c = d_dw.get(), .bias_grad = d_db.get()})) {
              const Product dw = product(weight_grad, dz, x);
              check_within(d_dw.read(), dw.value, dw.bound, where + ", dW with epilogue bgrad_a",
                           failures);
              std::vector<double> db(s.out, 0.0), db_bound(s.out, 1e-7);
              for (std::size_t i = 0; i < s.batch; ++i)
                for (std::size_t j = 0; j < s.out; ++j) {
                  db[j] += dz[i * s.out + j];
                  db_bound[j] += sum_bound(s.batch) * std::abs(dz[i * s.out + j]);
                }
              check_within(d_db.read(), db, db_bound, where + ", db with epilogue bgrad_a",
                           failures);
            }
          }

          // The input gradient through the previous layer's ReLU mask, with
          // that layer's bias gradient (drelu_bgrad), after the previous
          // layer's forward (relu_aux_bias) has written the mask: only at 16.
          if (alignment < 16) continue;
          const auto x0 = exact_in_every_type(test::random_vector<float>(s.batch * s.prev_in, 48));
          const auto w0 = exact_in_every_type(parameters(s.in * s.prev_in, s.prev_in, 49));
          const auto b0 = exact_in_every_type(parameters(s.in, s.prev_in, 50));
          const Operand d_x0(x0, offset), d_w0(w0, offset), d_b0(b0, offset);
          const Operand d_h(std::vector<float>(s.batch * s.in), offset);
          const loom::gpu::GemmShape previous = previous_forward_of(s);
          const loom::gpu::GemmShape input_grad = input_gradient_of(s);
          auto made_forward = plan(previous, Epilogue::relu_aux_bias);
          auto made_backward = plan(input_grad, Epilogue::drelu_bgrad);
          if (!made_forward || !made_backward) continue;
          loom::gpu::DeviceBuffer<std::uint8_t> mask(made_forward->relu_mask_bytes(),
                                                     "test ReLU mask");
          if (!run(*made_forward, {.a = d_x0.get(),
                                   .b = d_w0.get(),
                                   .c = d_h.get(),
                                   .bias = d_b0.get(),
                                   .relu_mask_out = mask.data()}))
            continue;
          const Operand d_dx(test::random_vector<float>(s.batch * s.in, 51), offset);
          const Operand d_db0(test::random_vector<float>(s.in, 52), offset);
          if (!run(*made_backward, {.a = d_dz.get(),
                                    .b = d_w.get(),
                                    .c = d_dx.get(),
                                    .relu_mask_in = mask.data(),
                                    .bias_grad = d_db0.get()}))
            continue;
          // Through the GPU's own ReLU decisions (H > 0 where the mask is set):
          // exactly zero where it is not.
          const auto h = d_h.read();
          Product dx = product(input_grad, dz, w);
          std::vector<double> db0(s.in, 0.0), db0_bound(s.in, 1e-7);
          for (std::size_t i = 0; i < dx.value.size(); ++i) {
            if (h[i] <= 0.0f) dx.value[i] = dx.bound[i] = 0.0;
            db0[i % s.in] += dx.value[i];
            db0_bound[i % s.in] += dx.bound[i] + sum_bound(s.batch) * std::abs(dx.value[i]);
          }
          check_within(d_dx.read(), dx.value, dx.bound, where + ", dX with epilogue drelu_bgrad",
                       failures);
          check_within(d_db0.read(), db0, db0_bound, where + ", db with epilogue drelu_bgrad",
                       failures);
        } catch (const loom::Error& error) {
          failures.push_back(where + ": " + error.what());
        }
      }
  std::ostringstream all;
  for (const auto& failure : failures) all << "\n  " << failure;
  INFO(failures.size() << " plan(s) refused or wrong, of " << runs << " run:" << all.str());
  REQUIRE(failures.empty());
  // 2 shapes x 4 types: 7 plans at 16 bytes, 3 at 4.
  REQUIRE(runs == 2 * 4 * (7 + 3));
}
