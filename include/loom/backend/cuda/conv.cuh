// Conv2d on the GPU through cuDNN: FP32, NCHW, zero padding, cross-correlation
// (the CPU backend's convolution). A Convolution is built once per shape: its
// descriptors, the algorithm of each direction and the workspace they need are
// fixed then, so a training step only enqueues work and never allocates.
//
// cuDNN 9 keeps the imperative convolution API (cudnn_cnn.h) as "legacy":
// deprecated in favour of the graph API, still shipped and supported, and its
// deprecation warnings stay off unless CUDNN_WARN_DEPRECATED is defined. It
// is used here because it covers these four operations with fixed, documented
// semantics (alpha/beta blending) and no graph building.
//
// The epilogue (bias, ReLU) falls back to epilogue.cuh's kernels, so this
// header needs nvcc.
#pragma once

#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/activation.hpp"
#include "../cpu/conv.hpp"
#include "check.hpp"
#include "epilogue.cuh"
#include "memory.hpp"

namespace loom::gpu {

// One cuDNN handle (per device and thread that use it). Everything launched
// through it goes to the stream given to set_stream (the legacy default
// stream until then).
class Dnn {
 public:
  Dnn() { LOOM_CUDNN_CHECK(cudnnCreate(&handle_)); }
  Dnn(const Dnn&) = delete;
  Dnn& operator=(const Dnn&) = delete;
  Dnn(Dnn&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Dnn& operator=(Dnn&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  ~Dnn() {
    if (handle_ != nullptr) LOOM_CUDA_RELEASE(cudnnDestroy(handle_));
  }

  void set_stream(cudaStream_t stream) { LOOM_CUDNN_CHECK(cudnnSetStream(handle_, stream)); }
  cudnnHandle_t get() const { return handle_; }

 private:
  cudnnHandle_t handle_ = nullptr;
};

struct ConvOptions {
  // Off: FP32 convolutions run on FMA kernels (CUDNN_FMA_MATH), so results
  // match the CPU backend to FP32 rounding. On: cuDNN may pick TF32 tensor-op
  // kernels (inputs rounded to a 10-bit mantissa), faster on Ampere and later;
  // never ones that convert the data to fp16.
  bool allow_tensor_ops = false;
  // Forward uses IMPLICIT_PRECOMP_GEMM whenever cuDNN offers it for the shape,
  // even when its heuristic ranks another algorithm faster, so that
  // forward_bias_act is one fused cuDNN call (see there). Not yet measured
  // against the heuristic's choice plus the separate epilogue kernel.
  bool prefer_fused_epilogue = false;
  // Algorithms whose workspace exceeds this are passed over.
  std::size_t workspace_limit = std::numeric_limits<std::size_t>::max();
};

namespace detail {

template <class Handle, cudnnStatus_t (*Destroy)(Handle)>
struct DnnDestroy {
  void operator()(Handle handle) const { LOOM_CUDA_RELEASE(Destroy(handle)); }
};

template <class Handle, cudnnStatus_t (*Destroy)(Handle)>
using DnnDescriptor = std::unique_ptr<std::remove_pointer_t<Handle>, DnnDestroy<Handle, Destroy>>;

using TensorDescriptor = DnnDescriptor<cudnnTensorDescriptor_t, cudnnDestroyTensorDescriptor>;
using FilterDescriptor = DnnDescriptor<cudnnFilterDescriptor_t, cudnnDestroyFilterDescriptor>;
using ConvDescriptor =
    DnnDescriptor<cudnnConvolutionDescriptor_t, cudnnDestroyConvolutionDescriptor>;
using ActivationDescriptor =
    DnnDescriptor<cudnnActivationDescriptor_t, cudnnDestroyActivationDescriptor>;

// A cuDNN status other than success becomes loom::Error naming `what` (the
// operation and its shape), with cuDNN's own last message when it left one.
inline void check_dnn(cudnnStatus_t status, const char* call, const std::string& what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char message[512] = {};
  cudnnGetLastErrorString(message, sizeof message);  // returns void: nothing to check
  LOOM_FAIL("cuDNN call ", call, " failed for ", what, " on cuda:", current_device(), ": ",
            cudnnGetErrorString(status), message[0] != '\0' ? " (" : "", message,
            message[0] != '\0' ? ")" : "");
}

// A new descriptor from cudnnCreate*Descriptor, checked as check_dnn does.
template <class Handle, class Create>
Handle create_dnn(Create create_fn, const char* call, const std::string& what) {
  Handle handle = nullptr;
  check_dnn(create_fn(&handle), call, what);
  return handle;
}

template <class Algo>
struct AlgoChoice {
  Algo algo;
  cudnnMathType_t math;
  std::size_t bytes;
  bool deterministic;
};

}  // namespace detail

// Algorithm selection: once per shape, with the cudnnGet*Algorithm_v7
// heuristics rather than cudnnFind*. The heuristics run nothing on the GPU
// and allocate nothing, and give the same answer on every run for a given GPU
// and cuDNN version; Find* times every algorithm (allocating its own
// workspace unless given one), so its choice, and with it the rounding of
// the results, can change from run to run with timing noise. From the
// heuristic's list (fastest first) the first algorithm cuDNN reports as
// deterministic is taken (cudnn_ops.h marks backward-data ALGO_0 and
// backward-filter ALGO_0 and ALGO_3 as not); only if none fits does a
// non-deterministic one, and deterministic() says so.
//
// Gradients of the bias and of a fused ReLU are not cuDNN's
// (cudnnConvolutionBackwardBias): bias_act_backward runs loom's
// bias_act_backward_nchw kernel, which sums each channel in a fixed order,
// and writes dz for backward_data and backward_filter.
//
// Pointers are device pointers; every call is enqueued on the Dnn's stream.
// The Dnn must outlive the Convolution and keep the stream it had when the
// Convolution was made (the fused epilogue's zero z is written on it then).
class Convolution {
 public:
  Convolution(const Dnn& dnn, const cpu::ConvGeometry& g, std::size_t out_channels,
              ConvOptions options = {})
      : handle_(dnn.get()), g_(g), out_channels_(out_channels), shape_(describe(g, out_channels)) {
    const int n = to_int(g.batch, "batch"), c = to_int(g.channels, "channels");
    const int h = to_int(g.height, "height"), w = to_int(g.width, "width");
    const int k = to_int(g.kernel, "kernel"), s = to_int(g.stride, "stride");
    const int p = to_int(g.pad, "pad"), out = to_int(out_channels, "out_channels");
    const int oh = to_int(g.out_height, "out_height"), ow = to_int(g.out_width, "out_width");
    LOOM_CHECK(std::max(g.batch * g.channels * g.height * g.width,
                        g.batch * out_channels * g.plane()) <= static_cast<std::size_t>(INT_MAX),
               shape_,
               ": a tensor has more than INT_MAX elements, more than cuDNN's 4-d descriptors "
               "address; split the batch");

    x_desc_ = make_tensor(n, c, h, w);
    y_desc_ = make_tensor(n, out, oh, ow);
    bias_desc_ = make_tensor(1, out, 1, 1);
    w_desc_.reset(create<cudnnFilterDescriptor_t>(cudnnCreateFilterDescriptor,
                                                  "cudnnCreateFilterDescriptor"));
    check(cudnnSetFilter4dDescriptor(w_desc_.get(), CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, out, c, k,
                                     k),
          "cudnnSetFilter4dDescriptor");

    // One convolution descriptor per direction: with tensor ops allowed each
    // carries the math type of the algorithm chosen for it.
    const cudnnMathType_t math = options.allow_tensor_ops ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    for (auto* conv : {&conv_fwd_, &conv_bwd_data_, &conv_bwd_filter_}) {
      conv->reset(create<cudnnConvolutionDescriptor_t>(cudnnCreateConvolutionDescriptor,
                                                       "cudnnCreateConvolutionDescriptor"));
      check(cudnnSetConvolution2dDescriptor(conv->get(), p, p, s, s, 1, 1, CUDNN_CROSS_CORRELATION,
                                            CUDNN_DATA_FLOAT),
            "cudnnSetConvolution2dDescriptor");
      check(cudnnSetConvolutionMathType(conv->get(), math), "cudnnSetConvolutionMathType");
    }

    int dims[4] = {};
    check(cudnnGetConvolution2dForwardOutputDim(conv_fwd_.get(), x_desc_.get(), w_desc_.get(),
                                                &dims[0], &dims[1], &dims[2], &dims[3]),
          "cudnnGetConvolution2dForwardOutputDim");
    LOOM_CHECK(dims[0] == n && dims[1] == out && dims[2] == oh && dims[3] == ow, shape_,
               ": cuDNN computes an output of ", dims[0], "x", dims[1], "x", dims[2], "x", dims[3],
               "; check the geometry's out_height and out_width");

    relu_ = make_activation(CUDNN_ACTIVATION_RELU);
    identity_ = make_activation(CUDNN_ACTIVATION_IDENTITY);

    choose_forward(options);
    choose_backward_data(options);
    choose_backward_filter(options);
    fused_ = forward_.algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
    if (fused_) {
      zero_z_ = DeviceBuffer<float>(g.batch * out_channels * g.plane(),
                                    shape_ + ": the fused epilogue's zero z");
      // On the Dnn's stream, ahead of every call of this Convolution.
      LOOM_CUDA_CHECK(
          cudaMemsetAsync(zero_z_.data(), 0, zero_z_.size() * sizeof(float), stream()));
    }
  }

  // y = conv(x, w). y is written, never read (beta = 0), so it may hold garbage.
  void forward(const float* x, const float* w, float* y, void* workspace, std::size_t bytes) const {
    require_workspace(forward_.bytes, bytes, "forward");
    const float one = 1.0f, zero = 0.0f;
    check(
        cudnnConvolutionForward(handle_, &one, x_desc_.get(), x, w_desc_.get(), w, conv_fwd_.get(),
                                forward_.algo, workspace, bytes, &zero, y_desc_.get(), y),
        "cudnnConvolutionForward");
  }

  // y = act(conv(x, w) + bias), act = ReLU or identity.
  //
  // One cudnnConvolutionBiasActivationForward call when the forward algorithm
  // is IMPLICIT_PRECOMP_GEMM. cuDNN restricts that call's algorithm, and
  // accounts differ on which activation the restriction binds (cuDNN 7's text
  // for CUDNN_ACTIVATION_IDENTITY says the call "must use"
  // IMPLICIT_PRECOMP_GEMM; others tie ReLU to it); that algorithm satisfies
  // every reading. Any other algorithm:
  // cudnnConvolutionForward, then loom's bias_act_nchw kernel. Should cuDNN
  // still refuse the fused call (a CUDNN_STATUS_NOT_SUPPORTED* status), this
  // Convolution takes the two-step path from then on.
  //
  // NaN: the activation descriptors use CUDNN_NOT_PROPAGATE_NAN, the mode
  // the fused call is known to accept, so a NaN pre-activation may leave the
  // fused ReLU as 0 where the two-step path and the CPU keep the NaN.
  //
  // z: cuDNN defines the call as y = act(alpha1 * conv(x) + alpha2 * z +
  // bias) (cudnn_cnn.h, cuDNN 9; the API reference's entry for
  // cudnnConvolutionBiasActivationForward) and documents no case in which z
  // goes unread; its rule that an output is not read when its beta is 0 is
  // about beta, and alpha2 scales an input. With z = y and alpha2 = 0, a y
  // left NaN by a skipped step could make every later output 0 * NaN = NaN.
  // So z is a buffer of zeros, written once: alpha2 * z is 0 whether cuDNN
  // reads it or not.
  void forward_bias_act(const float* x, const float* w, const float* bias, float* y, bool relu,
                        void* workspace, std::size_t bytes) {
    require_workspace(forward_.bytes, bytes, "forward_bias_act");
    if (fused_) {
      const float one = 1.0f, zero = 0.0f;
      const cudnnStatus_t status = cudnnConvolutionBiasActivationForward(
          handle_, &one, x_desc_.get(), x, w_desc_.get(), w, conv_fwd_.get(), forward_.algo,
          workspace, bytes, &zero, y_desc_.get(), zero_z_.data(), bias_desc_.get(), bias,
          relu ? relu_.get() : identity_.get(), y_desc_.get(), y);
      if (CUDNN_STATUS_CATEGORY(status) != CUDNN_STATUS_NOT_SUPPORTED) {
        check(status, "cudnnConvolutionBiasActivationForward");
        return;
      }
      fused_ = false;
    }
    forward(x, w, y, workspace, bytes);
    if (relu)
      bias_act_nchw<Act::relu>(y, bias, g_.batch, out_channels_, g_.plane(), stream());
    else
      bias_act_nchw<Act::identity>(y, bias, g_.batch, out_channels_, g_.plane(), stream());
  }

  // dz = dy * act'(y) and db (+)= sum of dz over batch and plane, with loom's
  // kernel (fixed summation order), not cuDNN's backward bias. dz feeds
  // backward_data and backward_filter.
  void bias_act_backward(const float* dy, const float* y, float* dz, float* db, bool relu,
                         bool accumulate) const {
    if (relu)
      bias_act_backward_nchw<Act::relu>(dy, y, dz, db, g_.batch, out_channels_, g_.plane(),
                                        accumulate, stream());
    else
      bias_act_backward_nchw<Act::identity>(dy, y, dz, db, g_.batch, out_channels_, g_.plane(),
                                            accumulate, stream());
  }

  // dx = conv_transpose(dy, w); dx is overwritten (beta = 0).
  void backward_data(const float* w, const float* dy, float* dx, void* workspace,
                     std::size_t bytes) const {
    require_workspace(backward_data_.bytes, bytes, "backward_data");
    const float one = 1.0f, zero = 0.0f;
    check(cudnnConvolutionBackwardData(handle_, &one, w_desc_.get(), w, y_desc_.get(), dy,
                                       conv_bwd_data_.get(), backward_data_.algo, workspace, bytes,
                                       &zero, x_desc_.get(), dx),
          "cudnnConvolutionBackwardData");
  }

  // dw = grad (accumulate: dw += grad, through beta = 1).
  void backward_filter(const float* x, const float* dy, float* dw, bool accumulate, void* workspace,
                       std::size_t bytes) const {
    require_workspace(backward_filter_.bytes, bytes, "backward_filter");
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    check(cudnnConvolutionBackwardFilter(handle_, &one, x_desc_.get(), x, y_desc_.get(), dy,
                                         conv_bwd_filter_.get(), backward_filter_.algo, workspace,
                                         bytes, &beta, w_desc_.get(), dw),
          "cudnnConvolutionBackwardFilter");
  }

  // The one workspace every method accepts: the largest of the three
  // directions' needs. The caller allocates it once (e.g. from its arena).
  std::size_t workspace_bytes() const {
    return std::max({forward_.bytes, backward_data_.bytes, backward_filter_.bytes});
  }

  cudnnConvolutionFwdAlgo_t forward_algorithm() const { return forward_.algo; }
  cudnnConvolutionBwdDataAlgo_t backward_data_algorithm() const { return backward_data_.algo; }
  cudnnConvolutionBwdFilterAlgo_t backward_filter_algorithm() const {
    return backward_filter_.algo;
  }
  // All three algorithms are reported deterministic by cuDNN.
  bool deterministic() const {
    return forward_.deterministic && backward_data_.deterministic && backward_filter_.deterministic;
  }
  // Whether forward_bias_act is one cuDNN call (see there).
  bool fused_epilogue() const { return fused_; }
  const std::string& shape() const { return shape_; }

 private:
  static std::string describe(const cpu::ConvGeometry& g, std::size_t out_channels) {
    std::ostringstream s;
    s << "Conv2d on cuDNN (input " << g.batch << "x" << g.channels << "x" << g.height << "x"
      << g.width << ", " << out_channels << " filters " << g.kernel << "x" << g.kernel
      << ", stride " << g.stride << ", pad " << g.pad << ", output " << g.batch << "x"
      << out_channels << "x" << g.out_height << "x" << g.out_width << ")";
    return s.str();
  }

  int to_int(std::size_t value, const char* what) const {
    LOOM_CHECK(value <= static_cast<std::size_t>(INT_MAX), shape_, ": ", what, " = ", value,
               " does not fit cuDNN's int dimensions");
    return static_cast<int>(value);
  }

  // An algorithm's workspace (`bytes`, which the query returning `status`
  // wrote), or none when the descriptors cannot use it (cuDNN answers
  // BAD_PARAM or NOT_SUPPORTED, in any of their sub-codes): the choice then
  // skips it. Any other failure is an error.
  std::optional<std::size_t> workspace_if_supported(cudnnStatus_t status, std::size_t bytes,
                                                    const char* call) const {
    const auto category = CUDNN_STATUS_CATEGORY(status);
    if (category == CUDNN_STATUS_BAD_PARAM || category == CUDNN_STATUS_NOT_SUPPORTED)
      return std::nullopt;
    check(status, call);
    return bytes;
  }
  void check(cudnnStatus_t status, const char* call) const {
    detail::check_dnn(status, call, shape_);
  }

  void require_workspace(std::size_t needed, std::size_t given, const char* op) const {
    LOOM_CHECK(given >= needed, shape_, ": ", op, " needs ", needed,
               " bytes of workspace but was given ", given,
               "; allocate workspace_bytes() = ", workspace_bytes());
  }

  cudaStream_t stream() const {
    cudaStream_t stream = nullptr;
    check(cudnnGetStream(handle_, &stream), "cudnnGetStream");
    return stream;
  }

  template <class Handle, class Create>
  Handle create(Create create_fn, const char* call) const {
    return detail::create_dnn<Handle>(create_fn, call, shape_);
  }

  detail::TensorDescriptor make_tensor(int n, int c, int h, int w) const {
    detail::TensorDescriptor desc(create<cudnnTensorDescriptor_t>(cudnnCreateTensorDescriptor,
                                                                  "cudnnCreateTensorDescriptor"));
    check(cudnnSetTensor4dDescriptor(desc.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w),
          "cudnnSetTensor4dDescriptor");
    return desc;
  }

  detail::ActivationDescriptor make_activation(cudnnActivationMode_t mode) const {
    detail::ActivationDescriptor desc(create<cudnnActivationDescriptor_t>(
        cudnnCreateActivationDescriptor, "cudnnCreateActivationDescriptor"));
    check(cudnnSetActivationDescriptor(desc.get(), mode, CUDNN_NOT_PROPAGATE_NAN, 0.0),
          "cudnnSetActivationDescriptor");
    return desc;
  }

  // The first acceptable entry of the heuristic's list: deterministic ones
  // first (the preferred algorithm, if any, before them), then any. Without
  // tensor ops the descriptor stays on FMA math and entries reporting a
  // tensor-op math type are skipped. With them, entries that would convert
  // the fp32 data to fp16 (ALLOW_CONVERSION) are skipped too: fp16's range
  // ends at 65504, TF32's and bf16's are fp32's. workspace_of(algo) sets up the
  // direction's descriptor for the entry and returns its exact workspace, or
  // nothing when cuDNN refuses the algorithm.
  template <class Perf, class WorkspaceOf>
  auto pick(const std::vector<Perf>& perf, const ConvOptions& options, WorkspaceOf workspace_of,
            std::optional<decltype(Perf{}.algo)> preferred, const char* direction) const
      -> detail::AlgoChoice<decltype(Perf{}.algo)> {
    for (const int pass : {0, 1, 2}) {
      for (const Perf& entry : perf) {
        const bool deterministic = entry.determinism == CUDNN_DETERMINISTIC;
        if (pass == 0 && !(deterministic && preferred && entry.algo == *preferred)) continue;
        if (pass == 1 && !deterministic) continue;
        if (entry.status != CUDNN_STATUS_SUCCESS) continue;
        if (entry.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
        if (entry.mathType == CUDNN_TENSOR_OP_MATH && !options.allow_tensor_ops) continue;
        const cudnnMathType_t math = options.allow_tensor_ops ? entry.mathType : CUDNN_FMA_MATH;
        const std::optional<std::size_t> bytes = workspace_of(entry.algo, math);
        if (!bytes || *bytes > options.workspace_limit) continue;
        return {entry.algo, math, *bytes, deterministic};
      }
    }
    LOOM_FAIL(shape_, ": cuDNN offers no ", direction, " algorithm",
              options.allow_tensor_ops ? "" : " with FMA math", " within a workspace limit of ",
              options.workspace_limit, " bytes");
  }

  void choose_forward(const ConvOptions& options) {
    int count = 0;
    check(cudnnGetConvolutionForwardAlgorithmMaxCount(handle_, &count),
          "cudnnGetConvolutionForwardAlgorithmMaxCount");
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<std::size_t>(count));
    int returned = 0;
    check(cudnnGetConvolutionForwardAlgorithm_v7(handle_, x_desc_.get(), w_desc_.get(),
                                                 conv_fwd_.get(), y_desc_.get(), count, &returned,
                                                 perf.data()),
          "cudnnGetConvolutionForwardAlgorithm_v7");
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionFwdAlgo_t algo,
                            cudnnMathType_t math) -> std::optional<std::size_t> {
      check(cudnnSetConvolutionMathType(conv_fwd_.get(), math), "cudnnSetConvolutionMathType");
      std::size_t bytes = 0;
      const cudnnStatus_t status = cudnnGetConvolutionForwardWorkspaceSize(
          handle_, x_desc_.get(), w_desc_.get(), conv_fwd_.get(), y_desc_.get(), algo, &bytes);
      return workspace_if_supported(status, bytes, "cudnnGetConvolutionForwardWorkspaceSize");
    };
    std::optional<cudnnConvolutionFwdAlgo_t> preferred;
    if (options.prefer_fused_epilogue) preferred = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
    forward_ = pick(perf, options, workspace_of, preferred, "forward");
    check(cudnnSetConvolutionMathType(conv_fwd_.get(), forward_.math),
          "cudnnSetConvolutionMathType");
  }

  void choose_backward_data(const ConvOptions& options) {
    int count = 0;
    check(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle_, &count),
          "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<std::size_t>(count));
    int returned = 0;
    check(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle_, w_desc_.get(), y_desc_.get(),
                                                      conv_bwd_data_.get(), x_desc_.get(), count,
                                                      &returned, perf.data()),
          "cudnnGetConvolutionBackwardDataAlgorithm_v7");
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionBwdDataAlgo_t algo,
                            cudnnMathType_t math) -> std::optional<std::size_t> {
      check(cudnnSetConvolutionMathType(conv_bwd_data_.get(), math), "cudnnSetConvolutionMathType");
      std::size_t bytes = 0;
      const cudnnStatus_t status = cudnnGetConvolutionBackwardDataWorkspaceSize(
          handle_, w_desc_.get(), y_desc_.get(), conv_bwd_data_.get(), x_desc_.get(), algo, &bytes);
      return workspace_if_supported(status, bytes, "cudnnGetConvolutionBackwardDataWorkspaceSize");
    };
    backward_data_ = pick(perf, options, workspace_of, {}, "backward-data");
    check(cudnnSetConvolutionMathType(conv_bwd_data_.get(), backward_data_.math),
          "cudnnSetConvolutionMathType");
  }

  void choose_backward_filter(const ConvOptions& options) {
    int count = 0;
    check(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle_, &count),
          "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<std::size_t>(count));
    int returned = 0;
    check(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle_, x_desc_.get(), y_desc_.get(),
                                                        conv_bwd_filter_.get(), w_desc_.get(),
                                                        count, &returned, perf.data()),
          "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionBwdFilterAlgo_t algo,
                            cudnnMathType_t math) -> std::optional<std::size_t> {
      check(cudnnSetConvolutionMathType(conv_bwd_filter_.get(), math),
            "cudnnSetConvolutionMathType");
      std::size_t bytes = 0;
      const cudnnStatus_t status = cudnnGetConvolutionBackwardFilterWorkspaceSize(
          handle_, x_desc_.get(), y_desc_.get(), conv_bwd_filter_.get(), w_desc_.get(), algo,
          &bytes);
      return workspace_if_supported(status, bytes,
                                    "cudnnGetConvolutionBackwardFilterWorkspaceSize");
    };
    backward_filter_ = pick(perf, options, workspace_of, {}, "backward-filter");
    check(cudnnSetConvolutionMathType(conv_bwd_filter_.get(), backward_filter_.math),
          "cudnnSetConvolutionMathType");
  }

  cudnnHandle_t handle_;
  cpu::ConvGeometry g_;
  std::size_t out_channels_;
  std::string shape_;
  detail::TensorDescriptor x_desc_, y_desc_, bias_desc_;
  detail::FilterDescriptor w_desc_;
  detail::ConvDescriptor conv_fwd_, conv_bwd_data_, conv_bwd_filter_;
  detail::ActivationDescriptor relu_, identity_;
  detail::AlgoChoice<cudnnConvolutionFwdAlgo_t> forward_{};
  detail::AlgoChoice<cudnnConvolutionBwdDataAlgo_t> backward_data_{};
  detail::AlgoChoice<cudnnConvolutionBwdFilterAlgo_t> backward_filter_{};
  bool fused_ = false;
  DeviceBuffer<float> zero_z_;  // the fused call's z (see forward_bias_act)
};

}  // namespace loom::gpu
