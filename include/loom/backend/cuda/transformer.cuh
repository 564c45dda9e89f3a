// The CUDA kernels of a transformer's layers that are not GEMMs (the GPU
// runners in gpu/transformer.cuh call them between cuBLASLt's products):
// token embedding (a gather forward, a sorted, ordered sum backward),
// learned positions, LayerNorm and RMSNorm over each row, the causal
// softmax of attention scores and rotary position turns. Each computes what
// its CPU layer computes (layers/embedding.hpp, layer_norm.hpp,
// attention.hpp), and every sum runs in a fixed order (no floating-point
// atomics), so a result never varies between runs: the embedding's and the
// positions' gradients add in the CPU's order, to the bit.
//
// Work is only enqueued on the caller's stream, so a step may be captured
// in a CUDA graph; the embedding's sort takes its temporary storage from
// the caller (embedding_sort_bytes), as capture allows no allocation.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "check.hpp"
#include "launch.hpp"

namespace loom::gpu {

namespace kernels {

// y[t][c] = table[ids[t]][c]: ids already checked on the host (whole
// numbers below the vocabulary) before they came over.
inline __global__ void embedding_gather(const float* ids, const float* table, float* y,
                                        std::size_t tokens, std::size_t width) {
  const std::size_t count = tokens * width;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    y[i] = table[static_cast<std::size_t>(ids[i / width]) * width + i % width];
}

inline __global__ void ids_to_keys(const float* ids, std::int32_t* keys, std::int32_t* order,
                                   std::size_t tokens) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens;
       t += stride) {
    keys[t] = static_cast<std::int32_t>(ids[t]);
    order[t] = static_cast<std::int32_t>(t);
  }
}

// Block v (grid-stride over the vocabulary) writes row v of the table's
// gradient: the sum of dy over the tokens that named v. The radix sort is
// stable, so those tokens come in their order in the batch and the sum adds
// as the CPU's loop does; a row no token named is zero.
inline __global__ void embedding_row_sums(const std::int32_t* keys, const std::int32_t* order,
                                          const float* dy, float* dtable, std::size_t tokens,
                                          std::size_t vocab, std::size_t width) {
  __shared__ std::size_t range[2];
  for (std::size_t v = blockIdx.x; v < vocab; v += gridDim.x) {
    if (threadIdx.x < 2) {
      // The first token whose id exceeds v - 1 + threadIdx.x: [range[0], range[1]) names v.
      const auto bound = static_cast<std::int64_t>(v) + threadIdx.x;
      std::size_t lo = 0, hi = tokens;
      while (lo < hi) {
        const std::size_t mid = (lo + hi) / 2;
        if (static_cast<std::int64_t>(keys[mid]) < bound)
          lo = mid + 1;
        else
          hi = mid;
      }
      range[threadIdx.x] = lo;
    }
    __syncthreads();
    for (std::size_t c = threadIdx.x; c < width; c += blockDim.x) {
      float sum = 0.0f;
      for (std::size_t k = range[0]; k < range[1]; ++k)
        sum += dy[static_cast<std::size_t>(order[k]) * width + c];
      dtable[v * width + c] = sum;
    }
    __syncthreads();
  }
}

inline __global__ void add_positions(const float* x, const float* table, float* y,
                                     std::size_t samples, std::size_t size) {
  const std::size_t count = samples * size;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    y[i] = x[i] + table[i % size];
}

// One thread per table entry, summing the samples in order (the CPU's).
inline __global__ void position_sums(const float* dy, float* dtable, std::size_t samples,
                                     std::size_t size) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size;
       i += stride) {
    float sum = 0.0f;
    for (std::size_t s = 0; s < samples; ++s) sum += dy[s * size + i];
    dtable[i] = sum;
  }
}

inline constexpr unsigned norm_threads = 256;

// A row's mean (0 for RMSNorm) and 1 / sqrt(variance or mean square + eps),
// summed in double as the CPU sums them; every thread gets both.
template <bool Centered>
__device__ void row_moments(const float* in, std::size_t features, double eps, double& mean,
                            double& rstd) {
  using Reduce = cub::BlockReduce<double, norm_threads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ double shared[2];
  mean = 0.0;
  if constexpr (Centered) {
    double sum = 0.0;
    for (std::size_t c = threadIdx.x; c < features; c += blockDim.x) sum += in[c];
    sum = Reduce(storage).Sum(sum);
    if (threadIdx.x == 0) shared[0] = sum / static_cast<double>(features);
    __syncthreads();
    mean = shared[0];
  }
  double squares = 0.0;
  for (std::size_t c = threadIdx.x; c < features; c += blockDim.x) {
    const double d = static_cast<double>(in[c]) - mean;
    squares += d * d;
  }
  squares = Reduce(storage).Sum(squares);
  if (threadIdx.x == 0) shared[1] = 1.0 / sqrt(squares / static_cast<double>(features) + eps);
  __syncthreads();
  rstd = shared[1];
}

// Block r normalises row r: y = float((x - mean) * rstd) * weight (+ bias).
template <bool Centered>
__global__ void row_norm_forward(const float* x, const float* weight, const float* bias, float* y,
                                 std::size_t rows, std::size_t features, double eps) {
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* in = x + r * features;
    double mean = 0.0, rstd = 1.0;
    row_moments<Centered>(in, features, eps, mean, rstd);
    for (std::size_t c = threadIdx.x; c < features; c += blockDim.x) {
      const float normalised = static_cast<float>((static_cast<double>(in[c]) - mean) * rstd);
      float out = normalised * weight[c];
      if constexpr (Centered) out += bias[c];
      y[r * features + c] = out;
    }
    __syncthreads();
  }
}

// Block r: row r's input gradient (the CPU's formula, in double), and its
// moments for the parameters' sums (row_norm_param_partials).
template <bool Centered>
__global__ void row_norm_backward(const float* x, const float* weight, const float* dy, float* dx,
                                  double* moments, std::size_t rows, std::size_t features,
                                  double eps) {
  using Reduce = cub::BlockReduce<double, norm_threads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ double shared[2];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* in = x + r * features;
    const float* grad = dy + r * features;
    double mean = 0.0, rstd = 1.0;
    row_moments<Centered>(in, features, eps, mean, rstd);
    if (threadIdx.x == 0) {
      moments[2 * r] = mean;
      moments[2 * r + 1] = rstd;
    }
    if (dx != nullptr) {
      double g_sum = 0.0, gx_sum = 0.0;
      for (std::size_t c = threadIdx.x; c < features; c += blockDim.x) {
        const double normalised = (static_cast<double>(in[c]) - mean) * rstd;
        const double g = static_cast<double>(grad[c]) * static_cast<double>(weight[c]);
        g_sum += g;
        gx_sum += g * normalised;
      }
      g_sum = Reduce(storage).Sum(g_sum);
      __syncthreads();
      gx_sum = Reduce(storage).Sum(gx_sum);
      if (threadIdx.x == 0) {
        shared[0] = g_sum / static_cast<double>(features);
        shared[1] = gx_sum / static_cast<double>(features);
      }
      __syncthreads();
      const double g_mean = Centered ? shared[0] : 0.0, gx_mean = shared[1];
      for (std::size_t c = threadIdx.x; c < features; c += blockDim.x) {
        const double normalised = (static_cast<double>(in[c]) - mean) * rstd;
        const double g = static_cast<double>(grad[c]) * static_cast<double>(weight[c]);
        dx[r * features + c] = static_cast<float>(rstd * (g - g_mean - normalised * gx_mean));
      }
    }
    __syncthreads();
  }
}

// Thread (c, chunk): feature c's weight (and bias) gradient over one chunk
// of rows, into partials[chunk][c] (and [chunks + chunk][c]).
template <bool Centered>
__global__ void row_norm_param_partials(const float* x, const float* dy, const double* moments,
                                        double* partials, std::size_t rows, std::size_t features,
                                        std::size_t chunk_rows) {
  const std::size_t c = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t chunk = blockIdx.y;
  if (c >= features) return;
  const std::size_t chunks = gridDim.y;
  const std::size_t end = (chunk + 1) * chunk_rows < rows ? (chunk + 1) * chunk_rows : rows;
  double weight = 0.0, bias = 0.0;
  for (std::size_t r = chunk * chunk_rows; r < end; ++r) {
    const double g = dy[r * features + c];
    weight += g * ((static_cast<double>(x[r * features + c]) - moments[2 * r]) * moments[2 * r + 1]);
    if constexpr (Centered) bias += g;
  }
  partials[chunk * features + c] = weight;
  if constexpr (Centered) partials[(chunks + chunk) * features + c] = bias;
}

// The chunks' partials summed in order into the weight's gradient and
// (count: twice the features) the bias's.
inline __global__ void row_norm_param_sums(const double* partials, float* dweight, float* dbias,
                                           std::size_t chunks, std::size_t features,
                                           std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const std::size_t part = i / features, c = i % features;
    double sum = 0.0;
    for (std::size_t k = 0; k < chunks; ++k) sum += partials[(part * chunks + k) * features + c];
    (part == 0 ? dweight : dbias)[c] = static_cast<float>(sum);
  }
}

// One warp per score row: row r is query position r % context of its
// (sample, head); the scores (already scaled) of positions 0..i become
// their softmax, with the row's maximum subtracted, the rest 0.
inline __global__ void causal_softmax_forward(float* p, std::size_t rows, std::size_t context) {
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x % 32;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps) {
    float* row = p + r * context;
    const std::size_t i = r % context;
    float top = -INFINITY;
    for (std::size_t j = lane; j <= i; j += 32) top = fmaxf(top, row[j]);
    for (int offset = 16; offset > 0; offset /= 2)
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
    float total = 0.0f;
    for (std::size_t j = lane; j <= i; j += 32) {
      const float e = expf(row[j] - top);
      row[j] = e;
      total += e;
    }
    for (int offset = 16; offset > 0; offset /= 2)
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    for (std::size_t j = lane; j < context; j += 32) row[j] = j <= i ? row[j] / total : 0.0f;
  }
}

// One warp per row: dS = P * (dP - sum_j P dP), in place over dP, 0 above
// the diagonal.
inline __global__ void causal_softmax_backward(const float* p, float* dp, std::size_t rows,
                                               std::size_t context) {
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x % 32;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps) {
    const float* prow = p + r * context;
    float* drow = dp + r * context;
    const std::size_t i = r % context;
    float dot = 0.0f;
    for (std::size_t j = lane; j <= i; j += 32) dot += prow[j] * drow[j];
    for (int offset = 16; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    for (std::size_t j = lane; j < context; j += 32)
      drow[j] = j <= i ? prow[j] * (drow[j] - dot) : 0.0f;
  }
}

// Rotary positions over rows of q | k | v (each `inner` wide, heads of
// head_width): pair (a, b) = (feature i, feature half + i) of a head's q
// and k at position pos becomes (a cos - b sin, b cos + a sin), the angle
// pos * theta^(-2i / head_width) taken in double; `back` turns by minus it.
inline __global__ void rotary_turn(float* qkv, std::size_t rows, std::size_t context,
                                   std::size_t inner, std::size_t head_width, double theta,
                                   bool back) {
  const std::size_t half = head_width / 2;
  const std::size_t heads = inner / head_width;
  const std::size_t count = rows * 2 * heads * half;  // (row, q or k, head, pair)
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t at = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < count;
       at += stride) {
    const std::size_t i = at % half;
    const std::size_t head = at / half % heads;
    const std::size_t part = at / (half * heads) % 2;
    const std::size_t row = at / (2 * half * heads);
    const double angle = static_cast<double>(row % context) *
                         pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_width));
    const float c = static_cast<float>(cos(angle));
    const float s = back ? static_cast<float>(-sin(angle)) : static_cast<float>(sin(angle));
    float* h = qkv + row * 3 * inner + part * inner + head * head_width;
    const float a = h[i], b = h[half + i];
    h[i] = a * c - b * s;
    h[half + i] = b * c + a * s;
  }
}

}  // namespace kernels

inline void embedding_forward(const float* ids, const float* table, float* y, std::size_t tokens,
                              std::size_t width, cudaStream_t stream) {
  kernels::embedding_gather<<<grid_blocks(tokens * width), block_threads, 0, stream>>>(
      ids, table, y, tokens, width);
  LOOM_CUDA_LAUNCH_CHECK("embedding_gather");
}

// The bits a sort of ids below `vocab` needs.
inline int id_bits(std::size_t vocab) {
  int bits = 1;
  while ((std::size_t{1} << bits) < vocab) ++bits;
  return bits;
}

// CUB's temporary storage for sorting `tokens` ids below `vocab`, rounded
// to 256 bytes.
inline std::size_t embedding_sort_temp_bytes(std::size_t tokens, std::size_t vocab) {
  std::size_t temp = 0;
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr),
      static_cast<int>(tokens), 0, id_bits(vocab)));
  return (temp + 255) / 256 * 256;
}
// The embedding gradient's scratch for `tokens` ids: CUB's temporary
// storage, then two key and two order arrays.
inline std::size_t embedding_sort_bytes(std::size_t tokens, std::size_t vocab) {
  return embedding_sort_temp_bytes(tokens, vocab) + 4 * tokens * sizeof(std::int32_t);
}

// dtable = the sum of dy's rows over the tokens naming each row, in token
// order; `work` (256-byte aligned) holds embedding_sort_bytes(tokens,
// vocab) bytes, the first `temp` (embedding_sort_temp_bytes, asked before:
// a captured step may not) CUB's.
inline void embedding_backward(const float* ids, const float* dy, float* dtable,
                               std::size_t tokens, std::size_t vocab, std::size_t width,
                               unsigned char* work, std::size_t temp, cudaStream_t stream) {
  auto* keys = reinterpret_cast<std::int32_t*>(work + temp);
  std::int32_t* order = keys + tokens;
  std::int32_t* sorted_keys = order + tokens;
  std::int32_t* sorted_order = sorted_keys + tokens;
  kernels::ids_to_keys<<<grid_blocks(tokens), block_threads, 0, stream>>>(ids, keys, order,
                                                                           tokens);
  LOOM_CUDA_LAUNCH_CHECK("ids_to_keys");
  LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(work, temp, keys, sorted_keys, order,
                                                  sorted_order, static_cast<int>(tokens), 0,
                                                  id_bits(vocab), stream));
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>(vocab, 65535));
  kernels::embedding_row_sums<<<blocks, 128, 0, stream>>>(sorted_keys, sorted_order, dy, dtable,
                                                          tokens, vocab, width);
  LOOM_CUDA_LAUNCH_CHECK("embedding_row_sums");
}

inline void positions_forward(const float* x, const float* table, float* y, std::size_t samples,
                              std::size_t size, cudaStream_t stream) {
  kernels::add_positions<<<grid_blocks(samples * size), block_threads, 0, stream>>>(
      x, table, y, samples, size);
  LOOM_CUDA_LAUNCH_CHECK("add_positions");
}

inline void positions_backward(const float* dy, float* dtable, std::size_t samples,
                               std::size_t size, cudaStream_t stream) {
  kernels::position_sums<<<grid_blocks(size), block_threads, 0, stream>>>(dy, dtable, samples,
                                                                          size);
  LOOM_CUDA_LAUNCH_CHECK("position_sums");
}

// Rows per chunk of a norm's parameter sums, and the chunks of `rows`.
inline constexpr std::size_t norm_chunk_rows = 64;
inline std::size_t norm_chunks(std::size_t rows) {
  return (rows + norm_chunk_rows - 1) / norm_chunk_rows;
}
// The norm backward's scratch for `rows` rows of `features`: each row's
// moments, then the parameters' partial sums (weight, and bias).
inline std::size_t row_norm_scratch_bytes(std::size_t rows, std::size_t features) {
  return (2 * rows + 2 * norm_chunks(rows) * features) * sizeof(double);
}

inline unsigned norm_blocks(std::size_t rows) {
  return static_cast<unsigned>(std::min<std::size_t>(rows, 65535));
}

// bias: LayerNorm's (null for RMSNorm).
template <bool Centered>
void row_norm_forward(const float* x, const float* weight, const float* bias, float* y,
                      std::size_t rows, std::size_t features, double eps, cudaStream_t stream) {
  kernels::row_norm_forward<Centered><<<norm_blocks(rows), kernels::norm_threads, 0, stream>>>(
      x, weight, bias, y, rows, features, eps);
  LOOM_CUDA_LAUNCH_CHECK("row_norm_forward");
}

// dx (when not null) and the parameters' gradients (dbias: LayerNorm's),
// overwritten; `work` holds row_norm_scratch_bytes(rows, features).
template <bool Centered>
void row_norm_backward(const float* x, const float* weight, const float* dy, float* dx,
                       float* dweight, float* dbias, std::size_t rows, std::size_t features,
                       double eps, unsigned char* work, cudaStream_t stream) {
  auto* moments = reinterpret_cast<double*>(work);
  double* partials = moments + 2 * rows;
  kernels::row_norm_backward<Centered><<<norm_blocks(rows), kernels::norm_threads, 0, stream>>>(
      x, weight, dy, dx, moments, rows, features, eps);
  LOOM_CUDA_LAUNCH_CHECK("row_norm_backward");
  const std::size_t chunks = norm_chunks(rows);
  LOOM_CHECK(chunks <= 65535, "row_norm_backward: ", rows, " rows of ", features,
             " features are more than the ", 65535 * norm_chunk_rows,
             " its parameter sums take; use a smaller batch");
  const dim3 grid(static_cast<unsigned>((features + block_threads - 1) / block_threads),
                  static_cast<unsigned>(chunks));
  kernels::row_norm_param_partials<Centered><<<grid, block_threads, 0, stream>>>(
      x, dy, moments, partials, rows, features, norm_chunk_rows);
  LOOM_CUDA_LAUNCH_CHECK("row_norm_param_partials");
  const std::size_t count = (Centered ? 2 : 1) * features;
  kernels::row_norm_param_sums<<<grid_blocks(count), block_threads, 0, stream>>>(
      partials, dweight, dbias, chunks, features, count);
  LOOM_CUDA_LAUNCH_CHECK("row_norm_param_sums");
}

inline unsigned warp_row_blocks(std::size_t rows) {
  return static_cast<unsigned>(std::min<std::size_t>((rows + 7) / 8, 65535));
}

inline void causal_softmax_forward(float* p, std::size_t rows, std::size_t context,
                                   cudaStream_t stream) {
  kernels::causal_softmax_forward<<<warp_row_blocks(rows), 256, 0, stream>>>(p, rows, context);
  LOOM_CUDA_LAUNCH_CHECK("causal_softmax_forward");
}

inline void causal_softmax_backward(const float* p, float* dp, std::size_t rows,
                                    std::size_t context, cudaStream_t stream) {
  kernels::causal_softmax_backward<<<warp_row_blocks(rows), 256, 0, stream>>>(p, dp, rows,
                                                                              context);
  LOOM_CUDA_LAUNCH_CHECK("causal_softmax_backward");
}

inline void rotary_turn(float* qkv, std::size_t rows, std::size_t context, std::size_t inner,
                        std::size_t head_width, double theta, bool back, cudaStream_t stream) {
  const std::size_t count = rows * inner;  // (row, q or k, head, pair): 2 x inner / 2
  kernels::rotary_turn<<<grid_blocks(count), block_threads, 0, stream>>>(
      qkv, rows, context, inner, head_width, theta, back);
  LOOM_CUDA_LAUNCH_CHECK("rotary_turn");
}

}  // namespace loom::gpu
