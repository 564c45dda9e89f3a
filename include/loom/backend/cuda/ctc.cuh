// CTC loss on the GPU through cuDNN (cudnnCTCLoss_v8, the deterministic
// algorithm), the same loss and gradient as cpu::ctc_loss: per-sample loss
// divided by its target length, gradient w.r.t. the unnormalised logits,
// zero beyond each sample's frames, zero_infinity as PyTorch's.
//
// cuDNN's CTC wants time-major probabilities (T x N x C) and packed labels;
// loom's logits are sample-major (N x T x C) and its targets padded, so a
// kernel transposes the logits and the host packs the labels. With
// CUDNN_LOSS_NORMALIZATION_SOFTMAX cuDNN applies the softmax itself and its
// gradient is w.r.t. its input, the logits. cuDNN computes in float only.
//
// The targets are checked on the host (cpu::detail::ctc_check_sample: the
// same errors as the CPU op), so they and the lengths are host arrays. A
// sample too short for its target never reaches cuDNN (PyTorch reports
// illegal memory accesses when a target is longer than its input there): it
// is given a one-label target and its loss and gradient are dropped.
#pragma once

#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../cpu/ctc.hpp"
#include "check.hpp"
#include "conv.cuh"
#include "memory.hpp"

namespace loom::gpu {

namespace kernels {

// probs[t][i][c] = logits[i][t][c] within sample i's frames, 0 beyond them
// (the caller's padding may hold anything).
inline __global__ void ctc_time_major(const float* logits, std::size_t n, std::size_t frames,
                                      std::size_t classes, const int* lengths, float* probs) {
  const std::size_t total = n * frames * classes;
  for (std::size_t k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t c = k % classes, i = k / classes % n, t = k / classes / n;
    probs[k] =
        t < static_cast<std::size_t>(lengths[i]) ? logits[(i * frames + t) * classes + c] : 0.0f;
  }
}

// dlogits[i][t][c] = factor[i] * grad[t][i][c] within sample i's frames;
// exactly 0 beyond them and for samples whose factor is 0 (left out), what
// cuDNN wrote there notwithstanding.
inline __global__ void ctc_sample_major(const float* grad, std::size_t n, std::size_t frames,
                                        std::size_t classes, const int* lengths,
                                        const float* factor, float* dlogits) {
  const std::size_t total = n * frames * classes;
  for (std::size_t k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t c = k % classes, t = k / classes % frames, i = k / classes / frames;
    const bool used = t < static_cast<std::size_t>(lengths[i]) && factor[i] != 0.0f;
    dlogits[k] = used ? factor[i] * grad[(t * n + i) * classes + c] : 0.0f;
  }
}

}  // namespace kernels

class CtcWorkspace;

// cpu::ctc_loss's contract on the GPU: logits and dlogits (optional) are
// device arrays (n x max_frames x classes); frames, targets and
// target_lengths host arrays. Enqueued on the workspace's Dnn stream, then
// waits for it: the sums come back to the host.
inline cpu::CtcSums ctc_loss(const float* logits, std::size_t n, std::size_t max_frames,
                             std::size_t classes, const std::int32_t* frames,
                             const std::int32_t* targets, std::size_t max_target,
                             const std::int32_t* target_lengths, float grad_scale, float* dlogits,
                             bool zero_infinity, std::size_t first_sample, CtcWorkspace& ws);

// Descriptors and buffers for batches of up to max_batch samples of up to
// max_frames frames, `classes` classes and targets of up to max_target
// labels, made once so that a step allocates nothing. Work is enqueued on
// the Dnn's stream; the Dnn must outlive the workspace.
class CtcWorkspace {
 public:
  CtcWorkspace(const Dnn& dnn, std::size_t max_batch, std::size_t max_frames, std::size_t classes,
               std::size_t max_target)
      : handle_(dnn.get()),
        max_batch_(max_batch),
        max_frames_(max_frames),
        classes_(classes),
        max_target_(max_target),
        what_("CTC loss (" + std::to_string(max_batch) + " samples, " + std::to_string(max_frames) +
              " frames, " + std::to_string(classes) + " classes)") {
    LOOM_CHECK(max_batch >= 1 && max_frames >= 1 && classes >= 2, what_,
               ": needs at least 1 sample, 1 frame and 2 classes (the blank and a label)");
    // cuDNN 9 reports CUDNN_STATUS_NOT_SUPPORTED for the deterministic
    // algorithm from 256 labels on; PyTorch uses cuDNN below 256 only.
    LOOM_CHECK(max_target >= 1 && max_target <= max_labels, what_, ": targets of up to ",
               max_target, " labels, but cuDNN's CTC takes 1 to ", max_labels,
               "; use cpu::ctc_loss for longer targets");
    LOOM_CHECK(
        max_frames * max_batch * classes <= static_cast<std::size_t>(INT_MAX), what_,
        ": more than INT_MAX elements, more than cuDNN's descriptors address; split the batch");
    ctc_desc_.reset(detail::create_dnn<cudnnCTCLossDescriptor_t>(
        cudnnCreateCTCLossDescriptor, "cudnnCreateCTCLossDescriptor", what_));
    // _v9 (cudnnSetCTCLossDescriptor_v8 is deprecated in cuDNN 9): zeroing
    // the gradient of out-of-bounds samples only guards, since none is passed.
    detail::check_dnn(cudnnSetCTCLossDescriptor_v9(
                          ctc_desc_.get(), CUDNN_DATA_FLOAT, CUDNN_LOSS_NORMALIZATION_SOFTMAX,
                          CUDNN_CTC_ZERO_OOB_GRADIENTS, static_cast<int>(max_target)),
                      "cudnnSetCTCLossDescriptor_v9", what_);
    probs_desc_.reset(detail::create_dnn<cudnnTensorDescriptor_t>(
        cudnnCreateTensorDescriptor, "cudnnCreateTensorDescriptor", what_));
    grad_desc_.reset(detail::create_dnn<cudnnTensorDescriptor_t>(
        cudnnCreateTensorDescriptor, "cudnnCreateTensorDescriptor", what_));
    describe(max_batch, max_frames);
    const std::size_t bytes = workspace_bytes_;
    probs_ = DeviceBuffer<float>(max_frames * max_batch * classes, "CTC time-major logits");
    grad_ = DeviceBuffer<float>(max_frames * max_batch * classes, "CTC time-major gradient");
    labels_ = DeviceBuffer<int>(max_batch * max_target, "CTC packed labels");
    label_lengths_ = DeviceBuffer<int>(max_batch, "CTC label lengths");
    input_lengths_ = DeviceBuffer<int>(max_batch, "CTC frame lengths");
    factors_ = DeviceBuffer<float>(max_batch, "CTC gradient factors");
    costs_ = DeviceBuffer<float>(max_batch, "CTC per-sample costs");
    scratch_ = DeviceBuffer<unsigned char>(std::max<std::size_t>(bytes, 1), "cuDNN CTC workspace");
    host_labels_.resize(max_batch * max_target);
    host_label_lengths_.resize(max_batch);
    host_input_lengths_.resize(max_batch);
    host_factors_.resize(max_batch);
    host_costs_.resize(max_batch);
    host_fits_.resize(max_batch);
  }

  static constexpr std::size_t max_labels = 255;

  std::size_t max_batch() const { return max_batch_; }
  std::size_t max_frames() const { return max_frames_; }
  std::size_t classes() const { return classes_; }
  std::size_t max_target() const { return max_target_; }

  friend cpu::CtcSums ctc_loss(const float*, std::size_t, std::size_t, std::size_t,
                               const std::int32_t*, const std::int32_t*, std::size_t,
                               const std::int32_t*, float, float*, bool, std::size_t,
                               CtcWorkspace&);

 private:
  using CtcDescriptor =
      detail::DnnDescriptor<cudnnCTCLossDescriptor_t, cudnnDestroyCTCLossDescriptor>;

  // Descriptors for a batch of n samples of `frames` frames (T x N x C,
  // packed), and cuDNN's workspace for them: queried again only when the
  // batch's shape changes, and never larger than the one allocated.
  void describe(std::size_t n, std::size_t frames) {
    if (n == described_n_ && frames == described_frames_) return;
    const int dims[3] = {static_cast<int>(frames), static_cast<int>(n), static_cast<int>(classes_)};
    const int strides[3] = {static_cast<int>(n * classes_), static_cast<int>(classes_), 1};
    for (cudnnTensorDescriptor_t desc : {probs_desc_.get(), grad_desc_.get()})
      detail::check_dnn(cudnnSetTensorNdDescriptor(desc, CUDNN_DATA_FLOAT, 3, dims, strides),
                        "cudnnSetTensorNdDescriptor", what_);
    std::size_t bytes = 0;
    detail::check_dnn(
        cudnnGetCTCLossWorkspaceSize_v8(handle_, CUDNN_CTC_LOSS_ALGO_DETERMINISTIC, ctc_desc_.get(),
                                        probs_desc_.get(), grad_desc_.get(), &bytes),
        "cudnnGetCTCLossWorkspaceSize_v8", what_);
    LOOM_CHECK(scratch_.size() == 0 || bytes <= scratch_.size(), what_, ": cuDNN asks for ", bytes,
               " workspace bytes for ", n, " samples of ", frames, " frames, more than the ",
               scratch_.size(), " it asked for the largest batch; make a workspace for this shape");
    workspace_bytes_ = bytes;
    described_n_ = n;
    described_frames_ = frames;
  }

  cudnnHandle_t handle_;
  std::size_t max_batch_, max_frames_, classes_, max_target_;
  std::string what_;
  CtcDescriptor ctc_desc_;
  detail::TensorDescriptor probs_desc_, grad_desc_;
  std::size_t described_n_ = 0, described_frames_ = 0, workspace_bytes_ = 0;
  DeviceBuffer<float> probs_, grad_, factors_, costs_;
  DeviceBuffer<int> labels_, label_lengths_, input_lengths_;
  DeviceBuffer<unsigned char> scratch_;
  // Host staging, sized once; the copies from it finish before ctc_loss returns.
  std::vector<int> host_labels_, host_label_lengths_, host_input_lengths_;
  std::vector<float> host_factors_, host_costs_;
  std::vector<char> host_fits_;
};

cpu::CtcSums ctc_loss(const float* logits, std::size_t n, std::size_t max_frames,
                      std::size_t classes, const std::int32_t* frames, const std::int32_t* targets,
                      std::size_t max_target, const std::int32_t* target_lengths, float grad_scale,
                      float* dlogits, bool zero_infinity, std::size_t first_sample,
                      CtcWorkspace& ws) {
  LOOM_CHECK(n >= 1 && n <= ws.max_batch_ && max_frames >= 1 && max_frames <= ws.max_frames_ &&
                 classes == ws.classes_ && max_target <= ws.max_target_,
             ws.what_, ": a batch of ", n, " samples, ", max_frames, " frames, ", classes,
             " classes and targets of up to ", max_target,
             " labels does not fit; make the workspace for the largest batch");
  std::size_t packed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const bool fits =
        cpu::detail::ctc_check_sample(i, max_frames, classes, frames, targets, max_target,
                                      target_lengths, zero_infinity, first_sample);
    ws.host_fits_[i] = fits ? 1 : 0;
    ws.host_input_lengths_[i] = frames[i];
    if (fits) {
      const std::int32_t* target = targets + i * max_target;
      std::copy(target, target + target_lengths[i], ws.host_labels_.begin() + packed);
      packed += static_cast<std::size_t>(target_lengths[i]);
      ws.host_label_lengths_[i] = target_lengths[i];
      ws.host_factors_[i] = grad_scale / static_cast<float>(target_lengths[i]);
    } else {
      ws.host_labels_[packed++] = 1;  // any target that fits one frame
      ws.host_label_lengths_[i] = 1;
      ws.host_factors_[i] = 0.0f;
    }
  }
  ws.describe(n, max_frames);

  cudaStream_t stream = nullptr;
  detail::check_dnn(cudnnGetStream(ws.handle_, &stream), "cudnnGetStream", ws.what_);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.labels_.data(), ws.host_labels_.data(), packed * sizeof(int),
                                  cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.label_lengths_.data(), ws.host_label_lengths_.data(),
                                  n * sizeof(int), cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.input_lengths_.data(), ws.host_input_lengths_.data(),
                                  n * sizeof(int), cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.factors_.data(), ws.host_factors_.data(), n * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));

  // 256 threads, at most 1024 blocks striding over the rest: an elementwise
  // copy, bound by memory, not measured further.
  const std::size_t total = n * max_frames * classes;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((total + 255) / 256, 1024));
  kernels::ctc_time_major<<<blocks, 256, 0, stream>>>(logits, n, max_frames, classes,
                                                      ws.input_lengths_.data(), ws.probs_.data());
  LOOM_CUDA_LAUNCH_CHECK("ctc_time_major");
  detail::check_dnn(
      cudnnCTCLoss_v8(ws.handle_, CUDNN_CTC_LOSS_ALGO_DETERMINISTIC, ws.ctc_desc_.get(),
                      ws.probs_desc_.get(), ws.probs_.data(), ws.labels_.data(),
                      ws.label_lengths_.data(), ws.input_lengths_.data(), ws.costs_.data(),
                      ws.grad_desc_.get(), dlogits != nullptr ? ws.grad_.data() : nullptr,
                      ws.workspace_bytes_, ws.scratch_.data()),
      "cudnnCTCLoss_v8", ws.what_);
  if (dlogits != nullptr) {
    kernels::ctc_sample_major<<<blocks, 256, 0, stream>>>(ws.grad_.data(), n, max_frames, classes,
                                                          ws.input_lengths_.data(),
                                                          ws.factors_.data(), dlogits);
    LOOM_CUDA_LAUNCH_CHECK("ctc_sample_major");
  }
  LOOM_CUDA_CHECK(cudaMemcpyAsync(ws.host_costs_.data(), ws.costs_.data(), n * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));

  cpu::CtcSums sums;
  bool zeroed_late = false;
  for (std::size_t i = 0; i < n; ++i) {
    if (ws.host_fits_[i] == 0) {
      ++sums.infinite;
      continue;
    }
    const float cost = ws.host_costs_[i];
    if (!std::isfinite(cost) && zero_infinity) {
      // The target fits but its probability underflowed: zeroed, as the CPU op does.
      ++sums.infinite;
      if (dlogits != nullptr)
        LOOM_CUDA_CHECK(cudaMemsetAsync(dlogits + i * max_frames * classes, 0,
                                        max_frames * classes * sizeof(float), stream));
      zeroed_late = true;
      continue;
    }
    sums.loss += static_cast<double>(cost) / static_cast<double>(target_lengths[i]);
  }
  if (zeroed_late) LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return sums;
}

}  // namespace loom::gpu
