// Connectionist temporal classification (CTC) on the CPU: the loss of a label
// sequence given per-frame scores, its gradient, greedy decoding and the edit
// distance that scores a decoding. Blank is class 0. The loss matches
// PyTorch's ctc_loss(log_softmax(x), reduction='mean'): each sample's loss is
// divided by its target length, and the caller divides the sum by the batch.
//
// The forward-backward recursions run in double whatever T is: they add up
// probabilities over every alignment, where float's log-sum-exp loses digits
// on long utterances, and they cost a few multiply-adds per frame and label.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "../../core/error.hpp"

namespace loom::cpu {

struct CtcSums {
  double loss = 0;           // sum over samples of loss_i / target_length_i
  std::size_t infinite = 0;  // samples too short for their targets, zeroed under zero_infinity
};

namespace detail {

// Adjacent equal labels: each pair needs a blank frame between its two labels.
inline std::size_t ctc_repeats(const std::int32_t* target, std::size_t length) {
  std::size_t repeats = 0;
  for (std::size_t k = 1; k < length; ++k) repeats += target[k] == target[k - 1] ? 1 : 0;
  return repeats;
}

// Checks sample i's sizes and labels (loom::Error naming the sample) and
// says whether its target fits its frames: false when target length plus
// repeats exceeds them, an error unless zero_infinity. Shared with the CUDA
// op, so both backends reject the same inputs with the same words.
inline bool ctc_check_sample(std::size_t i, std::size_t max_frames, std::size_t classes,
                             const std::int32_t* frames, const std::int32_t* targets,
                             std::size_t max_target, const std::int32_t* target_lengths,
                             bool zero_infinity, std::size_t first_sample) {
  const std::size_t sample = first_sample + i;
  const std::int32_t t = frames[i];
  const std::int32_t length = target_lengths[i];
  LOOM_CHECK(t >= 1 && static_cast<std::size_t>(t) <= max_frames, "ctc_loss: sample ", sample,
             " has ", t, " frames, outside 1..", max_frames,
             " (the batch's frame count); check the frame lengths given with the batch");
  LOOM_CHECK(length >= 1 && static_cast<std::size_t>(length) <= max_target, "ctc_loss: sample ",
             sample, " has target length ", length, ", outside 1..", max_target,
             " (the batch's padded target width); check the target lengths given with the batch");
  const std::int32_t* target = targets + i * max_target;
  for (std::int32_t k = 0; k < length; ++k)
    LOOM_CHECK(target[k] >= 1 && static_cast<std::size_t>(target[k]) < classes, "ctc_loss: label ",
               target[k], " at position ", k, " of sample ", sample, " is outside 1..", classes - 1,
               " (class 0 is the blank); check the targets' encoding");
  const std::size_t repeats = ctc_repeats(target, static_cast<std::size_t>(length));
  const bool fits = static_cast<std::size_t>(length) + repeats <= static_cast<std::size_t>(t);
  LOOM_CHECK(fits || zero_infinity, "ctc_loss: sample ", sample, " has target length ", length,
             " with ", repeats, " repeats, which needs ",
             static_cast<std::size_t>(length) + repeats, " frames, but has ", t,
             " frames; give it more frames (less downsampling) or set zero_infinity to leave such "
             "samples out of the loss");
  return fits;
}

inline double log_add(double a, double b) {
  if (a == -std::numeric_limits<double>::infinity()) return b;
  if (b == -std::numeric_limits<double>::infinity()) return a;
  return a > b ? a + std::log1p(std::exp(b - a)) : b + std::log1p(std::exp(a - b));
}

}  // namespace detail

// dlogits (optional, n × max_frames × classes like logits): grad_scale ·
// d(loss_i / target_length_i)/d logits, softmax minus the posterior
// occupancy of each class, and exactly 0 at frames >= frames[i]. A sample
// whose target needs more frames than it has is a loom::Error, or with
// zero_infinity contributes 0 loss and 0 gradient and is counted in
// `infinite` (PyTorch's zero_infinity=True). first_sample is only for the
// messages: the data-set index of sample 0. Scratch is thread_local and only
// grows, so a training step allocates nothing after its first.
template <class T>
CtcSums ctc_loss(const T* logits, std::size_t n, std::size_t max_frames, std::size_t classes,
                 const std::int32_t* frames, const std::int32_t* targets, std::size_t max_target,
                 const std::int32_t* target_lengths, T grad_scale, T* dlogits, bool zero_infinity,
                 std::size_t first_sample) {
  constexpr double minus_inf = -std::numeric_limits<double>::infinity();
  LOOM_CHECK(classes >= 2, "ctc_loss: ", classes,
             " classes; CTC needs the blank (class 0) and at least one label");
  thread_local std::vector<double> scratch;
  thread_local std::vector<std::int32_t> extended;
  CtcSums sums;
  for (std::size_t i = 0; i < n; ++i) {
    const bool fits = detail::ctc_check_sample(i, max_frames, classes, frames, targets, max_target,
                                               target_lengths, zero_infinity, first_sample);
    T* grad = dlogits != nullptr ? dlogits + i * max_frames * classes : nullptr;
    if (grad != nullptr) std::fill(grad, grad + max_frames * classes, T(0));
    if (!fits) {
      ++sums.infinite;
      continue;
    }
    const auto t_len = static_cast<std::size_t>(frames[i]);
    const auto length = static_cast<std::size_t>(target_lengths[i]);
    const std::size_t states = 2 * length + 1;  // blank, l1, blank, l2, ..., blank
    extended.assign(states, 0);
    for (std::size_t k = 0; k < length; ++k) extended[2 * k + 1] = targets[i * max_target + k];
    // A state s may be entered from s-2 when it is a label other than s-2's.
    auto skips = [&](std::size_t s) {
      return s >= 2 && extended[s] != 0 && extended[s] != extended[s - 2];
    };

    scratch.resize(t_len * classes + 2 * t_len * states + classes);
    double* log_p = scratch.data();  // log_softmax of the sample's frames
    double* alpha = log_p + t_len * classes;
    double* beta = alpha + t_len * states;
    double* frame_grad = beta + t_len * states;
    const T* x = logits + i * max_frames * classes;
    for (std::size_t t = 0; t < t_len; ++t) {
      const T* scores = x + t * classes;
      double top = static_cast<double>(scores[0]);
      for (std::size_t c = 1; c < classes; ++c) top = std::max(top, static_cast<double>(scores[c]));
      double total = 0.0;
      for (std::size_t c = 0; c < classes; ++c)
        total += std::exp(static_cast<double>(scores[c]) - top);
      const double log_total = top + std::log(total);
      for (std::size_t c = 0; c < classes; ++c)
        log_p[t * classes + c] = static_cast<double>(scores[c]) - log_total;
    }

    // alpha[t][s]: log probability of the prefixes ending in state s at frame
    // t, frame t's emission included; beta[t][s]: of the suffixes from frame
    // t+1 on, given state s at frame t (frame t's emission excluded), so that
    // alpha + beta is the log probability of the paths through (t, s).
    std::fill(alpha, alpha + t_len * states, minus_inf);
    alpha[0] = log_p[0];
    alpha[1] = log_p[static_cast<std::size_t>(extended[1])];
    for (std::size_t t = 1; t < t_len; ++t) {
      const double* prev = alpha + (t - 1) * states;
      double* cur = alpha + t * states;
      for (std::size_t s = 0; s < states; ++s) {
        double a = prev[s];
        if (s >= 1) a = detail::log_add(a, prev[s - 1]);
        if (skips(s)) a = detail::log_add(a, prev[s - 2]);
        cur[s] = a == minus_inf ? minus_inf
                                : a + log_p[t * classes + static_cast<std::size_t>(extended[s])];
      }
    }
    const double* last = alpha + (t_len - 1) * states;
    const double log_likelihood = detail::log_add(last[states - 1], last[states - 2]);
    if (!std::isfinite(log_likelihood) && zero_infinity) {
      ++sums.infinite;  // an underflow PyTorch would also zero: the path exists, its probability
                        // does not
      continue;
    }
    const double scale = 1.0 / static_cast<double>(length);
    sums.loss -= log_likelihood * scale;
    if (grad == nullptr) continue;

    std::fill(beta, beta + t_len * states, minus_inf);
    beta[(t_len - 1) * states + states - 1] = 0.0;
    beta[(t_len - 1) * states + states - 2] = 0.0;
    for (std::size_t t = t_len - 1; t-- > 0;) {
      const double* next = beta + (t + 1) * states;
      double* cur = beta + t * states;
      const double* emit = log_p + (t + 1) * classes;
      auto through = [&](std::size_t s) {
        return next[s] == minus_inf ? minus_inf
                                    : next[s] + emit[static_cast<std::size_t>(extended[s])];
      };
      for (std::size_t s = 0; s < states; ++s) {
        double b = through(s);
        if (s + 1 < states) b = detail::log_add(b, through(s + 1));
        if (s + 2 < states && skips(s + 2)) b = detail::log_add(b, through(s + 2));
        cur[s] = b;
      }
    }

    // Softmax minus occupancy is formed in double and rounded to T once: in
    // float the two nearly cancel on confident frames.
    const double factor = static_cast<double>(grad_scale) * scale;
    for (std::size_t t = 0; t < t_len; ++t) {
      for (std::size_t c = 0; c < classes; ++c) frame_grad[c] = std::exp(log_p[t * classes + c]);
      for (std::size_t s = 0; s < states; ++s) {
        const double path = alpha[t * states + s] + beta[t * states + s];
        if (path != minus_inf)
          frame_grad[static_cast<std::size_t>(extended[s])] -= std::exp(path - log_likelihood);
      }
      for (std::size_t c = 0; c < classes; ++c)
        grad[t * classes + c] = static_cast<T>(frame_grad[c] * factor);
    }
  }
  return sums;
}

// Best path decoding: the arg-max class of each frame (the first maximum
// wins), repeats merged, blanks dropped. out[i] keeps its capacity, so a
// reused `out` allocates only while its sequences grow.
template <class T>
void greedy_decode(const T* logits, std::size_t n, std::size_t max_frames, std::size_t classes,
                   const std::int32_t* frames, std::vector<std::vector<std::int32_t>>& out) {
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    LOOM_CHECK(frames[i] >= 0 && static_cast<std::size_t>(frames[i]) <= max_frames,
               "greedy_decode: sample ", i, " has ", frames[i], " frames, outside 0..", max_frames);
    out[i].clear();
    std::int32_t previous = 0;
    for (std::size_t t = 0; t < static_cast<std::size_t>(frames[i]); ++t) {
      const T* row = logits + (i * max_frames + t) * classes;
      std::size_t best = 0;
      for (std::size_t c = 1; c < classes; ++c)
        if (row[c] > row[best]) best = c;
      const auto label = static_cast<std::int32_t>(best);
      if (label != 0 && label != previous) out[i].push_back(label);
      previous = label;
    }
  }
}

// Levenshtein distance: the fewest insertions, deletions and substitutions
// that turn hyp into ref (word or label error counts).
inline std::size_t edit_distance(std::span<const std::int32_t> hyp,
                                 std::span<const std::int32_t> ref) {
  thread_local std::vector<std::size_t> row;
  row.resize(ref.size() + 1);
  for (std::size_t j = 0; j <= ref.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= hyp.size(); ++i) {
    std::size_t diagonal = row[0];  // row i-1, column j-1
    row[0] = i;
    for (std::size_t j = 1; j <= ref.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (hyp[i - 1] == ref[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[ref.size()];
}

}  // namespace loom::cpu
