// ctc_torch_check WORK_FILE: loom's cpu::ctc_loss<float> against the PyTorch
// loss and gradient that ctc_torch.py wrote into WORK_FILE with the inputs,
// torch's float32 and float64 results. Prints the largest relative errors;
// exit status 0 when they stay within 1e-4 of float32 torch and 1e-6 of
// float64 torch, 1 when not, 2 when the file cannot be read.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <loom/backend/cpu/ctc.hpp>
#include <vector>

namespace {

template <class V>
bool read(std::istream& in, std::vector<V>& values, std::size_t count) {
  values.resize(count);
  for (auto& v : values)
    if (!(in >> v)) return false;
  return true;
}

// The loss's relative error, and the gradient's over the entries that are
// not rounding noise (|g| >= 1e-3 of the largest); the other entries must be
// within `limit` of the largest in absolute terms.
bool compare(const char* torch_type, double loss, const std::vector<float>& grad, double ref_loss,
             const std::vector<double>& ref_grad, double limit) {
  const double loss_error = std::abs(loss - ref_loss) / std::abs(ref_loss);
  double largest = 0;
  for (const double g : ref_grad) largest = std::max(largest, std::abs(g));
  double grad_error = 0, small_error = 0;
  for (std::size_t j = 0; j < grad.size(); ++j) {
    const double diff = std::abs(grad[j] - ref_grad[j]);
    if (std::abs(ref_grad[j]) >= 1e-3 * largest)
      grad_error = std::max(grad_error, diff / std::abs(ref_grad[j]));
    else
      small_error = std::max(small_error, diff / largest);
  }
  const bool agree = loss_error <= limit && grad_error <= limit && small_error <= limit;
  std::printf(
      "  against torch %s: loss %.9g, relative error %.3g; gradient max relative error "
      "%.3g, small entries %.3g of the largest (limit %g): %s\n",
      torch_type, ref_loss, loss_error, grad_error, small_error, limit, agree ? "agree" : "DIFFER");
  return agree;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s WORK_FILE (written by ctc_torch.py)\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  std::size_t cases = 0;
  if (!(in >> cases) || cases == 0) {
    std::fprintf(stderr, "ctc_torch_check: %s holds no cases\n", argv[1]);
    return 2;
  }
  bool ok = true;
  for (std::size_t k = 0; k < cases; ++k) {
    std::size_t n = 0, max_frames = 0, classes = 0, max_target = 0;
    int zero_infinity = 0;
    std::vector<std::int32_t> frames, lengths, targets;
    std::vector<float> logits;
    std::vector<double> loss32, grad32, loss64, grad64;
    in >> n >> max_frames >> classes >> max_target >> zero_infinity;
    const std::size_t size = n * max_frames * classes;
    if (!in || !read(in, frames, n) || !read(in, lengths, n) ||
        !read(in, targets, n * max_target) || !read(in, logits, size) || !read(in, loss32, 1) ||
        !read(in, grad32, size) || !read(in, loss64, 1) || !read(in, grad64, size)) {
      std::fprintf(stderr, "ctc_torch_check: case %zu of %s is cut short\n", k, argv[1]);
      return 2;
    }
    std::vector<float> grad(size);
    const auto sums = loom::cpu::ctc_loss(
        logits.data(), n, max_frames, classes, frames.data(), targets.data(), max_target,
        lengths.data(), 1.0f / static_cast<float>(n), grad.data(), zero_infinity != 0, 0);
    const double loss = sums.loss / static_cast<double>(n);
    std::printf(
        "case %zu (n %zu, frames %zu, classes %zu, zero_infinity %d, %zu zeroed): loom %.9g\n", k,
        n, max_frames, classes, zero_infinity, sums.infinite, loss);
    ok = ok && (zero_infinity != 0 || sums.infinite == 0);
    ok = compare("float32", loss, grad, loss32[0], grad32, 1e-4) && ok;
    ok = compare("float64", loss, grad, loss64[0], grad64, 1e-6) && ok;
  }
  return ok ? 0 : 1;
}
