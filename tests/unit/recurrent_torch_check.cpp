// recurrent_torch_check: loom's GRU and LSTM (one and two directions, with
// lengths) against PyTorch's nn.GRU / nn.LSTM over pack_padded_sequence,
// driven by recurrent_torch.py.
//   recurrent_torch_check write CASES       writes each case: the layer, the
//     lengths, the input, the loss weights r (loss = sum(output * r)) and
//     loom's initial parameters by their tensor names;
//   recurrent_torch_check compare CASES TORCH  runs loom's layers on them in
//     float and double and compares the outputs and the gradients of the
//     loss (input, every parameter tensor) with torch's float64 ones.
// Tolerances (every entry): float |diff| <= 1e-6 * largest + 1e-5 * |ref|,
// double 1e-13 * largest + 1e-11 * |ref|, the largest |ref| of that tensor.
// Exit status: 0 agree, 1 differ, 2 a file that cannot be read or written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <loom/loom.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace {

using loom::Bind;
using loom::Shape;

template <class Spec_, std::size_t Steps_, std::size_t Features_>
struct Case {
  using Spec = Spec_;
  using L = Bind<Spec, Shape<Steps_, Features_>, 1>;
  static constexpr std::size_t steps = Steps_, features = Features_;
};

// (case, lengths); an empty list runs without lengths (every step).
template <class C>
struct Entry {
  std::vector<std::int32_t> frames;
};

template <class F>
void for_each_case(F&& f) {
  using namespace loom;
  f(Entry<Case<BiGRU<5>, 7, 4>>{{7, 3, 5, 1}});
  f(Entry<Case<BiLSTM<5>, 7, 4>>{{7, 3, 5, 1}});
  f(Entry<Case<GRU<5, false, true>, 7, 4>>{{2, 7, 6, 1}});
  f(Entry<Case<LSTM<5, false, true>, 7, 4>>{{2, 7, 6, 1}});
  f(Entry<Case<GRU<6, true>, 7, 4>>{{7, 3, 5, 1}});
  f(Entry<Case<LSTM<6>, 7, 4>>{{4, 7, 1, 2}});
  f(Entry<Case<BiLSTM<4>, 5, 3>>{{}});
  f(Entry<Case<GRU<4, false, true>, 5, 3>>{{}});
}

constexpr std::size_t batch = 4;

std::vector<float> values(std::size_t count, std::uint64_t stream) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = static_cast<float>(2 * loom::uniform01(17, stream, i) - 1);
  return v;
}

template <class C>
std::size_t batch_of(const Entry<C>& e) {
  return e.frames.empty() ? 2 : batch;
}

struct Inputs {
  std::size_t n;
  std::vector<float> params, x, r;
};

template <class C>
Inputs inputs(const Entry<C>& e) {
  using L = typename C::L;
  Inputs in;
  in.n = batch_of(e);
  in.params.resize(L::param_count);
  L::init(in.params.data(), 5, false);
  in.x = values(in.n * C::steps * C::features, 1);
  in.r = values(in.n * L::output_shape::size, 2);
  return in;
}

void line(std::ostream& out, const auto& v) {
  char text[32];
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::snprintf(text, sizeof text, "%.9g", static_cast<double>(v[i]));
    out << (i ? " " : "") << text;
  }
  out << '\n';
}

template <class C>
void write_case(std::ostream& out, const Entry<C>& e) {
  using L = typename C::L;
  using Spec = typename C::Spec;
  const auto in = inputs(e);
  out << L::kind << ' ' << int{Spec::sequence} << ' ' << int{Spec::bidirectional} << ' '
      << Spec::hidden << ' ' << C::features << ' ' << C::steps << ' ' << in.n << ' '
      << int{!e.frames.empty()} << '\n';
  line(out, e.frames.empty() ? std::vector<std::int32_t>(in.n, C::steps) : e.frames);
  line(out, in.x);
  line(out, in.r);
  std::size_t count = 0;
  L::tensors(
      [&](std::string_view, std::size_t, std::initializer_list<std::size_t>, bool) { ++count; });
  out << count << '\n';
  L::tensors([&](std::string_view name, std::size_t offset,
                 std::initializer_list<std::size_t> shape, bool) {
    std::size_t size = 1;
    out << name << ' ' << shape.size();
    for (const std::size_t d : shape) {
      out << ' ' << d;
      size *= d;
    }
    out << '\n';
    line(out, std::vector<float>(in.params.begin() + static_cast<std::ptrdiff_t>(offset),
                                 in.params.begin() + static_cast<std::ptrdiff_t>(offset + size)));
  });
}

// Outputs, input gradient and parameter gradient of loss = sum(y * r).
template <class T, class C>
void run(const Entry<C>& e, const Inputs& in, std::vector<T>& y, std::vector<T>& dx,
         std::vector<T>& dparams) {
  using L = typename C::L;
  const std::vector<T> params(in.params.begin(), in.params.end());
  const std::vector<T> x(in.x.begin(), in.x.end()), r(in.r.begin(), in.r.end());
  std::vector<T> saved(in.n * L::saved), work(in.n * L::workspace);
  y.assign(in.n * L::output_shape::size, T(0));
  dx.assign(x.size(), T(0));
  dparams.assign(L::param_count, T(0));
  loom::LayerContext<T> context;
  context.saved = saved.data();
  context.frames = e.frames.empty() ? nullptr : e.frames.data();
  L::forward(params.data(), x.data(), y.data(), work.data(), in.n, context);
  L::backward(params.data(), x.data(), y.data(), r.data(), dx.data(), dparams.data(), work.data(),
              in.n, false, context);
}

// `got` against torch's `ref` by the test suite's rule, |diff| <= abs *
// (the largest |ref|) + rel * |ref| for every entry; for the report, the
// largest |diff| over the largest |ref|, and the largest relative error over
// the entries that are not rounding noise (|ref| >= 1e-3 of the largest).
struct Errors {
  double abs, rel;
  double of_largest = 0, relative = 0;
  bool within = true;
  void add(const std::vector<double>& got, const std::vector<double>& ref) {
    double largest = 0;
    for (const double v : ref) largest = std::max(largest, std::abs(v));
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double diff = std::abs(got[i] - ref[i]);
      within = within && diff <= abs * largest + rel * std::abs(ref[i]);
      of_largest = std::max(of_largest, diff / largest);
      if (std::abs(ref[i]) >= 1e-3 * largest)
        relative = std::max(relative, diff / std::abs(ref[i]));
    }
  }
};

bool read_values(std::istream& in, std::vector<double>& v, std::size_t count) {
  v.resize(count);
  for (auto& x : v)
    if (!(in >> x)) return false;
  return true;
}

template <class T>
std::vector<double> widen(const std::vector<T>& v, std::size_t first, std::size_t count) {
  return {v.begin() + static_cast<std::ptrdiff_t>(first),
          v.begin() + static_cast<std::ptrdiff_t>(first + count)};
}

// Compares one case; false when torch's file is cut short (sets `bad_file`).
template <class C>
bool compare_case(std::istream& torch, const Entry<C>& e, std::size_t k, bool& bad_file) {
  using L = typename C::L;
  const auto in = inputs(e);
  std::vector<double> ref_y, ref_dx;
  if (!read_values(torch, ref_y, in.n * L::output_shape::size) ||
      !read_values(torch, ref_dx, in.x.size())) {
    bad_file = true;
    return false;
  }
  struct Named {
    std::string name;
    std::size_t offset, size;
    std::vector<double> ref;
  };
  std::vector<Named> grads;
  L::tensors([&](std::string_view name, std::size_t offset,
                 std::initializer_list<std::size_t> shape, bool) {
    std::size_t size = 1;
    for (const std::size_t d : shape) size *= d;
    grads.push_back({std::string(name), offset, size, {}});
  });
  for (auto& g : grads)
    if (!read_values(torch, g.ref, g.size)) {
      bad_file = true;
      return false;
    }
  std::vector<float> y32, dx32, dp32;
  std::vector<double> y64, dx64, dp64;
  run<float>(e, in, y32, dx32, dp32);
  run<double>(e, in, y64, dx64, dp64);
  bool ok = true;
  // float: its rounding through the steps and sums (a few ulp of the
  // largest value; more, relative, where a sum cancels); double: the same
  // equations, to rounding.
  const auto compare = [&](const char* what, const auto& got32, const std::vector<double>& got64,
                           const std::vector<double>& ref) {
    Errors f{1e-6, 1e-5}, d{1e-13, 1e-11};
    f.add(got32, ref);
    d.add(got64, ref);
    const bool agree = f.within && d.within;
    std::printf(
        "  %-22s float: max |diff| %.3g of the largest, max relative %.3g; "
        "double: %.3g, %.3g: %s\n",
        what, f.of_largest, f.relative, d.of_largest, d.relative, agree ? "agree" : "DIFFER");
    ok = ok && agree;
  };
  std::printf("case %zu: %s, sequence %d, bidirectional %d, hidden %zu, %zu x %zu, batch %zu, %s\n",
              k, std::string(L::kind).c_str(), int{C::Spec::sequence}, int{C::Spec::bidirectional},
              C::Spec::hidden, C::steps, C::features, in.n,
              e.frames.empty() ? "no lengths" : "lengths");
  compare("output", widen(y32, 0, y32.size()), y64, ref_y);
  compare("input gradient", widen(dx32, 0, dx32.size()), dx64, ref_dx);
  for (const auto& g : grads)
    compare(g.name.c_str(), widen(dp32, g.offset, g.size), widen(dp64, g.offset, g.size), g.ref);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc >= 2 ? argv[1] : "";
  if (mode == "write" && argc == 3) {
    std::ofstream out(argv[2]);
    std::size_t count = 0;
    for_each_case([&](const auto&) { ++count; });
    out << count << '\n';
    for_each_case([&](const auto& e) { write_case(out, e); });
    out.close();
    if (!out) {
      std::fprintf(stderr, "recurrent_torch_check: cannot write %s\n", argv[2]);
      return 2;
    }
    return 0;
  }
  if (mode == "compare" && argc == 4) {
    std::ifstream torch(argv[3]);
    bool ok = true, bad_file = false;
    std::size_t k = 0;
    for_each_case([&](const auto& e) {
      if (!bad_file) ok = compare_case(torch, e, k++, bad_file) && ok;
    });
    if (bad_file || !torch) {
      std::fprintf(stderr, "recurrent_torch_check: %s is cut short at case %zu\n", argv[3], k - 1);
      return 2;
    }
    return ok ? 0 : 1;
  }
  std::fprintf(stderr, "usage: %s write CASES | %s compare CASES TORCH_RESULTS\n", argv[0],
               argv[0]);
  return 2;
}
