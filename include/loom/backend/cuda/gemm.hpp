// GEMM on the GPU through cuBLASLt, with the epilogues a Linear layer fuses:
// bias (+ ReLU, + the ReLU bit-mask) forward; the ReLU-mask derivative with
// the bias gradient, or the bias gradient of an operand, backward. float32
// data, FP32 accumulation; TF32 only when a plan asks for it.
//
// Row-major interface, column-major library. loom stores every matrix
// row-major, as cpu::gemm takes them; cuBLASLt reads column-major. A row-major
// R x C matrix with row stride ld is, byte for byte, the column-major C x R
// matrix (its transpose) with leading dimension ld. So the row-major m x n
// product C = op(A) op(B) is computed as the column-major n x m product
// C^T = op(B)^T op(A)^T, without moving any data:
//   cuBLASLt's A = loom's b, transa = trans_b, its lda = loom's ldb;
//   cuBLASLt's B = loom's a, transb = trans_a, its ldb = loom's lda;
//   cuBLASLt's C = D = loom's c, n rows x m columns, ld = ldc;
//   cuBLASLt's (m, n, k) = loom's (n, m, k).
// What cuBLASLt's epilogue rules become in loom's row-major terms:
//   - bias: "length = rows of D" -> n entries, one per column of C:
//     c[i][j] = act(alpha * sum_k op(A)[i][k] op(B)[k][j] + beta * c[i][j] + bias[j]).
//     For Linear, Y[N x Out] = X W^T + b: the bias runs along Out.
//   - ReLU bit-mask: one bit per element of D = C^T, leading dimension in
//     bits, divisible by 128 and >= rows of D: relu_mask_ld(n) bits per row of
//     C, relu_mask_bytes(m, n) in all. Its bit order is cuBLASLt's business:
//     loom only hands the mask from a forward GEMM to the backward one.
//   - DRELU_BGRAD's bias gradient also has rows-of-D = n entries:
//     bias_grad[j] = sum over i of the masked c[i][j] (column sums of C).
//   - cuBLASLt's ReLU epilogues turn a NaN into 0 (loom's own ReLU kernels and
//     the CPU backend pass NaN on), so a NaN before a fused Linear+ReLU need
//     not reach the loss.
//   - cuBLASLt's BGRADB reduces its B over k into cols-of-D entries; its B is
//     loom's A, hence Epilogue::bgrad_a: bias_grad[i] = sum_k op(A)[i][k], m
//     entries. (Its BGRADA would reduce loom's op(B) into n entries; no layer
//     needs that, so it is not offered.)
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "check.hpp"

namespace loom::gpu {

// RAII over one cuBLASLt handle; plans borrow it, so it must outlive them.
class BlasLt {
 public:
  BlasLt() { LOOM_CUBLAS_CHECK(cublasLtCreate(&handle_)); }
  BlasLt(const BlasLt&) = delete;
  BlasLt& operator=(const BlasLt&) = delete;
  BlasLt(BlasLt&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  BlasLt& operator=(BlasLt&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~BlasLt() {
    if (handle_ != nullptr) LOOM_CUDA_RELEASE(cublasLtDestroy(handle_));
  }

  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// In loom's row-major terms (see the file comment for the cuBLASLt mapping).
enum class Epilogue {
  none,           // C = alpha op(A) op(B) + beta C
  bias,           // ... + bias[j]                              (bias: n entries)
  relu_bias,      // relu(... + bias[j])                        (inference: no mask kept)
  relu_aux_bias,  // relu(... + bias[j]), and writes the ReLU bit-mask for drelu_bgrad
  drelu_bgrad,    // C = mask ? alpha op(A) op(B) : 0 (beta = 0), bias_grad[j] = sum_i C[i][j]
  bgrad_a,        // C as none, bias_grad[i] = sum_k op(A)[i][k] (m entries)
};

constexpr const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::none:
      return "none";
    case Epilogue::bias:
      return "bias";
    case Epilogue::relu_bias:
      return "relu_bias";
    case Epilogue::relu_aux_bias:
      return "relu_aux_bias";
    case Epilogue::drelu_bgrad:
      return "drelu_bgrad";
    case Epilogue::bgrad_a:
      return "bgrad_a";
  }
  return "?";
}

// The ReLU bit-mask of an m x n row-major output: row stride in bits (n
// rounded up to cuBLASLt's 128) and total size in bytes.
constexpr std::size_t relu_mask_ld(std::size_t n) { return (n + 127) / 128 * 128; }
constexpr std::size_t relu_mask_bytes(std::size_t m, std::size_t n) {
  return relu_mask_ld(n) / 8 * m;
}

// One GEMM's shape, row-major, with the same meaning as cpu::gemm's arguments:
// op(A) is m x k, op(B) is k x n, C is m x n; each ld is a row stride in elements.
struct GemmShape {
  bool trans_a = false;
  bool trans_b = false;
  std::size_t m = 0, n = 0, k = 0;
  std::size_t lda = 0, ldb = 0, ldc = 0;
  // Strided batches (attention's products per sample): `batch` products,
  // the i-th of a + i stride_a, b + i stride_b into c + i stride_c
  // (elements), with the `none` epilogue only.
  std::size_t batch = 1;
  std::size_t stride_a = 0, stride_b = 0, stride_c = 0;
};

struct GemmOptions {
  // 32 MiB: cuBLAS's recommended workspace on Hopper. The plan reports what
  // its algorithm actually needs (workspace_bytes()), often much less.
  std::size_t max_workspace_bytes = std::size_t{32} << 20;
  // Every pointer given to run() must be aligned to this many bytes; the
  // algorithm is picked for it. 16 keeps vectorised kernels eligible while
  // allowing buffers carved out of a larger allocation.
  std::size_t alignment_bytes = 16;
  // TF32 inputs (CUBLAS_COMPUTE_32F_FAST_TF32): faster, ~1e-3 relative error.
  bool allow_tf32 = false;
  // bf16 inputs on bf16 tensor cores (CUBLAS_COMPUTE_32F_FAST_16BF), fp32
  // accumulation and output: exact for operands that already hold bf16
  // values (a bf16 network's, backend/cuda/precision.cuh). Wins over allow_tf32.
  bool allow_bf16 = false;
  // The same on fp16 tensor cores (CUBLAS_COMPUTE_32F_FAST_16F), for an fp16
  // network's operands. Wins over allow_tf32; not to be set with allow_bf16.
  bool allow_fp16 = false;
};

// The pointers and scalars of one run. Pointers an epilogue does not use
// must stay null (a bias passed to `none` would otherwise be silently dropped).
struct GemmArgs {
  const float* a = nullptr;
  const float* b = nullptr;
  float* c = nullptr;  // read when beta != 0, always written
  float alpha = 1.0f;
  float beta = 0.0f;
  const float* bias = nullptr;         // bias, relu_bias, relu_aux_bias: n entries
  void* relu_mask_out = nullptr;       // relu_aux_bias: relu_mask_bytes() written
  const void* relu_mask_in = nullptr;  // drelu_bgrad: the forward GEMM's mask
  float* bias_grad = nullptr;          // drelu_bgrad: n, bgrad_a: m entries; written, not +=
  void* workspace = nullptr;           // at least workspace_bytes(), one per stream
  std::size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

namespace detail {

// Destroying a descriptor cannot throw from a deleter: failures go to stderr.
struct LtDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const {
    LOOM_CUDA_RELEASE(cublasLtMatmulDescDestroy(d));
  }
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const {
    LOOM_CUDA_RELEASE(cublasLtMatrixLayoutDestroy(d));
  }
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const {
    LOOM_CUDA_RELEASE(cublasLtMatmulPreferenceDestroy(d));
  }
};

template <class Opaque>
using LtDesc = std::unique_ptr<Opaque, LtDescDeleter>;

// A row-major rows x cols matrix with row stride ld, seen by cuBLASLt as the
// column-major cols x rows matrix with leading dimension ld.
inline LtDesc<cublasLtMatrixLayoutOpaque_t> row_major_layout(std::size_t rows, std::size_t cols,
                                                             std::size_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  LOOM_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, cols, rows, static_cast<std::int64_t>(ld)));
  return LtDesc<cublasLtMatrixLayoutOpaque_t>(layout);
}

// `batch` matrices of a layout, `stride` elements apart.
inline void set_batches(cublasLtMatrixLayout_t layout, std::size_t batch, std::size_t stride) {
  const auto count = static_cast<std::int32_t>(batch);
  const auto offset = static_cast<std::int64_t>(stride);
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &count, sizeof(count)));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof(offset)));
}

inline bool aligned(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

}  // namespace detail

// A GEMM + epilogue for one shape: descriptors built and the algorithm picked
// once (cublasLtMatmulAlgoGetHeuristic), then run() as often as needed.
// run() writes this call's pointers into the plan's descriptor, so a plan
// serves one call at a time (any stream); use one plan per concurrent caller.
class GemmPlan {
 public:
  GemmPlan(const BlasLt& lt, const GemmShape& shape, Epilogue epilogue,
           const GemmOptions& options = {})
      : handle_(lt.get()), shape_(shape), epilogue_(epilogue), options_(options) {
    validate();
    const cublasComputeType_t compute = options.allow_bf16   ? CUBLAS_COMPUTE_32F_FAST_16BF
                                        : options.allow_fp16 ? CUBLAS_COMPUTE_32F_FAST_16F
                                        : options.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                             : CUBLAS_COMPUTE_32F;
    cublasLtMatmulDesc_t desc = nullptr;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
    desc_.reset(desc);
    // Operands swapped and trans flags crossed: see the file comment.
    const cublasOperation_t op_a = shape.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = shape.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(epilogue));
    if (uses_mask()) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, mask_ld());

    layout_a_ = shape.trans_a ? detail::row_major_layout(shape.k, shape.m, shape.lda)
                              : detail::row_major_layout(shape.m, shape.k, shape.lda);
    layout_b_ = shape.trans_b ? detail::row_major_layout(shape.n, shape.k, shape.ldb)
                              : detail::row_major_layout(shape.k, shape.n, shape.ldb);
    layout_c_ = detail::row_major_layout(shape.m, shape.n, shape.ldc);
    if (shape.batch > 1) {
      detail::set_batches(layout_a_.get(), shape.batch, shape.stride_a);
      detail::set_batches(layout_b_.get(), shape.batch, shape.stride_b);
      detail::set_batches(layout_c_.get(), shape.batch, shape.stride_c);
    }
    pick_algorithm();
  }

  const GemmShape& shape() const { return shape_; }
  Epilogue epilogue() const { return epilogue_; }
  // What the picked algorithm needs; pass at least this much to run().
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  // Size of the ReLU bit-mask this plan writes or reads; 0 when it uses none.
  std::size_t relu_mask_bytes() const {
    return uses_mask() ? loom::gpu::relu_mask_bytes(shape_.m, shape_.n) : 0;
  }

  // "GemmPlan(trans_a=0, trans_b=1, m=64, n=500, k=800, lda=800, ldb=800, ldc=500,
  // epilogue=relu_aux_bias)": how errors name the call.
  std::string describe() const {
    std::ostringstream s;
    s << "loom::gpu::GemmPlan(trans_a=" << shape_.trans_a << ", trans_b=" << shape_.trans_b
      << ", m=" << shape_.m << ", n=" << shape_.n << ", k=" << shape_.k << ", lda=" << shape_.lda
      << ", ldb=" << shape_.ldb << ", ldc=" << shape_.ldc;
    if (shape_.batch > 1)
      s << ", batch=" << shape_.batch << ", stride_a=" << shape_.stride_a
        << ", stride_b=" << shape_.stride_b << ", stride_c=" << shape_.stride_c;
    s << ", epilogue=" << epilogue_name(epilogue_)
      << (options_.allow_bf16   ? ", bf16"
          : options_.allow_fp16 ? ", fp16"
          : options_.allow_tf32 ? ", tf32"
                                : "")
      << ")";
    return s.str();
  }

  void run(const GemmArgs& args) {
    check_args(args);
    if (uses_bias() || uses_bias_grad()) {
      const void* vector = uses_bias() ? static_cast<const void*>(args.bias)
                                       : static_cast<const void*>(args.bias_grad);
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, vector);
    }
    if (uses_mask()) {
      const void* mask = epilogue_ == Epilogue::relu_aux_bias
                             ? static_cast<const void*>(args.relu_mask_out)
                             : args.relu_mask_in;
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, mask);
    }
    // cuBLASLt's A is loom's b and its B is loom's a (file comment).
    LOOM_CUBLAS_CHECK(cublasLtMatmul(handle_, desc_.get(), &args.alpha, args.b, layout_b_.get(),
                                     args.a, layout_a_.get(), &args.beta, args.c, layout_c_.get(),
                                     args.c, layout_c_.get(), &algorithm_, args.workspace,
                                     args.workspace_bytes, args.stream));
  }

 private:
  static cublasLtEpilogue_t lt_epilogue(Epilogue e) {
    switch (e) {
      case Epilogue::none:
        return CUBLASLT_EPILOGUE_DEFAULT;
      case Epilogue::bias:
        return CUBLASLT_EPILOGUE_BIAS;
      case Epilogue::relu_bias:
        return CUBLASLT_EPILOGUE_RELU_BIAS;
      case Epilogue::relu_aux_bias:
        return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
      case Epilogue::drelu_bgrad:
        return CUBLASLT_EPILOGUE_DRELU_BGRAD;
      case Epilogue::bgrad_a:
        return CUBLASLT_EPILOGUE_BGRADB;  // loom's A is cuBLASLt's B
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
  }

  bool uses_bias() const {
    return epilogue_ == Epilogue::bias || epilogue_ == Epilogue::relu_bias ||
           epilogue_ == Epilogue::relu_aux_bias;
  }
  bool uses_bias_grad() const {
    return epilogue_ == Epilogue::drelu_bgrad || epilogue_ == Epilogue::bgrad_a;
  }
  bool uses_mask() const {
    return epilogue_ == Epilogue::relu_aux_bias || epilogue_ == Epilogue::drelu_bgrad;
  }
  std::int64_t mask_ld() const { return static_cast<std::int64_t>(relu_mask_ld(shape_.n)); }

  template <class T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), attribute, &value, sizeof(T)));
  }

  // Checked here rather than left to cuBLASLt, which is not documented to
  // reject an ld below the row length and would then read rows that overlap.
  void validate() const {
    const auto& s = shape_;
    LOOM_CHECK(s.m > 0 && s.n > 0 && s.k > 0, describe(),
               ": every dimension must be at least 1; skip the call for an empty batch");
    const std::size_t a_cols = s.trans_a ? s.m : s.k;
    const std::size_t b_cols = s.trans_b ? s.k : s.n;
    LOOM_CHECK(s.lda >= a_cols, describe(), ": lda ", s.lda, " is smaller than the ", a_cols,
               " columns of row-major A", s.trans_a ? " (k x m, trans_a)" : " (m x k)",
               "; pass A's row stride");
    LOOM_CHECK(s.ldb >= b_cols, describe(), ": ldb ", s.ldb, " is smaller than the ", b_cols,
               " columns of row-major B", s.trans_b ? " (n x k, trans_b)" : " (k x n)",
               "; pass B's row stride");
    LOOM_CHECK(s.ldc >= s.n, describe(), ": ldc ", s.ldc, " is smaller than the ", s.n,
               " columns of C (m x n); pass C's row stride");
    LOOM_CHECK(s.batch >= 1 && s.batch <= std::size_t{1} << 30, describe(), ": batch ", s.batch,
               " is outside 1 to 2^30");
    LOOM_CHECK(s.batch == 1 || epilogue_ == Epilogue::none, describe(),
               ": strided batches take the none epilogue only");
    const std::size_t al = options_.alignment_bytes;
    LOOM_CHECK(al >= sizeof(float) && (al & (al - 1)) == 0, describe(), ": alignment_bytes ", al,
               " must be a power of two of at least ", sizeof(float));
    LOOM_CHECK(!(options_.allow_bf16 && options_.allow_fp16), describe(),
               ": allow_bf16 and allow_fp16 are both set; a network computes in one of them");
  }

  void pick_algorithm() {
    cublasLtMatmulPreference_t raw = nullptr;
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
    const detail::LtDesc<cublasLtMatmulPreferenceOpaque_t> preference(raw);
    const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
      LOOM_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(raw, attribute, &value, sizeof(value)));
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
             static_cast<std::uint64_t>(options_.max_workspace_bytes));
    const auto alignment = static_cast<std::uint32_t>(options_.alignment_bytes);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment);
    // The heuristic never dereferences the bias and aux pointers but, as
    // cublasLt.h documents, infers their alignment from their values. A
    // stand-in whose value is the promised alignment makes it pick an
    // algorithm that accepts any pointer run() allows; run() sets the real ones.
    const void* stand_in = reinterpret_cast<const void*>(options_.alignment_bytes);
    if (uses_bias() || uses_bias_grad()) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, stand_in);
    if (uses_mask()) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, stand_in);

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // Not LOOM_CUBLAS_CHECK: a refusal here is a shape or epilogue cuBLASLt
    // cannot do, and the message should say which plan it was.
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_.get(), layout_b_.get(), layout_a_.get(),
                                       layout_c_.get(), layout_c_.get(), raw, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      const cublasStatus_t reason = status != CUBLAS_STATUS_SUCCESS ? status : result.state;
      LOOM_FAIL("cuBLAS call cublasLtMatmulAlgoGetHeuristic found no algorithm for ", describe(),
                " on cuda:", detail::current_device(), ": ",
                found == 0 && status == CUBLAS_STATUS_SUCCESS
                    ? std::string("no candidate returned")
                    : std::string(cublasGetStatusName(reason)) + " (" +
                          cublasGetStatusString(reason) + ")",
                "; check the leading dimensions, max_workspace_bytes (",
                options_.max_workspace_bytes, ") and alignment_bytes (", options_.alignment_bytes,
                ")");
    }
    algorithm_ = result.algo;
    workspace_bytes_ = result.workspaceSize;
  }

  void check_args(const GemmArgs& args) const {
    const char* name = epilogue_name(epilogue_);
    LOOM_CHECK(args.a != nullptr && args.b != nullptr && args.c != nullptr, describe(),
               ".run: a, b and c must all be given");
    const auto given = [&](const void* p, bool needed, const char* field) {
      LOOM_CHECK((p != nullptr) == needed, describe(), ".run: epilogue ", name,
                 needed ? " needs " : " does not use ", field,
                 needed ? "; pass it in GemmArgs" : "; leave it null or pick another epilogue");
    };
    given(args.bias, uses_bias(), "bias");
    given(args.relu_mask_out, epilogue_ == Epilogue::relu_aux_bias, "relu_mask_out");
    given(args.relu_mask_in, epilogue_ == Epilogue::drelu_bgrad, "relu_mask_in");
    given(args.bias_grad, uses_bias_grad(), "bias_grad");
    const std::size_t al = options_.alignment_bytes;
    const auto check_aligned = [&](const void* p, const char* field) {
      LOOM_CHECK(detail::aligned(p, al), describe(), ".run: ", field, " (", p,
                 ") is not aligned to ", al,
                 " bytes, the plan's alignment_bytes; offset buffers by multiples of it or build "
                 "the plan with a smaller alignment_bytes");
    };
    check_aligned(args.a, "a");
    check_aligned(args.b, "b");
    check_aligned(args.c, "c");
    check_aligned(args.bias, "bias");
    check_aligned(args.relu_mask_out, "relu_mask_out");
    check_aligned(args.relu_mask_in, "relu_mask_in");
    check_aligned(args.bias_grad, "bias_grad");
    LOOM_CHECK(args.workspace_bytes >= workspace_bytes_ &&
                   (workspace_bytes_ == 0 || args.workspace != nullptr),
               describe(), ".run: the algorithm needs a workspace of ", workspace_bytes_,
               " bytes but ", args.workspace == nullptr ? 0 : args.workspace_bytes,
               " were given; allocate workspace_bytes()");
  }

  cublasLtHandle_t handle_;
  GemmShape shape_;
  Epilogue epilogue_;
  GemmOptions options_;
  detail::LtDesc<cublasLtMatmulDescOpaque_t> desc_;
  detail::LtDesc<cublasLtMatrixLayoutOpaque_t> layout_a_, layout_b_, layout_c_;
  cublasLtMatmulAlgo_t algorithm_{};
  std::size_t workspace_bytes_ = 0;
};

}  // namespace loom::gpu
