// The downstream program: it compiles only if loom::loom carries C++20 and the
// include path, links only if OpenBLAS and zlib come along, and exits 0 only
// if a network trains one step and a misuse raises the loom::Error promised.
#include <cmath>
#include <cstdio>
#include <loom/loom.hpp>
#include <string>
#include <vector>

using Net = loom::Sequential<loom::Input<1, 6, 6>, loom::Conv2d<2, 3>, loom::ReLU, loom::Flatten,
                             loom::Linear<3>>;
static_assert(Net::parameter_count == (2 * 9 + 2) + (32 * 3 + 3));

int main() {
  loom::Model<Net> model(1);
  loom::SGD::State<float> sgd({.lr = 0.1f}, Net::parameter_count);
  std::vector<float> images(2 * 36);
  for (std::size_t i = 0; i < images.size(); ++i) images[i] = static_cast<float>(i % 7) / 7.0f;
  const std::vector<std::int32_t> labels{0, 2};
  const float* logits = model.forward(images.data(), 2);
  const auto sums = loom::SoftmaxCrossEntropy::evaluate<float>(logits, labels.data(), 2, 3, 2,
                                                               model.output_gradient());
  model.backward();
  sgd.step(model.parameters(), model.gradients());
  if (!std::isfinite(sums.loss) || sums.loss <= 0.0) {
    std::fprintf(stderr, "unexpected loss %f\n", sums.loss);
    return 1;
  }
  try {
    model.forward(images.data(), 0);
    std::fprintf(stderr, "an empty batch did not raise loom::Error\n");
    return 1;
  } catch (const loom::Error& error) {
    const std::string message = error.what();
    if (message.find("loom: Model::forward: empty batch [") != 0) {
      std::fprintf(stderr, "unexpected loom::Error message: %s\n", message.c_str());
      return 1;
    }
  }
  std::printf("downstream: trained one step (loss %.4f); loom::Error caught as expected\n",
              sums.loss);
  return 0;
}
