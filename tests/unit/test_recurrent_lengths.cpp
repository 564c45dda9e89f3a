// GRU and LSTM over sequences of varying length (LayerContext::frames) and
// their bidirectional form, called as layers (Bind<...>::forward/backward)
// with the lengths set: gradients against central differences in double;
// a padded batch against its samples run one at a time, bit for bit in
// float; NaN in the padding; the reverse direction against the forward one
// over reversed steps; names, layout, initialisation and refused lengths.
// PyTorch's nn.GRU/nn.LSTM over pack_padded_sequence: recurrent_torch.py.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <loom/loom.hpp>
#include <string>
#include <vector>

#include "loom_test.hpp"

using namespace loom;
using loom::test::random_vector;
using loom::test::require_close;

namespace {

// A layer over Steps x F with its buffers, run directly with a LayerContext.
// Buffers it writes start filled with `poison`, so that a value the layer
// reads before writing shows.
template <class Spec, std::size_t Steps, std::size_t F, class T>
struct Harness {
  using L = Bind<Spec, Shape<Steps, F>, 1>;
  static constexpr std::size_t in_size = Steps * F;
  static constexpr std::size_t out_size = L::output_shape::size;

  std::size_t n;
  std::vector<T> params = std::vector<T>(L::param_count);
  std::vector<T> saved, work, y, dx, dparams;
  T poison;

  Harness(std::size_t n_, std::uint64_t seed, T poison_ = T(0)) : n(n_), poison(poison_) {
    L::init(params.data(), seed, false);
    saved.assign(n * L::saved, poison);
    work.assign(n * L::workspace, poison);
    y.assign(n * out_size, poison);
    dx.assign(n * in_size, poison);
    dparams.assign(L::param_count, poison);
  }

  LayerContext<T> context(const std::vector<std::int32_t>* frames) {
    LayerContext<T> c;
    c.saved = saved.data();
    c.frames = frames != nullptr ? frames->data() : nullptr;
    return c;
  }
  const std::vector<T>& forward(const std::vector<T>& x, const std::vector<std::int32_t>* frames) {
    L::forward(params.data(), x.data(), y.data(), work.data(), n, context(frames));
    return y;
  }
  void backward(const std::vector<T>& x, const std::vector<T>& dy,
                const std::vector<std::int32_t>* frames, bool accumulate = false) {
    L::backward(params.data(), x.data(), y.data(), dy.data(), dx.data(), dparams.data(),
                work.data(), n, accumulate, context(frames));
  }
};

// Bit for bit, NaN included (a NaN is equal to the same NaN).
template <class T>
void require_bits(const std::vector<T>& got, const std::vector<T>& ref, const std::string& what) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0)
      FAIL(what << " differs at index " << i << ": " << got[i] << " against " << ref[i]);
  SUCCEED();
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, std::size_t first, std::size_t count) {
  return {v.begin() + static_cast<std::ptrdiff_t>(first),
          v.begin() + static_cast<std::ptrdiff_t>(first + count)};
}

// Every output and input-gradient value of sample s at steps >= len is
// exactly zero (positive zero).
template <class H>
void require_zero_padding(const H& h, const std::vector<std::int32_t>& frames, std::size_t steps,
                          std::size_t out_step, std::size_t features, bool sequence) {
  for (std::size_t s = 0; s < h.n; ++s) {
    const auto len = static_cast<std::size_t>(frames[s]);
    for (std::size_t i = (s * steps + len) * features; i < (s + 1) * steps * features; ++i)
      REQUIRE(std::bit_cast<std::uint64_t>(static_cast<double>(h.dx[i])) == 0);
    if (sequence)
      for (std::size_t i = (s * steps + len) * out_step; i < (s + 1) * steps * out_step; ++i)
        REQUIRE(std::bit_cast<std::uint64_t>(static_cast<double>(h.y[i])) == 0);
  }
}

// d(objective)/dv by central differences (step 1e-6), v restored.
template <class F>
double central_difference(F&& objective, double& v) {
  constexpr double step = 1e-6;
  const double keep = v;
  v = keep + step;
  const double up = objective();
  v = keep - step;
  const double down = objective();
  v = keep;
  return (up - down) / (2 * step);
}

// L(x, p) = sum(y * r), in double with random parameters: backward with
// dy = r (nonzero in the padding too, which backward must not read) against
// central differences of every parameter and input.
template <class Spec, std::size_t Steps, std::size_t F>
void check_gradients(const std::vector<std::int32_t>& frames, std::uint64_t seed) {
  using Hn = Harness<Spec, Steps, F, double>;
  const std::size_t n = frames.size();
  Hn h(n, seed, std::numeric_limits<double>::quiet_NaN());
  const auto noise = random_vector<double>(h.params.size(), seed + 1, -0.3, 0.3);
  for (std::size_t i = 0; i < h.params.size(); ++i) h.params[i] += noise[i];
  auto x = random_vector<double>(n * Hn::in_size, seed + 2);
  const auto r = random_vector<double>(n * Hn::out_size, seed + 3);
  const auto objective = [&] {
    const auto& y = h.forward(x, &frames);
    double sum = 0;
    for (std::size_t i = 0; i < r.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  objective();
  h.backward(x, r, &frames);
  const std::vector<double> dparams = h.dparams, dx = h.dx;
  constexpr std::size_t out_step = Spec::sequence ? Hn::out_size / Steps : 0;
  require_zero_padding(h, frames, Steps, out_step, F, Spec::sequence);

  std::vector<double> fd_params(h.params.size()), fd_x(x.size());
  for (std::size_t i = 0; i < h.params.size(); ++i)
    fd_params[i] = central_difference(objective, h.params[i]);
  for (std::size_t i = 0; i < x.size(); ++i) fd_x[i] = central_difference(objective, x[i]);
  require_close(dparams, fd_params, {1e-6, 1e-5}, "parameter gradient");
  require_close(dx, fd_x, {1e-6, 1e-5}, "input gradient");

  h.forward(x, &frames);
  h.backward(x, r, &frames, true);
  // accumulate = true adds the same gradient again (in another order: each
  // sum starts from the gradient already there).
  std::vector<double> twice(dparams.size());
  for (std::size_t i = 0; i < dparams.size(); ++i) twice[i] = 2 * dparams[i];
  require_close(h.dparams, twice, {1e-14, 1e-13}, "accumulated parameter gradient");
}

// A padded batch in float against each of its samples on its own, two ways.
// Alone in the batch (the other samples of length 0, NaN inputs and output
// gradients): its outputs and input gradient bit for bit, the others' exactly
// zero. In a batch of one: within float rounding, not bit for bit, because
// OpenBLAS's sgemm rounds a row by the kernel its block of rows gets (of 6
// rows sent together, 4 differ in their last bits from the same rows sent one
// at a time; measured with OpenBLAS 0.3.21, Zen kernels), so the row a
// sample's state takes in the batch's GEMMs matters; loom's own arithmetic
// adds nothing across samples. The parameter gradients sum over the samples
// in another order either way (the batch's GEMMs add every sample's rows in
// one dot product), so they agree within float rounding of those sums.
// Tolerance: |diff| <= 1e-6 * (largest |value|) + 1e-5 * |value|.
template <class Spec, std::size_t Steps, std::size_t F>
void check_batch_equals_samples(const std::vector<std::int32_t>& frames, std::uint64_t seed) {
  using Hf = Harness<Spec, Steps, F, float>;
  const std::size_t n = frames.size();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Hf batch(n, seed, nan);
  auto x = random_vector<float>(n * Hf::in_size, seed + 1);
  const auto dy = random_vector<float>(n * Hf::out_size, seed + 2);
  const auto y = batch.forward(x, &frames);
  batch.backward(x, dy, &frames);

  const auto largest = [](const auto& v) {
    double most = 0;
    for (const auto g : v) most = std::max(most, std::abs(static_cast<double>(g)));
    return most;
  };
  const auto close = [&](const auto& got, const auto& ref, const char* what) {
    require_close(got, ref, {1e-6 * largest(ref), 1e-5}, what);
  };
  std::vector<double> summed(Hf::L::param_count, 0.0), summed_alone(Hf::L::param_count, 0.0);
  for (std::size_t s = 0; s < n; ++s) {
    INFO("sample " << s << ", length " << frames[s]);
    const auto xs = slice(x, s * Hf::in_size, Hf::in_size);
    const auto dys = slice(dy, s * Hf::out_size, Hf::out_size);
    const auto ys = slice(y, s * Hf::out_size, Hf::out_size);
    const auto dxs = slice(batch.dx, s * Hf::in_size, Hf::in_size);

    Hf alone(n, seed, nan);
    std::vector<std::int32_t> only(n, 0);
    only[s] = frames[s];
    std::vector<float> x_alone(x.size(), nan), dy_alone(dy.size(), nan);
    std::copy(xs.begin(), xs.end(), x_alone.begin() + static_cast<std::ptrdiff_t>(s * Hf::in_size));
    std::copy(dys.begin(), dys.end(),
              dy_alone.begin() + static_cast<std::ptrdiff_t>(s * Hf::out_size));
    alone.forward(x_alone, &only);
    alone.backward(x_alone, dy_alone, &only);
    std::vector<float> y_expected(y.size(), 0.0f), dx_expected(x.size(), 0.0f);
    std::copy(ys.begin(), ys.end(),
              y_expected.begin() + static_cast<std::ptrdiff_t>(s * Hf::out_size));
    std::copy(dxs.begin(), dxs.end(),
              dx_expected.begin() + static_cast<std::ptrdiff_t>(s * Hf::in_size));
    require_bits(alone.y, y_expected, "output, alone in the batch");
    require_bits(alone.dx, dx_expected, "input gradient, alone in the batch");

    Hf one(1, seed, nan);
    const std::vector<std::int32_t> own{frames[s]};
    close(one.forward(xs, &own), ys, "output, batch of one");
    one.backward(xs, dys, &own);
    close(one.dx, dxs, "input gradient, batch of one");
    for (std::size_t i = 0; i < summed.size(); ++i) {
      summed[i] += one.dparams[i];
      summed_alone[i] += alone.dparams[i];
    }
  }
  close(batch.dparams, summed, "parameter gradient, batches of one");
  close(batch.dparams, summed_alone, "parameter gradient, alone in the batch");

  // NaN in the padding of x and dy changes nothing: not a bit of the
  // outputs, the input gradient or the parameter gradients.
  constexpr std::size_t out_step = Spec::sequence ? Hf::out_size / Steps : 0;
  auto x_nan = x;
  auto dy_nan = dy;
  for (std::size_t s = 0; s < n; ++s) {
    const auto len = static_cast<std::size_t>(frames[s]);
    std::fill(x_nan.begin() + (s * Steps + len) * F, x_nan.begin() + (s + 1) * Steps * F, nan);
    if constexpr (Spec::sequence)
      std::fill(dy_nan.begin() + (s * Steps + len) * out_step,
                dy_nan.begin() + (s + 1) * Steps * out_step, nan);
  }
  Hf padded(n, seed, nan);
  require_bits(padded.forward(x_nan, &frames), y, "output with NaN padding");
  padded.backward(x_nan, dy_nan, &frames);
  require_bits(padded.dx, batch.dx, "input gradient with NaN padding");
  require_bits(padded.dparams, batch.dparams, "parameter gradient with NaN padding");
  require_zero_padding(padded, frames, Steps, out_step, F, Spec::sequence);

  // Every sample at full length: the lengths' path gives the outputs and
  // input gradient of the path without lengths, bit for bit (dW_ih's sum
  // runs per sample there, so the parameter gradients get the tolerance).
  const std::vector<std::int32_t> full(n, static_cast<std::int32_t>(Steps));
  Hf with(n, seed, nan), without(n, seed, nan);
  require_bits(with.forward(x, &full), without.forward(x, nullptr), "full-length output");
  with.backward(x, dy, &full);
  without.backward(x, dy, nullptr);
  require_bits(with.dx, without.dx, "full-length input gradient");
  close(with.dparams, without.dparams, "full-length parameter gradient");
}

}  // namespace

TEST_CASE("recurrent lengths: GRU and LSTM gradients with lengths equal finite differences") {
  const std::vector<std::int32_t> frames{5, 2, 0, 4, 1};
  check_gradients<GRU<3, true>, 5, 2>(frames, 11);
  check_gradients<GRU<3>, 5, 2>(frames, 12);
  check_gradients<LSTM<3, true>, 5, 2>(frames, 13);
  check_gradients<LSTM<3>, 5, 2>(frames, 14);
}

TEST_CASE("recurrent lengths: bidirectional GRU and LSTM gradients equal finite differences") {
  const std::vector<std::int32_t> frames{5, 3, 1, 0};
  check_gradients<BiGRU<3>, 5, 2>(frames, 21);
  check_gradients<GRU<3, false, true>, 5, 2>(frames, 22);
  check_gradients<BiLSTM<3>, 5, 2>(frames, 23);
  check_gradients<LSTM<3, false, true>, 5, 2>(frames, 24);
  // Without lengths, both directions over every step.
  check_gradients<BiLSTM<3>, 4, 2>({4, 4}, 25);
}

TEST_CASE("recurrent lengths: bidirectional layers stacked in a network train by its gradients") {
  // Through Model (every step, no lengths): BiGRU's 2H features per step
  // feed a bidirectional LSTM's last states, then a Linear; central
  // differences of every parameter and input of the whole network.
  using Net = Sequential<Input<4, 3>, BiGRU<3>, LSTM<2, false, true>, Linear<2>>;
  static_assert(Net::parameter_count ==
                2 * 3 * 3 * (3 + 3 + 2) + 2 * 4 * 2 * (6 + 2 + 2) + 2 * 4 + 2);
  constexpr std::size_t batch = 2;
  Model<Net, double> model(3, batch);
  auto params = model.parameters();
  auto x = random_vector<double>(batch * 12, 4);
  const auto r = random_vector<double>(batch * 2, 5);
  const auto objective = [&] {
    const double* y = model.forward(x.data(), batch);
    return y[0] * r[0] + y[1] * r[1] + y[2] * r[2] + y[3] * r[3];
  };
  objective();
  std::copy(r.begin(), r.end(), model.output_gradient());
  std::vector<double> dx(x.size());
  model.backward(0, false, dx.data());
  const std::vector<double> dparams(model.gradients().begin(), model.gradients().end());
  std::vector<double> fd_params(params.size()), fd_x(x.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    fd_params[i] = central_difference(objective, params[i]);
  for (std::size_t i = 0; i < x.size(); ++i) fd_x[i] = central_difference(objective, x[i]);
  require_close(dparams, fd_params, {1e-7, 1e-5}, "parameter gradient");
  require_close(dx, fd_x, {1e-7, 1e-5}, "input gradient");
}

TEST_CASE(
    "recurrent lengths: a padded batch equals its samples alone in it bit for bit, and run one at "
    "a time within float rounding") {
  const std::vector<std::int32_t> frames{9, 4, 1, 7, 0, 9};
  check_batch_equals_samples<GRU<16, true>, 9, 5>(frames, 31);
  check_batch_equals_samples<GRU<16>, 9, 5>(frames, 32);
  check_batch_equals_samples<LSTM<16, true>, 9, 5>(frames, 33);
  check_batch_equals_samples<LSTM<16>, 9, 5>(frames, 34);
  check_batch_equals_samples<BiGRU<16>, 9, 5>(frames, 35);
  check_batch_equals_samples<GRU<16, false, true>, 9, 5>(frames, 36);
  check_batch_equals_samples<BiLSTM<16>, 9, 5>(frames, 37);
  check_batch_equals_samples<LSTM<16, false, true>, 9, 5>(frames, 38);
}

namespace {

// The bidirectional layer's two halves, against unidirectional layers with
// each direction's parameters: the forward half is GRU<H, true> over the
// same steps; the reverse half is GRU<H, true> over each sample's steps
// 0..len-1 reversed, its outputs reversed back; Sequence = false takes the
// forward half at step len - 1 and the reverse half at step 0. Bit for bit.
template <template <std::size_t, bool, bool> class Rnn>
void check_directions() {
  constexpr std::size_t steps = 6, F = 3, H = 5;
  using Bi = Harness<Rnn<H, true, true>, steps, F, float>;
  using BiLast = Harness<Rnn<H, false, true>, steps, F, float>;
  using Uni = Harness<Rnn<H, true, false>, steps, F, float>;
  const std::vector<std::int32_t> frames{6, 2, 5, 1};
  const std::size_t n = frames.size();
  const auto x = random_vector<float>(n * steps * F, 41);
  Bi bi(n, 42);
  BiLast last(n, 42);
  REQUIRE(last.params == bi.params);
  const auto y = bi.forward(x, &frames);
  const auto y_last = last.forward(x, &frames);

  Uni fwd(n, 0), rev(n, 0);
  constexpr std::size_t half = Bi::L::direction_params;
  std::copy_n(bi.params.begin(), half, fwd.params.begin());
  std::copy_n(bi.params.begin() + half, half, rev.params.begin());
  auto x_rev = x;
  for (std::size_t s = 0; s < n; ++s) {
    const auto len = static_cast<std::size_t>(frames[s]);
    for (std::size_t t = 0; t < len; ++t)
      std::copy_n(x.begin() + (s * steps + len - 1 - t) * F, F,
                  x_rev.begin() + (s * steps + t) * F);
  }
  const auto yf = fwd.forward(x, &frames);
  const auto yr = rev.forward(x_rev, &frames);
  std::vector<float> expected(y.size(), 0.0f), expected_last(y_last.size(), 0.0f);
  for (std::size_t s = 0; s < n; ++s) {
    const auto len = static_cast<std::size_t>(frames[s]);
    for (std::size_t t = 0; t < len; ++t) {
      std::copy_n(yf.begin() + (s * steps + t) * H, H, expected.begin() + (s * steps + t) * 2 * H);
      std::copy_n(yr.begin() + (s * steps + len - 1 - t) * H, H,
                  expected.begin() + (s * steps + t) * 2 * H + H);
    }
    std::copy_n(expected.begin() + (s * steps + len - 1) * 2 * H, H,
                expected_last.begin() + s * 2 * H);
    std::copy_n(expected.begin() + s * steps * 2 * H + H, H, expected_last.begin() + s * 2 * H + H);
  }
  require_bits(y, expected, "bidirectional output");
  require_bits(y_last, expected_last, "bidirectional last state");
}

}  // namespace

TEST_CASE(
    "recurrent lengths: the reverse direction is the forward one over each sample's reversed "
    "steps") {
  check_directions<GRU>();
  check_directions<LSTM>();
}

TEST_CASE(
    "recurrent lengths: bidirectional spellings, shapes, PyTorch's names and layout, "
    "initialisation") {
  static_assert(std::is_same_v<BiGRU<8>, GRU<8, true, true>>);
  static_assert(std::is_same_v<BiLSTM<8>, LSTM<8, true, true>>);
  static_assert(std::is_same_v<GRU<8>, GRU<8, false, false>>);
  using Bi = Bind<BiLSTM<8>, Shape<10, 3>, 1>;
  using BiLast = Bind<GRU<8, false, true>, Shape<10, 3>, 1>;
  using Uni = Bind<LSTM<8, true>, Shape<10, 3>, 1>;
  static_assert(std::is_same_v<Bi::output_shape, Shape<10, 16>>);
  static_assert(std::is_same_v<BiLast::output_shape, Shape<16>>);
  static_assert(Bi::param_count == 2 * Uni::param_count);
  static_assert(Bi::saved == 2 * Uni::saved && Bi::workspace == Uni::workspace);
  static_assert(BiLast::param_count == 2 * 3 * 8 * (3 + 8 + 2));
  static_assert(Sequential<Input<10, 3>, BiGRU<8>, GRU<4>>::parameter_count ==
                2 * 3 * 8 * (3 + 8 + 2) + 3 * 4 * (16 + 4 + 2));

  struct Seen {
    std::string name;
    std::size_t offset;
    std::vector<std::size_t> shape;
  };
  std::vector<Seen> seen;
  Bi::tensors([&](std::string_view name, std::size_t offset,
                  std::initializer_list<std::size_t> shape, bool state) {
    REQUIRE_FALSE(state);
    seen.push_back({std::string(name), offset, shape});
  });
  const std::size_t w = 4 * 8;  // gates x hidden
  const std::vector<Seen> expected{
      {"weight_ih_l0", 0, {w, 3}},
      {"weight_hh_l0", w * 3, {w, 8}},
      {"bias_ih_l0", w * 11, {w}},
      {"bias_hh_l0", w * 12, {w}},
      {"weight_ih_l0_reverse", w * 13, {w, 3}},
      {"weight_hh_l0_reverse", w * 16, {w, 8}},
      {"bias_ih_l0_reverse", w * 24, {w}},
      {"bias_hh_l0_reverse", w * 25, {w}},
  };
  REQUIRE(seen.size() == expected.size());
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO(seen[i].name);
    CHECK(seen[i].name == expected[i].name);
    CHECK(seen[i].offset == expected[i].offset);
    CHECK(seen[i].shape == expected[i].shape);
  }
  REQUIRE(w * 26 == Bi::param_count);

  // Uniform in +-1/sqrt(H) over both directions, as PyTorch.
  std::vector<double> p(Bi::param_count);
  Bi::init(p.data(), 5, false);
  const double limit = 1 / std::sqrt(8.0);
  for (const std::size_t first : {std::size_t{0}, Bi::direction_params}) {
    const auto [lo, hi] =
        std::minmax_element(p.begin() + static_cast<std::ptrdiff_t>(first),
                            p.begin() + static_cast<std::ptrdiff_t>(first + Bi::direction_params));
    CHECK(*lo >= -limit);
    CHECK(*hi <= limit);
    CHECK(*lo < -0.9 * limit);
    CHECK(*hi > 0.9 * limit);
  }
}

TEST_CASE("recurrent lengths: a length outside 0..Steps is refused, naming the sample") {
  Harness<BiGRU<4>, 6, 2, float> h(3, 1);
  const auto x = random_vector<float>(3 * 6 * 2, 2);
  for (const std::int32_t bad : {7, -1}) {
    const std::vector<std::int32_t> frames{6, bad, 2};
    try {
      h.forward(x, &frames);
      FAIL("a length of " << bad << " was accepted");
    } catch (const Error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("GRU (layer 1): sample 1 has " + std::to_string(bad) +
                      " frames, outside 0..6") != std::string::npos);
    }
  }
}
