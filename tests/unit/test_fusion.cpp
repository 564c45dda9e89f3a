// The fusion pass must not change what the network computes: fused and
// unfused LeNet, from the same seed and on real Fashion-MNIST images, give
// the same outputs, the same gradients and the same weights after training
// steps, to the bit (each fused epilogue does the same arithmetic in the
// same order as the separate layers).
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"

using namespace loom;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;

// Padding and stride on a fused convolution, and a ReLU right after Input.
using Strided = Sequential<Input<1, 28, 28>, ReLU, Conv2d<6, 3, 2, 1>, ReLU, Conv2d<8, 3, 1, 1>,
                           ReLU, AvgPool2d<2>, Flatten, Linear<32>, ReLU, Linear<10>>;

const data::Dataset& test_images() { return test::fashion().test; }

template <class Net>
void check_fused_equals_unfused() {
  STATIC_REQUIRE(Net::executed::size < Unfused<Net>::executed::size);
  const auto& data = test_images();
  constexpr std::size_t n = 48;
  Model<Net, float> fused(11);
  Model<Unfused<Net>, float> unfused(11);
  test::require_equal(fused.parameters(), unfused.parameters(), "initial weights");
  SGD::State<float> fused_sgd({.lr = 0.05f, .momentum = 0.9f}, Net::parameter_count);
  SGD::State<float> unfused_sgd({.lr = 0.05f, .momentum = 0.9f}, Net::parameter_count);

  for (std::size_t step = 0; step < 3; ++step) {
    const float* x = data.images.data() + step * n * data.sample_size();
    const std::int32_t* labels = data.labels.data() + step * n;
    const float* a = fused.forward(x, n);
    const float* b = unfused.forward(x, n);
    test::require_equal(std::vector<float>(a, a + n * 10), std::vector<float>(b, b + n * 10),
                        "outputs");
    const auto la =
        SoftmaxCrossEntropy::evaluate<float>(a, labels, n, 10, n, fused.output_gradient());
    const auto lb =
        SoftmaxCrossEntropy::evaluate<float>(b, labels, n, 10, n, unfused.output_gradient());
    REQUIRE(la.loss == lb.loss);
    fused.backward();
    unfused.backward();
    test::require_equal(fused.gradients(), unfused.gradients(), "gradients");
    fused_sgd.step(fused.parameters(), fused.gradients());
    unfused_sgd.step(unfused.parameters(), unfused.gradients());
  }
  test::require_equal(fused.parameters(), unfused.parameters(), "weights after 3 SGD steps");
}

}  // namespace

TEST_CASE("fusion: fused LeNet equals unfused LeNet on real images, bit for bit") {
  check_fused_equals_unfused<LeNet>();
}

TEST_CASE("fusion: fused strided/padded convolutions equal the unfused network") {
  check_fused_equals_unfused<Strided>();
}
