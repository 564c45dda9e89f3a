// GRU<Hidden> and LSTM<Hidden> over a sequence input Shape<Steps, Features>,
// with PyTorch's equations, gate order and parameter layout: weight_ih
// [G*H, F], weight_hh [G*H, H], bias_ih [G*H], bias_hh [G*H] (G = 3 gates
// r, z, n for the GRU; 4 gates i, f, g, o for the LSTM). The initial state
// is zero. Output: the last hidden state, Shape<Hidden>, or with
// Sequence = true every step's, Shape<Steps, Hidden> (to stack layers).
// Bidirectional = true adds a second direction that runs from each
// sample's last step to its first, with its own four tensors (PyTorch's
// names with the suffix _reverse) after the first direction's; each step's
// output is [forward h, reverse h], 2 * Hidden wide, as PyTorch concatenates.
//
// Lengths (LayerContext::frames): sample s runs its steps 0..len-1 only, as
// PyTorch's pack_padded_sequence does: every step at or past len outputs
// zero, Sequence = false outputs the state after step len - 1 (the reverse
// direction's after step 0, having started at step len - 1), and backward
// reads no dy and writes zero dx there. No value at or past len reaches a
// result: the input projection's GEMM runs over every row, padding too, and
// its padded rows are never used. A length of 0 gives zeros.
//
// Forward runs the input projection of all steps as one GEMM, then one
// GEMM per step for the recurrent projection; each step's gate values and
// state are saved for backward (back-propagation through time), which runs
// the steps in reverse and ends with one GEMM each for the input weights'
// gradient and the input gradient. The directions run one after the other
// through the same workspace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "../backend/cpu/cpu.hpp"
#include "../core/host_device.hpp"
#include "layer.hpp"
#include "pointwise.hpp"

namespace loom {

template <std::size_t Hidden_, bool Sequence_ = false, bool Bidirectional_ = false>
struct GRU {
  static constexpr std::size_t hidden = Hidden_;
  static constexpr bool sequence = Sequence_;
  static constexpr bool bidirectional = Bidirectional_;
};

template <std::size_t Hidden_, bool Sequence_ = false, bool Bidirectional_ = false>
struct LSTM {
  static constexpr std::size_t hidden = Hidden_;
  static constexpr bool sequence = Sequence_;
  static constexpr bool bidirectional = Bidirectional_;
};

// Both directions, every step: Steps x 2H, as a speech encoder stacks them.
template <std::size_t Hidden>
using BiGRU = GRU<Hidden, true, true>;
template <std::size_t Hidden>
using BiLSTM = LSTM<Hidden, true, true>;

namespace detail {

template <class T>
LOOM_HOST_DEVICE T sigmoid(T x) {
  return SigmoidFn::forward(x);
}
template <class T>
LOOM_HOST_DEVICE T tanh(T x) {
  return TanhFn::forward(x);
}

// f(j, prev) for every unit j < H, written for the vectoriser:
// - one loop for a first step (prev null) and one for the others, so that no
//   loop tests prev per unit: g++ does not hoist that test (it guards a
//   load), and a test in a loop stops its vectorisation;
// - ivdep: unit j reads and writes element j of each vector and nothing
//   else, and the vectors are distinct, so no iteration depends on another;
//   g++ cannot prove that of a dozen pointers, and gives up on the run-time
//   alias checks it would need.
template <class T, class F>
void for_each_unit(std::size_t H, const T* prev, F f) {
  if (prev != nullptr) {
    LOOM_IVDEP
    for (std::size_t j = 0; j < H; ++j) f(j, prev);
  } else {
    LOOM_IVDEP
    for (std::size_t j = 0; j < H; ++j) f(j, static_cast<const T*>(nullptr));
  }
}

// One GRU step for one sample. Saved block per step: r, z, n, the
// recurrent n-projection (W_hn h + b_hn, which r multiplies), h. step_at and
// step_back_at compute element j of every vector and touch nothing else, so
// the CPU loops over j and the CUDA runner gives each j a thread: both run
// the same equations (in float, tanh and the sigmoid are loom's on the CPU
// and CUDA's on the GPU: see TanhFn).
struct GruCell {
  static constexpr std::size_t gates = 3;
  static constexpr std::size_t blocks = 5;
  static constexpr std::size_t h_block = 4;
  static constexpr std::string_view kind = "gru";
  static constexpr std::string_view name = "GRU";

  // xg: input projections (+ b_ih); hg: recurrent ones (+ b_hh); prev: the
  // previous step's block or nullptr (zero state).
  template <class T>
  LOOM_HOST_DEVICE static void step_at(std::size_t H, std::size_t j, const T* xg, const T* hg,
                                       const T* prev, T* cur) {
    const T r = sigmoid(xg[j] + hg[j]);
    const T z = sigmoid(xg[H + j] + hg[H + j]);
    const T hn = hg[2 * H + j];
    const T n = detail::tanh(xg[2 * H + j] + r * hn);
    const T h_prev = prev != nullptr ? prev[h_block * H + j] : T(0);
    cur[j] = r;
    cur[H + j] = z;
    cur[2 * H + j] = n;
    cur[3 * H + j] = hn;
    cur[4 * H + j] = (T(1) - z) * n + z * h_prev;
  }
  template <class T>
  static void step(std::size_t H, const T* xg, const T* hg, const T* prev, T* cur) {
    for_each_unit(H, prev, [=](std::size_t j, const T* p) { step_at(H, j, xg, hg, p, cur); });
  }

  // dh: d(loss)/d(h_t). Writes the pre-activation gradients of the input
  // (dgi) and recurrent (dgh) projections and the part of d(loss)/d(h_t-1)
  // that does not go through W_hh (dh_prev).
  template <class T>
  LOOM_HOST_DEVICE static void step_back_at(std::size_t H, std::size_t j, const T* cur,
                                            const T* prev, const T* dh, T*, T* dgi, T* dgh,
                                            T* dh_prev) {
    const T r = cur[j], z = cur[H + j], n = cur[2 * H + j], hn = cur[3 * H + j];
    const T h_prev = prev != nullptr ? prev[h_block * H + j] : T(0);
    const T dn = dh[j] * (T(1) - z);
    const T dz = dh[j] * (h_prev - n);
    const T dan = dn * (T(1) - n * n);
    const T dar = dan * hn * r * (T(1) - r);
    const T daz = dz * z * (T(1) - z);
    dgi[j] = dar;
    dgi[H + j] = daz;
    dgi[2 * H + j] = dan;
    dgh[j] = dar;
    dgh[H + j] = daz;
    dgh[2 * H + j] = dan * r;
    dh_prev[j] = dh[j] * z;
  }
  template <class T>
  static void step_back(std::size_t H, const T* cur, const T* prev, const T* dh, T* dc, T* dgi,
                        T* dgh, T* dh_prev) {
    for_each_unit(H, prev, [=](std::size_t j, const T* p) {
      step_back_at(H, j, cur, p, dh, dc, dgi, dgh, dh_prev);
    });
  }
};

// One LSTM step. Saved block per step: i, f, g, o, c, h.
struct LstmCell {
  static constexpr std::size_t gates = 4;
  static constexpr std::size_t blocks = 6;
  static constexpr std::size_t h_block = 5;
  static constexpr std::string_view kind = "lstm";
  static constexpr std::string_view name = "LSTM";

  template <class T>
  LOOM_HOST_DEVICE static void step_at(std::size_t H, std::size_t j, const T* xg, const T* hg,
                                       const T* prev, T* cur) {
    const T i = sigmoid(xg[j] + hg[j]);
    const T f = sigmoid(xg[H + j] + hg[H + j]);
    const T g = detail::tanh(xg[2 * H + j] + hg[2 * H + j]);
    const T o = sigmoid(xg[3 * H + j] + hg[3 * H + j]);
    const T c_prev = prev != nullptr ? prev[4 * H + j] : T(0);
    const T c = f * c_prev + i * g;
    cur[j] = i;
    cur[H + j] = f;
    cur[2 * H + j] = g;
    cur[3 * H + j] = o;
    cur[4 * H + j] = c;
    cur[5 * H + j] = o * detail::tanh(c);
  }
  template <class T>
  static void step(std::size_t H, const T* xg, const T* hg, const T* prev, T* cur) {
    for_each_unit(H, prev, [=](std::size_t j, const T* p) { step_at(H, j, xg, hg, p, cur); });
  }

  // dc carries d(loss)/d(c_t) in and d(loss)/d(c_t-1) out.
  template <class T>
  LOOM_HOST_DEVICE static void step_back_at(std::size_t H, std::size_t j, const T* cur,
                                            const T* prev, const T* dh, T* dc, T* dgi, T* dgh,
                                            T* dh_prev) {
    const T i = cur[j], f = cur[H + j], g = cur[2 * H + j], o = cur[3 * H + j];
    const T c = cur[4 * H + j];
    const T c_prev = prev != nullptr ? prev[4 * H + j] : T(0);
    const T tc = detail::tanh(c);
    const T dcj = dc[j] + dh[j] * o * (T(1) - tc * tc);
    const T dai = dcj * g * i * (T(1) - i);
    const T daf = dcj * c_prev * f * (T(1) - f);
    const T dag = dcj * i * (T(1) - g * g);
    const T dao = dh[j] * tc * o * (T(1) - o);
    dgi[j] = dgh[j] = dai;
    dgi[H + j] = dgh[H + j] = daf;
    dgi[2 * H + j] = dgh[2 * H + j] = dag;
    dgi[3 * H + j] = dgh[3 * H + j] = dao;
    dc[j] = dcj * f;
    dh_prev[j] = T(0);
  }
  template <class T>
  static void step_back(std::size_t H, const T* cur, const T* prev, const T* dh, T* dc, T* dgi,
                        T* dgh, T* dh_prev) {
    for_each_unit(H, prev, [=](std::size_t j, const T* p) {
      step_back_at(H, j, cur, p, dh, dc, dgi, dgh, dh_prev);
    });
  }
};

template <class Spec, class Cell_, class In, std::size_t Index>
struct RecurrentLayer
    : LayerBase<
          Spec, In,
          std::conditional_t<Spec::sequence,
                             Shape<dim_or_one<In, 0>, (Spec::bidirectional ? 2 : 1) * Spec::hidden>,
                             Shape<(Spec::bidirectional ? 2 : 1) * Spec::hidden>>,
          Index> {
  static constexpr bool checked = layer_argument_must_be_positive<Index, Spec, Spec::hidden>::ok &&
                                  layer_input_rank_mismatch<Index, Spec, 2, In::rank>::ok;
  using Cell = Cell_;
  static constexpr std::size_t H = Spec::hidden;
  static constexpr std::size_t directions = Spec::bidirectional ? 2 : 1;
  static constexpr std::size_t width = directions * H;  // output values per step
  static constexpr std::size_t steps = dim_or_one<In, 0>;
  static constexpr std::size_t features = dim_or_one<In, 1>;
  static constexpr std::size_t GH = Cell::gates * H;
  static constexpr std::size_t block = Cell::blocks * H;          // saved per step
  static constexpr std::size_t direction_stride = steps * block;  // saved per sample, direction
  static constexpr std::size_t stride = directions * direction_stride;  // saved per sample

  // One direction's tensors in PyTorch's order; the reverse direction's
  // follow at direction_params.
  static constexpr std::size_t w_ih = 0;
  static constexpr std::size_t w_hh = w_ih + GH * features;
  static constexpr std::size_t b_ih = w_hh + GH * H;
  static constexpr std::size_t b_hh = b_ih + GH;
  static constexpr std::size_t direction_params = b_hh + GH;
  static constexpr std::size_t param_count = directions * direction_params;
  // Where the GPU model splits the parameters into its weight and bias
  // blocks: before the first bias. A bidirectional layer's reverse tensors
  // fall in the bias block, where cuDNN's runner (gpu/cudnn_rnn.cuh) finds
  // them; the per-step runner inside a Residual block refuses that form.
  static constexpr std::size_t weight_count = b_ih;
  static constexpr std::size_t bias_count = param_count - weight_count;

  static constexpr bool contextual = true;
  static constexpr std::size_t saved = stride;
  // Input projections of every step (their gradients in backward), one
  // step's recurrent projections (their gradients), and three H vectors:
  // d(loss)/d(h), its next value and the LSTM's d(loss)/d(c). The
  // directions take turns with it.
  static constexpr std::size_t workspace = steps * GH + GH + 3 * H;
  static constexpr std::size_t forward_flops =
      directions * steps * (2 * GH * (features + H) + 8 * H);
  static constexpr std::size_t backward_flops =
      directions * steps * (4 * GH * (features + H) + 16 * H);
  static constexpr std::string_view kind = Cell::kind;

  template <class Visit>
  static void tensors(Visit&& visit) {
    visit("weight_ih_l0", w_ih, {GH, features}, false);
    visit("weight_hh_l0", w_hh, {GH, H}, false);
    visit("bias_ih_l0", b_ih, {GH}, false);
    visit("bias_hh_l0", b_hh, {GH}, false);
    if constexpr (directions == 2) {
      visit("weight_ih_l0_reverse", direction_params + w_ih, {GH, features}, false);
      visit("weight_hh_l0_reverse", direction_params + w_hh, {GH, H}, false);
      visit("bias_ih_l0_reverse", direction_params + b_ih, {GH}, false);
      visit("bias_hh_l0_reverse", direction_params + b_hh, {GH}, false);
    }
  }

  // PyTorch's initialisation: every parameter uniform in +-1/sqrt(H).
  template <class T>
  static void init(T* params, std::uint64_t seed, bool) {
    init_uniform(params, param_count, 1.0 / std::sqrt(static_cast<double>(H)), seed, Index);
  }

  template <class T>
  static void forward(const T* params, const T* x, T* y, T* work, std::size_t n,
                      const LayerContext<T>& context) {
    const std::int32_t* frames = checked_frames(context, n);
    for (std::size_t d = 0; d < directions; ++d)
      forward_direction(d == 1, params + d * direction_params, x, y + d * H, work, n,
                        context.saved + d * direction_stride, frames);
  }

  template <class T>
  static void backward(const T* params, const T* x, const T*, const T* dy, T* dx, T* dparams,
                       T* work, std::size_t n, bool accumulate, const LayerContext<T>& context) {
    const std::int32_t* frames = checked_frames(context, n);
    for (std::size_t d = 0; d < directions; ++d)
      backward_direction(d == 1, params + d * direction_params, x, dy + d * H, dx,
                         dparams + d * direction_params, work, n, accumulate,
                         context.saved + d * direction_stride, frames);
    if (dx != nullptr && frames != nullptr)
      for (std::size_t s = 0; s < n; ++s)
        std::fill(dx + (s * steps + length(frames, s)) * features, dx + (s + 1) * steps * features,
                  T(0));
  }

 private:
  static std::size_t length(const std::int32_t* frames, std::size_t s) {
    return frames != nullptr ? static_cast<std::size_t>(frames[s]) : steps;
  }

  template <class T>
  static const std::int32_t* checked_frames(const LayerContext<T>& context, std::size_t n) {
    if (context.frames != nullptr)
      for (std::size_t s = 0; s < n; ++s)
        LOOM_CHECK(context.frames[s] >= 0 && static_cast<std::size_t>(context.frames[s]) <= steps,
                   Cell::name, " (", layer_path_text(Index), "): sample ", context.pass.first_sample + s,
                   " has ", context.frames[s], " frames, outside 0..", steps,
                   " (the steps of its input)");
    return context.frames;
  }

  // The steps any sample runs.
  static std::size_t longest(const std::int32_t* frames, std::size_t n) {
    if (frames == nullptr) return steps;
    std::size_t most = 0;
    for (std::size_t s = 0; s < n; ++s) most = std::max(most, length(frames, s));
    return most;
  }

  // One direction. Its u-th step of sample s is time step u, or len - 1 - u
  // in reverse; the saved blocks go in the order the steps run (u), so that
  // step u - 1's states of every sample are one strided matrix for the
  // recurrent GEMM. y: this direction's first output column, rows `width`
  // apart; saved: its first block, samples `stride` apart.
  template <class T>
  static void forward_direction(bool reverse, const T* params, const T* x, T* y, T* work,
                                std::size_t n, T* saved_all, const std::int32_t* frames) {
    T* xg = work;
    T* hg = work + n * steps * GH;
    cpu::gemm<T>(false, true, n * steps, GH, features, T(1), x, features, params + w_ih, features,
                 T(0), xg, GH);
    cpu::bias_act_rows<Act::identity>(xg, params + b_ih, n * steps, GH);
    if (frames != nullptr) {
      // Steps a sample does not run hold zeros, so that the recurrent GEMMs'
      // rows for it (forward, and dW_hh's backward) read finite values.
      for (std::size_t s = 0; s < n; ++s) {
        const std::size_t len = length(frames, s);
        T* sample = saved_all + s * stride;
        std::fill(sample + len * block, sample + direction_stride, T(0));
        if constexpr (Spec::sequence) {
          for (std::size_t t = len; t < steps; ++t)
            std::fill_n(y + (s * steps + t) * width, H, T(0));
        } else if (len == 0) {
          std::fill_n(y + s * width, H, T(0));
        }
      }
    }
    const std::size_t active = longest(frames, n);
    for (std::size_t u = 0; u < active; ++u) {
      if (u == 0) {
        for (std::size_t s = 0; s < n; ++s) std::copy_n(params + b_hh, GH, hg + s * GH);
      } else {
        const T* h_prev = saved_all + (u - 1) * block + Cell::h_block * H;
        cpu::gemm<T>(false, true, n, GH, H, T(1), h_prev, stride, params + w_hh, H, T(0), hg, GH);
        cpu::bias_act_rows<Act::identity>(hg, params + b_hh, n, GH);
      }
      for (std::size_t s = 0; s < n; ++s) {
        const std::size_t len = length(frames, s);
        if (u >= len) continue;
        const std::size_t t = reverse ? len - 1 - u : u;
        T* sample = saved_all + s * stride;
        Cell::step(H, xg + (s * steps + t) * GH, hg + s * GH,
                   u > 0 ? sample + (u - 1) * block : nullptr, sample + u * block);
        const T* h = sample + u * block + Cell::h_block * H;
        if constexpr (Spec::sequence)
          std::copy_n(h, H, y + (s * steps + t) * width);
        else if (u + 1 == len)
          std::copy_n(h, H, y + s * width);
      }
    }
  }

  // dy: this direction's first column of the output gradient, rows `width`
  // apart. dx is written by the first direction and added to by the second.
  template <class T>
  static void backward_direction(bool reverse, const T* params, const T* x, const T* dy, T* dx,
                                 T* dparams, T* work, std::size_t n, bool accumulate,
                                 const T* saved_all, const std::int32_t* frames) {
    T* dgi = work;
    T* dgh = work + n * steps * GH;
    // Three n x H buffers: d(loss)/d(h_t), d(loss)/d(h_t-1), d(loss)/d(c_t).
    T* dh = dgh + n * GH;
    T* dh_prev = dh + n * H;
    T* dc = dh_prev + n * H;
    if (!accumulate) std::fill(dparams + w_hh, dparams + b_ih, T(0));
    if (!accumulate) std::fill(dparams + b_hh, dparams + b_hh + GH, T(0));
    std::fill(dh, dh + n * H, T(0));
    std::fill(dc, dc + n * H, T(0));
    // Padding's gate gradients are zero: b_ih's column sums and dx's GEMM
    // run over every row.
    if (frames != nullptr)
      for (std::size_t s = 0; s < n; ++s)
        std::fill(dgi + (s * steps + length(frames, s)) * GH, dgi + (s + 1) * steps * GH, T(0));
    for (std::size_t u = longest(frames, n); u-- > 0;) {
      for (std::size_t s = 0; s < n; ++s) {
        const std::size_t len = length(frames, s);
        if (u >= len) {
          // Not started yet (backward runs the steps in reverse): no
          // gradient flows, and the GEMMs below add nothing for it.
          std::fill_n(dgh + s * GH, GH, T(0));
          std::fill_n(dh_prev + s * H, H, T(0));
          continue;
        }
        const std::size_t t = reverse ? len - 1 - u : u;
        T* d = dh + s * H;
        if constexpr (Spec::sequence) {
          const T* g = dy + (s * steps + t) * width;
          for (std::size_t j = 0; j < H; ++j) d[j] += g[j];
        } else if (u + 1 == len) {
          std::copy_n(dy + s * width, H, d);
        }
        const T* sample = saved_all + s * stride;
        Cell::step_back(H, sample + u * block, u > 0 ? sample + (u - 1) * block : nullptr, d,
                        dc + s * H, dgi + (s * steps + t) * GH, dgh + s * GH, dh_prev + s * H);
        for (std::size_t g = 0; g < GH; ++g) dparams[b_hh + g] += dgh[s * GH + g];
      }
      if (u > 0) {
        const T* h_prev = saved_all + (u - 1) * block + Cell::h_block * H;
        cpu::gemm<T>(true, false, GH, H, n, T(1), dgh, GH, h_prev, stride, T(1), dparams + w_hh, H);
        cpu::gemm<T>(false, false, n, H, GH, T(1), dgh, GH, params + w_hh, H, T(1), dh_prev, H);
      }
      std::swap(dh, dh_prev);
    }
    const std::size_t rows = n * steps;
    if (frames == nullptr) {
      cpu::gemm<T>(true, false, GH, features, rows, T(1), dgi, GH, x, features,
                   accumulate ? T(1) : T(0), dparams + w_ih, features);
    } else {
      // Each sample's own steps only: a padding row of x may hold anything
      // (NaN times its zero gradient would be NaN).
      bool added = accumulate;
      for (std::size_t s = 0; s < n; ++s) {
        const std::size_t len = length(frames, s);
        if (len == 0) continue;
        cpu::gemm<T>(true, false, GH, features, len, T(1), dgi + s * steps * GH, GH,
                     x + s * steps * features, features, added ? T(1) : T(0), dparams + w_ih,
                     features);
        added = true;
      }
      if (!added) std::fill(dparams + w_ih, dparams + w_hh, T(0));
    }
    // The input bias gradient: column sums of dgi, taken row by row (a
    // column's walk jumps GH values per row) into dgh, free by now; each
    // column still adds its rows in order.
    T* sums = dgh;
    std::fill(sums, sums + GH, T(0));
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t g = 0; g < GH; ++g) sums[g] += dgi[r * GH + g];
    for (std::size_t g = 0; g < GH; ++g)
      dparams[b_ih + g] = accumulate ? dparams[b_ih + g] + sums[g] : sums[g];
    if (dx != nullptr)
      cpu::gemm<T>(false, false, rows, features, GH, T(1), dgi, GH, params + w_ih, features,
                   reverse ? T(1) : T(0), dx, features);
  }
};

}  // namespace detail

template <std::size_t H, bool Seq, bool Bi, class In, std::size_t Index>
struct Bind<GRU<H, Seq, Bi>, In, Index>
    : detail::RecurrentLayer<GRU<H, Seq, Bi>, detail::GruCell, In, Index> {};
template <std::size_t H, bool Seq, bool Bi, class In, std::size_t Index>
struct Bind<LSTM<H, Seq, Bi>, In, Index>
    : detail::RecurrentLayer<LSTM<H, Seq, Bi>, detail::LstmCell, In, Index> {};

}  // namespace loom
