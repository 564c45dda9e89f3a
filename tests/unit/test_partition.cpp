// ModelSplit's compile-time partition: At<...> bounds, and Balanced<S>
// against a brute-force search over every cut, for LeNet and a 12-layer MLP
// of uneven widths. Everything here is a constant expression.
#include <loom/loom.hpp>
#include <loom/parallel/partition.hpp>
#include <type_traits>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"

using namespace loom;

namespace {

using LeNet = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                         MaxPool2d<2>, Flatten, Linear<500>, ReLU, Linear<10>>;
using UnevenMlp = Sequential<Input<64>, Linear<512>, ReLU, Linear<32>, ReLU, Linear<1024>, ReLU,
                             Linear<16>, ReLU, Linear<2048>, ReLU, Linear<128>, Linear<10>>;
static_assert(UnevenMlp::layer_count == 12);

// The cheapest bottleneck over every cut into S non-empty stages.
template <class Net, std::size_t S>
constexpr double brute_force_bottleneck() {
  constexpr std::size_t L = Net::layer_count;
  std::array<std::size_t, S + 1> b{};
  b[S] = L;
  double best = std::numeric_limits<double>::infinity();
  // Odometer over increasing cut positions b[1] < ... < b[S-1] in [1, L-1].
  for (std::size_t k = 1; k < S; ++k) b[k] = k;
  for (;;) {
    best = std::min(best, bottleneck<Net>(b));
    std::size_t k = S - 1;
    while (k >= 1 && b[k] == L - (S - k)) --k;
    if (k == 0) break;
    ++b[k];
    for (std::size_t j = k + 1; j < S; ++j) b[j] = b[j - 1] + 1;
  }
  return best;
}

template <class Net, std::size_t S>
constexpr bool balanced_is_optimal() {
  constexpr auto bounds = partition_bounds<Net, Balanced<S>>::bounds;
  for (std::size_t k = 0; k < S; ++k)
    if (bounds[k] >= bounds[k + 1]) return false;  // every stage non-empty
  return bounds[0] == 0 && bounds[S] == Net::layer_count &&
         bottleneck<Net>(bounds) == brute_force_bottleneck<Net, S>();
}

}  // namespace

TEST_CASE("partition: At<...> cuts before the named layers") {
  constexpr auto b = partition_bounds<LeNet, At<4, 8>>::bounds;
  STATIC_REQUIRE(b.size() == 4);
  STATIC_REQUIRE(b[0] == 0);
  STATIC_REQUIRE(b[1] == 3);  // stage 1 starts with layer 4 (Conv2d<50, 5>)
  STATIC_REQUIRE(b[2] == 7);  // stage 2 starts with layer 8 (Linear<500>)
  STATIC_REQUIRE(b[3] == 10);
}

TEST_CASE("partition: Balanced<S> is the brute-force optimum of the cost model") {
  STATIC_REQUIRE(balanced_is_optimal<LeNet, 1>());
  STATIC_REQUIRE(balanced_is_optimal<LeNet, 2>());
  STATIC_REQUIRE(balanced_is_optimal<LeNet, 3>());
  STATIC_REQUIRE(balanced_is_optimal<LeNet, 4>());
  STATIC_REQUIRE(balanced_is_optimal<UnevenMlp, 2>());
  STATIC_REQUIRE(balanced_is_optimal<UnevenMlp, 3>());
  STATIC_REQUIRE(balanced_is_optimal<UnevenMlp, 4>());
  STATIC_REQUIRE(balanced_is_optimal<UnevenMlp, 6>());
}

TEST_CASE("partition: the cost model counts FLOPs, updates and the activations crossing a cut") {
  using Cost = StageCostModel<LeNet>;
  // Layer 4, Conv2d<50, 5> on 20x12x12: forward 3 203 200 + backward 6 403 200
  // FLOPs, plus 4 x 25 050 parameters over 64 samples.
  STATIC_REQUIRE(Cost::layer[3] == 3203200.0 + 6403200.0 + 4.0 * 25050 / 64);
  // A stage [3, 7) receives layer 3's 20x12x12 output and sends layer 7's 800.
  STATIC_REQUIRE(Cost::stage(3, 7) == Cost::layer[3] + Cost::layer[4] + Cost::layer[5] +
                                          Cost::layer[6] + 2.0 * 2880 * 4 + 2.0 * 800 * 4);
  // LeNet's second convolution is 72 % of the work, so its stage is the
  // bottleneck: two stages cut after its pooling, where the activation
  // crossing is smallest (800 values, not 3200); three put conv2 alone.
  constexpr auto two = partition_bounds<LeNet, Balanced<2>>::bounds;
  STATIC_REQUIRE(two[1] == 6);
  constexpr auto three = partition_bounds<LeNet, Balanced<3>>::bounds;
  STATIC_REQUIRE(three[1] == 3);
  STATIC_REQUIRE(three[2] == 6);
}

TEST_CASE("partition: each stage is a network of its own whose forward chains to the whole's") {
  using Cut = At<4, 8>;
  using S0 = stage_net_t<LeNet, Cut, 0>;
  using S1 = stage_net_t<LeNet, Cut, 1>;
  using S2 = stage_net_t<LeNet, Cut, 2>;
  // Each stage keeps its layers' numbers in the whole network (1, 4 and 8).
  STATIC_REQUIRE(std::is_same_v<S0, detail::Network<1, Shape<1, 28, 28>, Conv2d<20, 5>, ReLU,
                                                    MaxPool2d<2>>>);
  STATIC_REQUIRE(std::is_same_v<S1, detail::Network<4, Shape<20, 12, 12>, Conv2d<50, 5>, ReLU,
                                                    MaxPool2d<2>, Flatten>>);
  STATIC_REQUIRE(
      std::is_same_v<S2, detail::Network<8, Shape<800>, Linear<500>, ReLU, Linear<10>>>);
  STATIC_REQUIRE(type_at_t<0, S1::layers>::index == 4);
  STATIC_REQUIRE(S0::parameter_count + S1::parameter_count + S2::parameter_count ==
                 LeNet::parameter_count);
  STATIC_REQUIRE(stage_parameter_offset<LeNet, Cut, 1> == S0::parameter_count);
  STATIC_REQUIRE(stage_parameter_offset<LeNet, Cut, 2> ==
                 S0::parameter_count + S1::parameter_count);

  // The stages, given the whole model's weights, compute its outputs bit for bit.
  constexpr std::size_t n = 16;
  Model<LeNet, float> whole(3);
  Model<S0, float> m0(0);
  Model<S1, float> m1(0);
  Model<S2, float> m2(0);
  const auto copy_into = [&](auto& stage, std::size_t offset) {
    const auto from = whole.parameters().subspan(offset, stage.parameters().size());
    std::copy(from.begin(), from.end(), stage.parameters().begin());
  };
  copy_into(m0, stage_parameter_offset<LeNet, Cut, 0>);
  copy_into(m1, stage_parameter_offset<LeNet, Cut, 1>);
  copy_into(m2, stage_parameter_offset<LeNet, Cut, 2>);
  const float* images = loom::test::fashion().test.images.data();
  const float* expected = whole.forward(images, n);
  const float* got = m2.forward(m1.forward(m0.forward(images, n), n), n);
  loom::test::require_equal(std::vector<float>(got, got + n * 10),
                            std::vector<float>(expected, expected + n * 10), "chained stages");
}
