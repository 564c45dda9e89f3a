// ModelSplit's compile-time partition: At<...> bounds, and Balanced<S>
// against a brute-force search over every cut between executed (fused)
// layers, for LeNet and a 12-layer MLP of uneven widths. Everything here is
// a constant expression.
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

// The cheapest bottleneck over every cut into S non-empty stages that
// keeps each fused pair (Linear, ReLU) in one stage.
template <class Net, std::size_t S>
constexpr double brute_force_bottleneck() {
  constexpr std::size_t L = Net::layer_count;
  std::array<std::size_t, S + 1> b{};
  b[S] = L;
  double best = std::numeric_limits<double>::infinity();
  // Odometer over increasing cut positions b[1] < ... < b[S-1] in [1, L-1].
  for (std::size_t k = 1; k < S; ++k) b[k] = k;
  for (;;) {
    if (cuts_between_executed<Net>(b)) best = std::min(best, bottleneck<Net>(b));
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
  return bounds[0] == 0 && bounds[S] == Net::layer_count && cuts_between_executed<Net>(bounds) &&
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

TEST_CASE("partition: a stage as a range of the whole network's layers is that stage, bit for bit") {
  // Cut before layers 4 and 7: the executed (fused) layers [0, 2), [2, 4)
  // and [4, 7); the last range begins with Flatten, which works in place.
  using Cut = At<4, 7>;
  constexpr auto bounds = partition_bounds<LeNet, Cut>::bounds;
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  STATIC_REQUIRE(cuts_between_executed<LeNet>(bounds));
  STATIC_REQUIRE(executed_from<LeNet>(bounds[1]) == 2);
  STATIC_REQUIRE(executed_from<LeNet>(bounds[2]) == 4);
  STATIC_REQUIRE(executed_from<LeNet>(1) == none);  // the ReLU fused into Conv2d<20, 5>
  STATIC_REQUIRE(!cuts_between_executed<LeNet>(partition_bounds<LeNet, At<2>>::bounds));
  // Balanced<4> would take Conv2d<20, 5> alone (brute force over every cut);
  // it keeps the conv's ReLU with it.
  STATIC_REQUIRE(partition_bounds<LeNet, Balanced<4>>::bounds ==
                 std::array<std::size_t, 5>{0, 2, 3, 6, 10});
  // Each range's activation memory is its stage network's.
  STATIC_REQUIRE(Model<LeNet>::activation_elements(8, 3, {2, 4}) ==
                 Model<stage_net_t<LeNet, Cut, 1>>::activation_elements(8, 3));
  STATIC_REQUIRE(Model<LeNet>::activation_elements(8, 3, {4, 7}) ==
                 Model<stage_net_t<LeNet, Cut, 2>>::activation_elements(8, 3));

  constexpr std::size_t n = 16;
  // In bf16 too: each range rounds what the whole network rounds.
  const auto check = [&](Precision precision) {
    INFO(precision_name(precision));
    Model<LeNet, float> whole(3);
    std::vector<Model<LeNet, float>> stages;
    for (const LayerRange range : {LayerRange{0, 2}, LayerRange{2, 4}, LayerRange{4, 7}})
      stages.emplace_back(range, 3);
    whole.set_precision(precision);
    for (auto& stage : stages) stage.set_precision(precision);
    // Seeded alike: each range holds its slice of the whole's weights.
    std::vector<float> joined;
    for (auto& stage : stages)
      joined.insert(joined.end(), stage.parameters().begin(), stage.parameters().end());
    loom::test::require_equal(joined, std::vector<float>(whole.parameters().begin(),
                                                         whole.parameters().end()),
                              "the ranges' weights");
    REQUIRE(stages[1].range_input_size() == 20 * 12 * 12);
    REQUIRE(stages[1].range_output_size() == 800);

    const float* images = loom::test::fashion().test.images.data();
    const float* expected = whole.forward(images, n);
    const float* got = stages[2].forward(stages[1].forward(stages[0].forward(images, n), n), n);
    loom::test::require_equal(std::vector<float>(got, got + n * 10),
                              std::vector<float>(expected, expected + n * 10), "chained ranges");

    // Backward: the same loss gradient gives the same weight gradients, and
    // each range hands the one before it the gradient of its input.
    for (std::size_t i = 0; i < n * 10; ++i) {
      const float dy = 0.01f * static_cast<float>(i % 7) - 0.03f;
      whole.output_gradient()[i] = dy;
      stages[2].output_gradient()[i] = dy;
    }
    whole.backward();
    std::vector<std::size_t> done;
    std::vector<float> dx2(n * 800), dx1(n * 20 * 12 * 12);
    stages[2].backward(0, false, dx2.data(), [&](std::size_t i) { done.push_back(i); });
    REQUIRE(done == std::vector<std::size_t>{2, 1, 0});  // numbered from the range's first
    std::copy(dx2.begin(), dx2.end(), stages[1].output_gradient());
    stages[1].backward(0, false, dx1.data());
    std::copy(dx1.begin(), dx1.end(), stages[0].output_gradient());
    stages[0].backward(0, false, nullptr);
    joined.clear();
    for (auto& stage : stages)
      joined.insert(joined.end(), stage.gradients().begin(), stage.gradients().end());
    loom::test::require_equal(joined, std::vector<float>(whole.gradients().begin(),
                                                         whole.gradients().end()),
                              "the ranges' gradients");
  };
  check(Precision::fp32);
  check(Precision::bf16);

  REQUIRE_THROWS_WITH((Model<LeNet, float>(LayerRange{3, 3})),
                      Catch::Contains("Model: layers [3, 3) are no range of the network's 7 "
                                      "executed layers"));
}
