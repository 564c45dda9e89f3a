// Layers over time with a length per sample: Conv1d and BatchNorm1d over a
// time-major Frames x C. Forward against plain references written here (in
// double and float), backward against central finite differences in
// double, and padding held to change nothing: NaN written into it, a padded
// batch against its samples one at a time (Conv1d) and against its valid
// frames packed without padding (BatchNorm1d).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <loom/loom.hpp>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;
using loom::test::require_close;
using loom::test::require_equal;

namespace {

using Lengths = std::vector<std::int32_t>;

constexpr Pass training{.training = true, .seed = 7, .step = 3};
constexpr double eps = 1e-5;

std::size_t length_of(const Lengths* lengths, std::size_t s, std::size_t frames) {
  return lengths == nullptr ? frames : static_cast<std::size_t>((*lengths)[s]);
}

// A contextual layer L run on n samples in T: its parameters, input,
// output, workspace and running statistics (init_state's, or `state`).
template <class L, class T>
struct Run {
  std::size_t n;
  std::vector<T> params, x, y, work, state;
  LayerContext<T> context;

  Run(std::size_t samples, const std::vector<double>& p, const std::vector<double>& in,
      const Lengths* lengths, const Pass& pass, const std::vector<double>& initial_state = {})
      : n(samples),
        params(p.begin(), p.end()),
        x(in.begin(), in.end()),
        y(samples * L::output_shape::size, T(-99)),
        work(samples * L::workspace + 1),
        state(L::state_count) {
    if (initial_state.empty())
      L::template init_state<T>(state.data());
    else
      std::copy(initial_state.begin(), initial_state.end(), state.begin());
    context.pass = pass;
    context.state = state.data();
    context.frames = lengths == nullptr ? nullptr : lengths->data();
    forward();
  }
  void forward() {
    L::template forward<T>(params.data(), x.data(), y.data(), work.data(), n, context);
  }
  // dx and dparams for dy; dparams added to when `accumulate`.
  void backward(const std::vector<T>& dy, std::vector<T>& dx, std::vector<T>& dparams,
                bool accumulate = false) {
    L::template backward<T>(params.data(), x.data(), y.data(), dy.data(), dx.data(), dparams.data(),
                            work.data(), n, accumulate, context);
  }
};

// L(x, p) = sum(forward(x, p) * r) in double: backward with dy = r gives
// dL/dx and dL/dp, compared with central differences over every element
// (padding included: nothing there may reach the output, so its numeric
// gradient is 0). Then accumulate = true adds to what is there.
template <class L>
void check_gradients(std::size_t n, const Lengths* lengths, const Pass& pass, std::uint64_t seed,
                     const std::vector<double>& state = {}) {
  constexpr std::size_t in = L::input_shape::size, out = L::output_shape::size;
  auto params = random_vector<double>(L::param_count, seed + 1, -0.5, 0.5);
  for (std::size_t i = 0; i < L::weight_count && L::kind.starts_with("batchnorm"); ++i)
    params[i] += 1.0;  // gamma around 1, as trained ones are
  auto x = random_vector<double>(n * in, seed + 2);
  const auto r = random_vector<double>(n * out, seed + 3);

  Run<L, double> run(n, params, x, lengths, pass, state);
  std::vector<double> dx(n * in, -99.0), dparams(L::param_count, -99.0);
  run.backward(r, dx, dparams);

  auto objective = [&](const std::vector<double>& p, const std::vector<double>& v) {
    const auto y = Run<L, double>(n, p, v, lengths, pass, state).y;
    double sum = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  using test::central_differences;
  require_close(dx, central_differences(x, [&](const auto& v) { return objective(params, v); }),
                {1e-7, 1e-6}, "dL/dx");
  require_close(dparams,
                central_differences(params, [&](const auto& p) { return objective(p, x); }),
                {1e-7, 1e-6}, "dL/dparams");

  std::vector<double> accumulated(L::param_count, 0.25), unused(n * in);
  run.backward(r, unused, accumulated, true);
  for (auto& g : dparams) g += 0.25;
  require_close(accumulated, dparams, {1e-12, 1e-12}, "accumulated gradient");
}

// Writes NaN into every frame of x (n samples of Frames x C) at or past its
// sample's length.
template <class T>
void poison_padding(std::vector<T>& x, std::size_t frames, std::size_t channels,
                    const Lengths& lengths) {
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t t = static_cast<std::size_t>(lengths[s]); t < frames; ++t)
      for (std::size_t c = 0; c < channels; ++c)
        x[(s * frames + t) * channels + c] = std::numeric_limits<T>::quiet_NaN();
}

// Requires every element of v at or past its sample's length to be +0 or -0.
template <class T>
void require_zero_padding(const std::vector<T>& v, std::size_t frames, std::size_t channels,
                          const Lengths& lengths, const std::string& what) {
  for (std::size_t s = 0; s < lengths.size(); ++s)
    for (std::size_t t = static_cast<std::size_t>(lengths[s]); t < frames; ++t)
      for (std::size_t c = 0; c < channels; ++c)
        if (!(v[(s * frames + t) * channels + c] == T(0)))
          FAIL(what << ": sample " << s << ", frame " << t << ", channel " << c << " holds "
                    << v[(s * frames + t) * channels + c] << ", not 0");
}

// ---------------------------------------------------------------- Conv1d

struct Conv1dDims {
  std::size_t n, frames, c, out, k, stride, pad, dilation;
  // PyTorch's L_out for an input of f frames, 0 when the window does not fit.
  std::size_t out_frames(std::size_t f) const {
    const std::size_t span = dilation * (k - 1) + 1;
    return f + 2 * pad >= span ? (f + 2 * pad - span) / stride + 1 : 0;
  }
};

// Direct convolution of each sample cut to its length, as PyTorch's Conv1d
// defines it on (1, C, length): x [n, frames, c], weight [out, c, k], bias
// [out] -> y [n, out_frames(frames), out], zero past each output length.
std::vector<double> conv1d_reference(const Conv1dDims& d, const std::vector<double>& x,
                                     const std::vector<double>& params, const Lengths* lengths) {
  const std::size_t of = d.out_frames(d.frames);
  const double* weight = params.data();
  const double* bias = params.data() + d.out * d.c * d.k;
  std::vector<double> y(d.n * of * d.out, 0.0);
  for (std::size_t b = 0; b < d.n; ++b) {
    const std::size_t length = length_of(lengths, b, d.frames);
    for (std::size_t t = 0; t < d.out_frames(length); ++t)
      for (std::size_t o = 0; o < d.out; ++o) {
        double sum = bias[o];
        for (std::size_t c = 0; c < d.c; ++c)
          for (std::size_t k = 0; k < d.k; ++k) {
            const long at =
                static_cast<long>(t * d.stride + k * d.dilation) - static_cast<long>(d.pad);
            if (at < 0 || at >= static_cast<long>(length)) continue;
            sum += weight[(o * d.c + c) * d.k + k] *
                   x[(b * d.frames + static_cast<std::size_t>(at)) * d.c + c];
          }
        y[(b * of + t) * d.out + o] = sum;
      }
  }
  return y;
}

std::vector<double> relu(std::vector<double> v) {
  for (auto& e : v) e = std::max(e, 0.0);
  return v;
}

template <std::size_t Out, std::size_t K, std::size_t S, std::size_t P, std::size_t D,
          std::size_t Frames, std::size_t C>
void check_conv1d(std::uint64_t seed) {
  using Plain = Bind<Conv1d<Out, K, S, P, D>, Shape<Frames, C>, 2>;
  using WithRelu = Bind<Fused<Conv1d<Out, K, S, P, D>, ReLU>, Shape<Frames, C>, 2>;
  constexpr std::size_t n = 4;
  const Conv1dDims d{n, Frames, C, Out, K, S, P, D};
  STATIC_REQUIRE(Plain::output_shape::rank == 2);
  REQUIRE(Plain::output_shape::dims[0] == d.out_frames(Frames));
  REQUIRE(Plain::output_shape::dims[1] == Out);
  // The shortest length with an output frame, the longest, and two between.
  const std::size_t shortest =
      std::max<std::size_t>(1, D * (K - 1) + 1 - std::min(2 * P, D * (K - 1)));
  const Lengths lengths{static_cast<std::int32_t>(Frames - 1), static_cast<std::int32_t>(shortest),
                        static_cast<std::int32_t>(Frames),
                        static_cast<std::int32_t>((Frames + shortest) / 2)};
  for (const auto length : lengths)
    REQUIRE(Plain::frames_out(static_cast<std::size_t>(length)) ==
            d.out_frames(static_cast<std::size_t>(length)));
  const auto params = random_vector<double>(Plain::param_count, seed, -0.5, 0.5);
  const auto x = random_vector<double>(n * Frames * C, seed + 9);
  for (const Lengths* l : {static_cast<const Lengths*>(nullptr), &lengths}) {
    const auto expected = conv1d_reference(d, x, params, l);
    const std::string what = l == nullptr ? " (every frame)" : " (with lengths)";
    require_close(Run<Plain, double>(n, params, x, l, training).y, expected, {1e-12, 1e-12},
                  "double forward" + what);
    require_close(Run<Plain, float>(n, params, x, l, training).y, expected, {1e-5, 1e-5},
                  "float forward" + what);
    require_close(Run<WithRelu, double>(n, params, x, l, training).y, relu(expected),
                  {1e-12, 1e-12}, "double forward, fused ReLU" + what);
    check_gradients<Plain>(n, l, training, seed + 20);
    check_gradients<WithRelu>(n, l, training, seed + 30);
  }
}

}  // namespace

TEST_CASE(
    "sequence layers: Conv1d's output length is PyTorch's rule, for the shape and per sample") {
  // (11 + 2 x 1 - 2 x (3 - 1) - 1) / 2 + 1 = 5 frames of 4 channels.
  using L = Bind<Conv1d<4, 3, 2, 1, 2>, Shape<11, 6>, 1>;
  STATIC_REQUIRE(std::is_same_v<L::output_shape, Shape<5, 4>>);
  STATIC_REQUIRE(ChangesFrames<L>);
  STATIC_REQUIRE(L::contextual);
  STATIC_REQUIRE(L::param_count == 4 * 6 * 3 + 4);
  STATIC_REQUIRE(L::frames_out(11) == 5);
  STATIC_REQUIRE(L::frames_out(4) == 1);  // (4 + 2 - 5) / 2 + 1
  STATIC_REQUIRE(L::frames_out(3) == 1);  // 3 + 2 = 5: the window just fits
  STATIC_REQUIRE(L::frames_out(2) == 0);  // 4 < 5: no output frame
  STATIC_REQUIRE(L::frames_out(6) == 2);
  STATIC_REQUIRE(std::is_same_v<Bind<Conv1d<8, 5>, Shape<20, 3>, 1>::output_shape, Shape<16, 8>>);
  STATIC_REQUIRE(Bind<Conv1d<8, 1>, Shape<20, 3>, 1>::frames_out(7) == 7);

  // In a network: fused with the ReLU after it, and the shapes that follow.
  using Net = Sequential<Input<20, 8>, Conv1d<16, 3, 2, 1>, ReLU, BatchNorm1d, ReLU, Linear<11>>;
  STATIC_REQUIRE(std::is_same_v<Net::output_shape, Shape<10, 11>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<0, Net::executed>,
                                Bind<Fused<Conv1d<16, 3, 2, 1>, ReLU>, Shape<20, 8>, 1>>);
  STATIC_REQUIRE(std::is_same_v<type_at_t<1, Net::executed>,
                                Bind<Fused<BatchNorm1d, ReLU>, Shape<10, 16>, 3>>);
  STATIC_REQUIRE(Net::parameter_count == (16 * 8 * 3 + 16) + 2 * 16 + (11 * 16 + 11));
}

TEST_CASE(
    "sequence layers: Conv1d forward matches direct convolution, backward matches finite "
    "differences") {
  SECTION("K 3, stride 1, no padding") { check_conv1d<4, 3, 1, 0, 1, 9, 3>(10); }
  SECTION("K 3, stride 2, padding 1") { check_conv1d<3, 3, 2, 1, 1, 10, 2>(20); }
  SECTION("K 2, dilation 3, padding 2") { check_conv1d<3, 2, 1, 2, 3, 8, 4>(30); }
  SECTION("K 4, stride 3, padding 1, dilation 2") { check_conv1d<2, 4, 3, 1, 2, 13, 3>(40); }
  SECTION("K 1") { check_conv1d<5, 1, 1, 0, 1, 6, 4>(50); }
}

TEST_CASE(
    "sequence layers: a padded Conv1d batch equals its samples run one at a time, bit for bit") {
  // One sample at a time, each with its own length, accumulating the
  // parameter gradients as micro-batches do. Sizes at which one sgemm over
  // the whole batch's rows rounds them unlike one over a sample's (5 x 48
  // = 240 columns, 64 filters).
  using L = Bind<Fused<Conv1d<64, 5, 2, 2, 2>, ReLU>, Shape<60, 48>, 2>;
  constexpr std::size_t n = 24, in = L::input_shape::size, out = L::output_shape::size;
  Lengths lengths(n);
  for (std::size_t s = 0; s < n; ++s) lengths[s] = static_cast<std::int32_t>(8 + (s * 13) % 53);
  const auto params = random_vector<double>(L::param_count, 60, -0.5, 0.5);
  const auto x = random_vector<double>(n * in, 61);
  const auto dy = random_vector<float>(n * out, 62);
  Run<L, float> batch(n, params, x, &lengths, training);
  std::vector<float> dx(n * in), dparams(L::param_count);
  batch.backward(dy, dx, dparams);

  std::vector<float> dparams_sum(L::param_count);
  for (std::size_t s = 0; s < n; ++s) {
    const Lengths own{lengths[s]};
    Run<L, float> one(
        1, params,
        {x.begin() + static_cast<long>(s * in), x.begin() + static_cast<long>((s + 1) * in)}, &own,
        training);
    std::vector<float> dx1(in);
    one.backward(
        {dy.begin() + static_cast<long>(s * out), dy.begin() + static_cast<long>((s + 1) * out)},
        dx1, dparams_sum, s > 0);
    require_equal(std::vector<float>(batch.y.begin() + static_cast<long>(s * out),
                                     batch.y.begin() + static_cast<long>((s + 1) * out)),
                  one.y, "output of sample " + std::to_string(s));
    require_equal(std::vector<float>(dx.begin() + static_cast<long>(s * in),
                                     dx.begin() + static_cast<long>((s + 1) * in)),
                  dx1, "input gradient of sample " + std::to_string(s));
  }
  require_equal(dparams, dparams_sum, "parameter gradients accumulated sample by sample");

  Lengths out_lengths(n);
  for (std::size_t s = 0; s < n; ++s)
    out_lengths[s] = static_cast<std::int32_t>(L::frames_out(static_cast<std::size_t>(lengths[s])));
  require_zero_padding(batch.y, L::out_frames, 64, out_lengths, "output");
  require_zero_padding(dx, 60, 48, lengths, "input gradient");
}

TEST_CASE("sequence layers: NaN in Conv1d's padding changes no output and no gradient") {
  using L = Bind<Conv1d<4, 3, 1, 1>, Shape<9, 3>, 2>;
  constexpr std::size_t n = 3, in = L::input_shape::size, out = L::output_shape::size;
  const Lengths lengths{9, 4, 6};
  Lengths out_lengths;
  for (const auto l : lengths)
    out_lengths.push_back(static_cast<std::int32_t>(L::frames_out(static_cast<std::size_t>(l))));
  const auto params = random_vector<double>(L::param_count, 70, -0.5, 0.5);
  const auto x = random_vector<double>(n * in, 71);
  auto dy = random_vector<float>(n * out, 72);
  Run<L, float> clean(n, params, x, &lengths, training);
  std::vector<float> dx(n * in), dparams(L::param_count);
  clean.backward(dy, dx, dparams);

  Run<L, float> poisoned(n, params, x, &lengths, training);
  poison_padding(poisoned.x, 9, 3, lengths);
  poisoned.forward();
  poison_padding(dy, L::out_frames, 4, out_lengths);
  std::vector<float> dx_poisoned(n * in, -99.0f), dparams_poisoned(L::param_count, -99.0f);
  poisoned.backward(dy, dx_poisoned, dparams_poisoned);
  require_equal(poisoned.y, clean.y, "output");
  require_equal(dx_poisoned, dx, "input gradient");
  require_equal(dparams_poisoned, dparams, "parameter gradients");
  require_zero_padding(poisoned.y, L::out_frames, 4, out_lengths, "output");
  require_zero_padding(dx_poisoned, 9, 3, lengths, "input gradient");
}

TEST_CASE(
    "sequence layers: Conv1d refuses a length that leaves no output frame or exceeds its input") {
  using L = Bind<Conv1d<2, 5>, Shape<10, 3>, 4>;
  const auto params = random_vector<double>(L::param_count, 80);
  const auto x = random_vector<double>(3 * 30, 81);
  const Lengths short_one{10, 4, 7};  // 4 frames < the window's 5
  REQUIRE_THROWS_WITH((Run<L, float>(3, params, x, &short_one, training)),
                      Catch::Contains("(layer 4): sample 1 of the batch (global sample 1) has 4 "
                                      "frames") &&
                          Catch::Contains("shorter than the 5 frames the window spans"));
  const Lengths too_long{10, 11, 7};
  Pass later = training;
  later.first_sample = 32;
  REQUIRE_THROWS_WITH((Run<L, float>(3, params, x, &too_long, later)),
                      Catch::Contains("sample 1 of the batch (global sample 33) has length 11, "
                                      "outside 0..10"));
  // Inside a block (the 3rd layer of the block that is layer 2) the message
  // names the layer by its path.
  using InBlock = Bind<Conv1d<2, 5>, Shape<10, 3>, 64 * 2 + 3>;
  REQUIRE_THROWS_WITH((Run<InBlock, float>(3, params, x, &short_one, training)),
                      Catch::Contains("(layer 2.3): sample 1 of the batch (global sample 1) has 4 "
                                      "frames"));
}

// ----------------------------------------------------------- BatchNorm1d

namespace {

// BatchNorm1d over time as PyTorch computes BatchNorm1d on (N, C, L), with
// padding left out: per channel, the mean and biased variance over every
// sample's valid frames (training) or the running ones (evaluation); zero
// at padding. x [n, frames, c]; params gamma [c], beta [c]; state running
// mean [c], running variance [c].
std::vector<double> batch_norm_reference(std::size_t n, std::size_t frames, std::size_t channels,
                                         const std::vector<double>& x,
                                         const std::vector<double>& params,
                                         const std::vector<double>& state, const Lengths* lengths,
                                         bool train) {
  std::vector<double> y(x.size(), 0.0);
  for (std::size_t c = 0; c < channels; ++c) {
    double mean = state[c], var = state[channels + c];
    if (train) {
      double count = 0, sum = 0, squares = 0;
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t t = 0; t < length_of(lengths, s, frames); ++t, ++count)
          sum += x[(s * frames + t) * channels + c];
      mean = sum / count;
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t t = 0; t < length_of(lengths, s, frames); ++t)
          squares += std::pow(x[(s * frames + t) * channels + c] - mean, 2);
      var = squares / count;
    }
    for (std::size_t s = 0; s < n; ++s)
      for (std::size_t t = 0; t < length_of(lengths, s, frames); ++t) {
        const std::size_t at = (s * frames + t) * channels + c;
        y[at] = (x[at] - mean) / std::sqrt(var + eps) * params[c] + params[channels + c];
      }
  }
  return y;
}

// Doubles every sum: a twin replica with the same samples.
struct TwinReplicas : ReplicaSum {
  void sum(std::span<double> values) override {
    for (auto& v : values) v *= 2;
  }
};

}  // namespace

TEST_CASE(
    "sequence layers: BatchNorm1d over Frames x C normalises per channel over the valid frames") {
  using L = Bind<BatchNorm1d, Shape<6, 3>, 1>;
  using WithRelu = Bind<Fused<BatchNorm1d, ReLU>, Shape<6, 3>, 1>;
  using Sync = Bind<SyncBatchNorm1d, Shape<6, 3>, 1>;
  STATIC_REQUIRE(L::param_count == 6 && L::state_count == 6);
  STATIC_REQUIRE(std::is_same_v<L::output_shape, Shape<6, 3>>);
  STATIC_REQUIRE(!ChangesFrames<L>);
  STATIC_REQUIRE(Sync::syncs && !L::syncs);
  constexpr std::size_t n = 4, frames = 6, channels = 3;
  const Lengths lengths{6, 2, 5, 1};
  auto params = random_vector<double>(2 * channels, 90, -0.5, 0.5);
  for (std::size_t c = 0; c < channels; ++c) params[c] += 1.0;
  const auto x = random_vector<double>(n * frames * channels, 91, -2.0, 3.0);
  const std::vector<double> initial{0, 0, 0, 1, 1, 1};
  // Running statistics as evaluation reads them.
  const std::vector<double> running{0.3, -0.2, 0.1, 0.8, 1.5, 0.6};

  for (const Lengths* l : {static_cast<const Lengths*>(nullptr), &lengths}) {
    const std::string what = l == nullptr ? " (every frame)" : " (with lengths)";
    const auto expected = batch_norm_reference(n, frames, channels, x, params, initial, l, true);
    Run<L, double> run(n, params, x, l, training);
    require_close(run.y, expected, {1e-12, 1e-12}, "training forward" + what);
    require_close(Run<L, float>(n, params, x, l, training).y, expected, {1e-5, 1e-5},
                  "float training forward" + what);
    require_close(Run<WithRelu, double>(n, params, x, l, training).y, relu(expected),
                  {1e-12, 1e-12}, "fused ReLU" + what);
    require_equal(Run<Sync, double>(n, params, x, l, training).y, run.y,
                  "SyncBatchNorm1d without replicas" + what);

    // PyTorch's running update from the valid frames: momentum 0.1, the unbiased variance.
    double count = 0;
    for (std::size_t s = 0; s < n; ++s) count += static_cast<double>(length_of(l, s, frames));
    for (std::size_t c = 0; c < channels; ++c) {
      double mean = 0, var = 0;
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t t = 0; t < length_of(l, s, frames); ++t)
          mean += x[(s * frames + t) * channels + c] / count;
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t t = 0; t < length_of(l, s, frames); ++t)
          var += std::pow(x[(s * frames + t) * channels + c] - mean, 2) / count;
      CHECK(std::abs(run.state[c] - 0.1 * mean) < 1e-12);
      CHECK(std::abs(run.state[channels + c] - (0.9 + 0.1 * var * count / (count - 1))) < 1e-12);
    }

    const auto evaluated = batch_norm_reference(n, frames, channels, x, params, running, l, false);
    require_close(Run<L, double>(n, params, x, l, Pass{}, running).y, evaluated, {1e-12, 1e-12},
                  "evaluation forward" + what);
    require_close(Run<L, float>(n, params, x, l, Pass{}, running).y, evaluated, {1e-5, 1e-5},
                  "float evaluation forward" + what);

    check_gradients<L>(n, l, training, 100);
    check_gradients<L>(n, l, Pass{}, 110, running);
    check_gradients<WithRelu>(n, l, training, 120);
    check_gradients<Sync>(n, l, training, 130);
  }
}

TEST_CASE(
    "sequence layers: BatchNorm1d over padded frames equals the valid frames packed, bit for bit, "
    "whatever the padding holds") {
  // The same valid frames as a batch of C-vectors (the rank-1 BatchNorm1d,
  // one row per frame): both sum each channel over the frames in the same
  // order, so forward, running statistics and gradients agree exactly, with
  // NaN in the padding of x and dy.
  constexpr std::size_t n = 5, frames = 7, channels = 4;
  const Lengths lengths{7, 3, 1, 6, 4};
  std::size_t rows = 0;
  for (const auto l : lengths) rows += static_cast<std::size_t>(l);
  auto params = random_vector<double>(2 * channels, 140, -0.5, 0.5);
  for (std::size_t c = 0; c < channels; ++c) params[c] += 1.0;
  auto x = random_vector<double>(n * frames * channels, 141, -2.0, 3.0);
  auto dy = random_vector<float>(n * frames * channels, 142);
  poison_padding(x, frames, channels, lengths);
  poison_padding(dy, frames, channels, lengths);
  // The valid frames, packed: rows x C.
  std::vector<double> packed_x;
  std::vector<float> packed_dy;
  for (std::size_t s = 0; s < n; ++s) {
    const auto begin = static_cast<long>(s * frames * channels);
    const auto end = begin + static_cast<long>(static_cast<std::size_t>(lengths[s]) * channels);
    packed_x.insert(packed_x.end(), x.begin() + begin, x.begin() + end);
    packed_dy.insert(packed_dy.end(), dy.begin() + begin, dy.begin() + end);
  }
  auto unpack = [&](const std::vector<float>& padded) {
    std::vector<float> valid;
    for (std::size_t s = 0; s < n; ++s) {
      const auto begin = static_cast<long>(s * frames * channels);
      valid.insert(valid.end(), padded.begin() + begin,
                   padded.begin() + begin +
                       static_cast<long>(static_cast<std::size_t>(lengths[s]) * channels));
    }
    return valid;
  };

  auto compare = [&]<class Over, class Packed>(const Pass& pass, const std::string& what) {
    Run<Over, float> over(n, params, x, &lengths, pass);
    Run<Packed, float> packed(rows, params, packed_x, nullptr, pass);
    over.forward();  // a second training forward: the running statistics move twice
    packed.forward();
    require_equal(unpack(over.y), packed.y, what + ": output");
    require_zero_padding(over.y, frames, channels, lengths, what + ": output");
    require_equal(over.state, packed.state, what + ": running statistics");
    std::vector<float> dx(x.size(), -99.0f), dparams(2 * channels);
    std::vector<float> packed_dx(packed_x.size()), packed_dparams(2 * channels);
    over.backward(dy, dx, dparams);
    packed.backward(packed_dy, packed_dx, packed_dparams);
    require_equal(unpack(dx), packed_dx, what + ": input gradient");
    require_zero_padding(dx, frames, channels, lengths, what + ": input gradient");
    require_equal(dparams, packed_dparams, what + ": parameter gradients");
  };
  compare.operator()<Bind<BatchNorm1d, Shape<frames, channels>, 1>,
                     Bind<BatchNorm1d, Shape<channels>, 1>>(training, "training");
  compare.operator()<Bind<Fused<BatchNorm1d, ReLU>, Shape<frames, channels>, 1>,
                     Bind<Fused<BatchNorm1d, ReLU>, Shape<channels>, 1>>(training, "fused ReLU");
  TwinReplicas twins;
  Pass synced = training;
  synced.replicas = &twins;
  compare.operator()<Bind<SyncBatchNorm1d, Shape<frames, channels>, 1>,
                     Bind<SyncBatchNorm1d, Shape<channels>, 1>>(synced,
                                                                "SyncBatchNorm1d, twin replicas");
}

TEST_CASE(
    "sequence layers: BatchNorm1d over time in training refuses a batch without a valid frame") {
  using L = Bind<BatchNorm1d, Shape<4, 2>, 3>;
  const Lengths empty{0, 0};
  const auto params = random_vector<double>(4, 150);
  const auto x = random_vector<double>(16, 151);
  REQUIRE_THROWS_WITH(
      (Run<L, float>(2, params, x, &empty, training)),
      Catch::Contains("(layer 3) in training: no sample of the batch has a valid frame"));
  // In evaluation an empty sample is all padding: zeros out.
  Run<L, float> evaluated(2, params, x, &empty, Pass{});
  require_equal(evaluated.y, std::vector<float>(16, 0.0f), "evaluation output");
}
