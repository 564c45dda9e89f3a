// gpt_torch_check WORK_DIR: a small GPT's loss and gradients in loom, for
// gpt_torch.py to hold against PyTorch's. Writes WORK_DIR/gpt.txt (learned
// positions) and WORK_DIR/gpt-rotary.txt (rotary positions in the
// attention, Rotary<10000>, and no position table): the shapes, loom's
// initial parameters (flat, in loom's order), a batch of fortunes windows
// and their next-byte targets, and loom's mean next-token loss and its
// gradient, both in double and in float. Exit status 0, or 1 with a message
// when the corpus cannot be read.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <loom/loom.hpp>
#include <vector>

using namespace loom;

namespace {

constexpr std::size_t context = 12, width = 16, heads = 2, vocab = 256, batch = 3;
using Attention = Residual<LayerNorm, CausalSelfAttention<heads>>;
using Mlp = Residual<LayerNorm, Linear<4 * width>, GELU, Linear<width>>;
using Gpt = Sequential<Input<context>, Embedding<vocab, width>, PositionEmbedding, Attention, Mlp,
                       Attention, Mlp, LayerNorm, Linear<vocab>>;
using RotaryAttention = Residual<LayerNorm, CausalSelfAttention<heads, Rotary<>>>;
using RotaryGpt = Sequential<Input<context>, Embedding<vocab, width>, RotaryAttention, Mlp,
                             RotaryAttention, Mlp, LayerNorm, Linear<vocab>>;

template <class Gpt, class T>
std::pair<double, std::vector<double>> loss_and_gradient(const data::Dataset& set) {
  Model<Gpt, T> model(21, batch);
  const std::vector<T> x(set.images.begin(), set.images.end());
  const T* logits = model.forward(x.data(), batch, 0, {.training = true});
  Targets targets;
  targets.sequences = set.targets.data();
  targets.max_target = context;
  const auto sums = PositionCrossEntropy::compute<typename Gpt::output_shape, T>(
      logits, batch, targets, T(1) / T(batch * context), model.output_gradient());
  model.backward();
  const auto g = model.gradients();
  return {sums.loss / static_cast<double>(batch * context), {g.begin(), g.end()}};
}

template <class Values>
void write_line(std::ostream& out, const Values& values) {
  for (const auto v : values) out << static_cast<double>(v) << ' ';
  out << '\n';
}

// The header line: context, width, heads, vocabulary, batch, the rotary
// base (0: none) and whether a position table follows the embedding.
template <class Gpt>
bool write_check(const std::filesystem::path& path, const data::Dataset& windows,
                 double rotary_theta) {
  std::ofstream out(path);
  out << std::setprecision(17);
  out << context << ' ' << width << ' ' << heads << ' ' << vocab << ' ' << batch << ' '
      << rotary_theta << ' ' << (rotary_theta > 0 ? 0 : 1) << '\n';
  const Model<Gpt, double> initial(21);
  write_line(out, initial.parameters());
  write_line(out, windows.images);
  write_line(out, windows.targets);
  const auto [loss64, grad64] = loss_and_gradient<Gpt, double>(windows);
  const auto [loss32, grad32] = loss_and_gradient<Gpt, float>(windows);
  out << loss64 << ' ' << loss32 << '\n';
  write_line(out, grad64);
  write_line(out, grad32);
  return out.good();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: gpt_torch_check WORK_DIR\n";
    return 2;
  }
  try {
    const auto windows = data::text_windows(data::read_fortunes().text, context, batch, 5,
                                            "fortunes");
    const std::filesystem::path dir(argv[1]);
    std::filesystem::create_directories(dir);
    const bool written = write_check<Gpt>(dir / "gpt.txt", windows, 0.0) &&
                         write_check<RotaryGpt>(dir / "gpt-rotary.txt", windows, 10000.0);
    return written ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
}
