// ModelSplit on CPU worker devices against single-device training on the
// same global batches: the schedules' pass orders, the memory plan and the
// measured high-water mark, equal weights for both schedules over several
// partitions (At and Balanced, 2 to 4 stages), accumulation, the loss seen
// by callbacks and evaluation, and failures.
#include <loom/loom.hpp>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "policy_test.hpp"

using namespace loom;
namespace test = loom::test;
using test::fashion;
using test::head;
using test::LeNet;
using test::Logistic;
using test::sgd;
using test::single_device;
using test::trained;

namespace {

template <class Net, class Policy>
std::vector<float> split(const data::Dataset& data, FitOptions fit) {
  Trainer<Net, Policy> trainer(devices::cpu(Policy::stages), sgd, {.seed = 7});
  return trained(trainer, data, fit);
}

// Replays a schedule's passes: each micro-batch forward once, then backward
// once, and the most micro-batches alive at once. Returns 0 if broken.
constexpr std::size_t replay(PipelineKind kind, std::size_t stages, std::size_t stage,
                             std::size_t m) {
  std::size_t forwards = 0, backwards = 0, alive = 0, peak = 0;
  bool ok = true;
  for_each_pipeline_op(kind, stages, stage, m, [&](PipelineOp op) {
    if (op.forward) {
      ok = ok && op.micro_batch == forwards++;
      peak = std::max(peak, ++alive);
    } else {
      ok = ok && op.micro_batch == backwards++ && op.micro_batch < forwards;
      --alive;
    }
  });
  return ok && forwards == m && backwards == m && alive == 0 ? peak : 0;
}

constexpr bool schedules_hold_their_bound() {
  for (std::size_t s = 1; s <= 6; ++s)
    for (std::size_t k = 0; k < s; ++k)
      for (std::size_t m = 1; m <= 33; ++m) {
        if (replay(PipelineKind::gpipe, s, k, m) != m) return false;
        const std::size_t peak = replay(PipelineKind::one_f_one_b, s, k, m);
        if (peak != std::min(m, s - k) || peak != pipeline_in_flight(PipelineKind::one_f_one_b, s, k, m))
          return false;
      }
  return true;
}

}  // namespace

TEST_CASE("schedules: GPipe keeps M micro-batches alive, 1F1B at most S - k") {
  STATIC_REQUIRE(schedules_hold_their_bound());
  // Stage 0 of 4 with 6 micro-batches: three to fill the pipeline, then one
  // forward and one backward, then the rest of the backwards.
  const auto ops = pipeline_ops(PipelineKind::one_f_one_b, 4, 0, 6);
  std::string order;
  for (const auto op : ops) {
    order += op.forward ? 'F' : 'B';
    order += std::to_string(op.micro_batch);
    order += ' ';
  }
  REQUIRE(order == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  STATIC_REQUIRE(ideal_bubble(4, 12) == 3.0 / 15.0);
}

TEST_CASE("ModelSplit: the memory plan per stage, at compile time") {
  using Split = ModelSplit<At<4, 8>, OneFOneB<8>>;
  constexpr auto plan = pipeline_memory_plan<LeNet, Split>(64);
  STATIC_REQUIRE(plan.size() == 3);
  STATIC_REQUIRE(plan[0].first_layer == 1);
  STATIC_REQUIRE(plan[0].last_layer == 3);
  STATIC_REQUIRE(plan[1].first_layer == 4);
  STATIC_REQUIRE(plan[2].last_layer == 10);
  STATIC_REQUIRE(plan[0].parameters + plan[1].parameters + plan[2].parameters ==
                 LeNet::parameter_count);
  STATIC_REQUIRE(plan[0].micro_batch == 8);
  STATIC_REQUIRE(plan[0].in_flight == 3);
  STATIC_REQUIRE(plan[1].in_flight == 2);
  STATIC_REQUIRE(plan[2].in_flight == 1);
  constexpr auto gpipe = pipeline_memory_plan<LeNet, Split>(64, GPipe<8>::schedule);
  STATIC_REQUIRE(gpipe[2].in_flight == 8);
  // Stage 1 (conv2, relu, pool) keeps, per micro-batch in flight, its input
  // (20x12x12), conv2's fused output (50x8x8) and the pool's (50x4x4).
  STATIC_REQUIRE(gpipe[1].activation_elements - plan[1].activation_elements ==
                 6 * 8 * (2880 + 3200 + 800));
  // A batch smaller than M: one sample per micro-batch.
  STATIC_REQUIRE(pipeline_memory_plan<LeNet, Split>(5)[0].micro_batch == 1);
}

TEST_CASE("ModelSplit: the measured high-water mark is the memory plan's") {
  const auto part = head(fashion().train, 256);
  using Split = ModelSplit<Balanced<3>, OneFOneB<8>>;
  for (const auto schedule : {PipelineSchedule{PipelineKind::one_f_one_b, 8},
                              PipelineSchedule{PipelineKind::gpipe, 8}}) {
    INFO(pipeline_kind_name(schedule.kind));
    Trainer<LeNet, Split> trainer(devices::cpu(3), sgd, {.seed = 1, .schedule = schedule});
    trainer.fit(part, {.epochs = 1, .batch_size = 64});
    const auto plan = pipeline_memory_plan<LeNet, Split>(64, schedule);
    for (std::size_t k = 0; k < 3; ++k) {
      const auto report = trainer.model_split().report(k);
      REQUIRE(report.stage == k);
      CHECK(report.peak_in_flight == plan[k].in_flight);
      CHECK(report.activation_elements == plan[k].activation_elements);
    }
  }
}

TEST_CASE("ModelSplit: the policy's schedule runs unless TrainerOptions::schedule names one") {
  const auto part = head(fashion().train, 128);
  Trainer<LeNet, ModelSplit<Balanced<3>, GPipe<8>>> policy(devices::cpu(3), sgd, {.seed = 1});
  REQUIRE(policy.model_split().schedule().kind == PipelineKind::gpipe);
  REQUIRE(policy.model_split().schedule().micro_batches == 8);
  policy.fit(part, {.epochs = 1, .batch_size = 64});
  CHECK(policy.model_split().report(0).peak_in_flight == 8);  // GPipe's, not 1F1B's 3
  Trainer<LeNet, ModelSplit<Balanced<3>, GPipe<8>>> chosen(
      devices::cpu(3), sgd, {.seed = 1, .schedule = {PipelineKind::one_f_one_b, 4}});
  REQUIRE(chosen.model_split().schedule().kind == PipelineKind::one_f_one_b);
  REQUIRE(chosen.model_split().schedule().micro_batches == 4);
  chosen.fit(part, {.epochs = 1, .batch_size = 64});
  CHECK(chosen.model_split().report(0).peak_in_flight == 3);
}

TEST_CASE("ModelSplit on 2-4 CPU workers reaches the single-device weights, both schedules") {
  // 490 samples in batches of 60: 8 full steps, then 10 (micro-batches 3/3/2/2).
  const auto part = head(fashion().train, 490);
  const FitOptions fit{.epochs = 1, .batch_size = 60, .seed = 3};
  const auto reference = single_device<LeNet>(part, fit);
  // Micro-batches sum the gradient in another grouping: FP32 rounding over 9 steps.
  const test::Tolerance tolerance{1e-6, 1e-4};
  test::require_close(split<LeNet, ModelSplit<At<4>, GPipe<4>>>(part, fit), reference, tolerance,
                      "At<4>, GPipe<4>");
  test::require_close(split<LeNet, ModelSplit<At<4>, OneFOneB<4>>>(part, fit), reference,
                      tolerance, "At<4>, 1F1B<4>");
  // Stage 2 starts with Flatten, which passes its gradient through.
  test::require_close(split<LeNet, ModelSplit<At<4, 7>, OneFOneB<6>>>(part, fit), reference,
                      tolerance, "At<4, 7>, 1F1B<6>");
  test::require_close(split<LeNet, ModelSplit<At<2, 4, 9>, GPipe<5>>>(part, fit), reference,
                      tolerance, "At<2, 4, 9>, GPipe<5>");
  test::require_close(split<LeNet, ModelSplit<Balanced<2>, OneFOneB<8>>>(part, fit), reference,
                      tolerance, "Balanced<2>, 1F1B<8>");
  test::require_close(split<LeNet, ModelSplit<Balanced<3>, GPipe<3>>>(part, fit), reference,
                      tolerance, "Balanced<3>, GPipe<3>");
  test::require_close(split<LeNet, ModelSplit<Balanced<4>, OneFOneB<4>>>(part, fit), reference,
                      tolerance, "Balanced<4>, 1F1B<4>");
  // One micro-batch: the same arithmetic as one device, stage by stage
  // (with as many BLAS threads as each stage has: GEMMs split their sums by thread).
  test::require_equal(split<LeNet, ModelSplit<At<8>, GPipe<1>>>(part, fit),
                      single_device<LeNet>(part, fit, devices::cpu(2).front().threads),
                      "At<8>, one micro-batch");
}

TEST_CASE("ModelSplit is bit-for-bit reproducible, batches smaller than M work") {
  const auto part = head(fashion().train, 300);
  const FitOptions fit{.epochs = 2, .batch_size = 50, .seed = 4};
  using Split = ModelSplit<Balanced<3>, OneFOneB<4>>;
  test::require_equal(split<LeNet, Split>(part, fit), split<LeNet, Split>(part, fit),
                      "two runs on 3 stages");
  const auto tiny = head(fashion().train, 12);
  const FitOptions small{.epochs = 2, .batch_size = 2, .seed = 5};  // 2 micro-batches of 1
  test::require_close(split<LeNet, Split>(tiny, small), single_device<LeNet>(tiny, small),
                      {1e-6, 1e-4}, "weights after 12 steps of 2 samples");
}

TEST_CASE("ModelSplit: gradient accumulation, callbacks' loss and evaluation match one device") {
  const auto part = head(fashion().train, 290);
  const FitOptions accumulated{.epochs = 1, .batch_size = 20, .seed = 6, .accumulation_steps = 3};
  test::require_close(split<LeNet, ModelSplit<Balanced<2>, GPipe<4>>>(part, accumulated),
                      single_device<LeNet>(part, {.epochs = 1, .batch_size = 60, .seed = 6}),
                      {1e-6, 1e-4}, "2 stages, 3 x 20, a short last group");

  Trainer<LeNet, ModelSplit<Balanced<3>, OneFOneB<4>>> pipeline(devices::cpu(3), sgd, {.seed = 7});
  test::require_same_reports(pipeline, part, {.epochs = 1, .batch_size = 50, .seed = 8},
                             fashion().test, 6);
}

TEST_CASE("ModelSplit: weights changed through model() go back to the stages") {
  const auto part = head(fashion().train, 100);
  Trainer<Logistic, ModelSplit<At<2>, OneFOneB<2>>> trainer(devices::cpu(2), sgd);
  auto& model = trainer.model();
  std::fill(model.parameters().begin(), model.parameters().end(), 0.0f);
  // All-zero weights: every logit is 0, the loss is ln 10 for every sample.
  REQUIRE(trainer.evaluate(part).loss == Approx(std::log(10.0)).epsilon(1e-6));
}

TEST_CASE("ModelSplit: a NaN loss stops fit at the same step as one device, weights kept") {
  Trainer<LeNet, ModelSplit<Balanced<2>, OneFOneB<4>>> pipeline(devices::cpu(2), sgd, {.seed = 2});
  test::require_nan_stops_like_one_device(pipeline, {1e-6, 1e-4});
}

TEST_CASE("ModelSplit: a failing stage's own error reaches fit, the others do not hang") {
  const auto part = head(fashion().train, 100);
  std::vector<std::int32_t> labels(part.labels);
  labels[77] = 12;  // micro-batch 3 of 4 (75..99), at the last stage's loss
  Trainer<LeNet, ModelSplit<Balanced<3>, OneFOneB<4>>> trainer(devices::cpu(3), sgd);
  auto& engine = trainer.model_split();
  REQUIRE_THROWS_WITH(engine.micro_step(part.images.data(), labels.data(), 100, 100, false, true,
                                        {.lr = 0.01f}),
                      Catch::Contains("label 12 of sample 2 is outside the network's 10 classes"));
  REQUIRE_THROWS_WITH(trainer.fit(part, {.epochs = 1, .batch_size = 100}),
                      Catch::Contains("an earlier step failed"));
  REQUIRE_THROWS_WITH((Trainer<LeNet, ModelSplit<Balanced<3>>>(devices::cpu(2), sgd)),
                      Catch::Contains("ModelSplit runs on 3 device(s) but 2 were given"));
}

TEST_CASE("ModelSplit: a weight changed through model() at an epoch's last step is kept") {
  using Split = Trainer<LeNet, ModelSplit<Balanced<2>>>;
  // The epoch's end gathers the stages' weights: the edit reaches them first.
  struct EditAtLastStep {
    void on_step(const StepInfo& s, Split& trainer) {
      if (s.step == s.steps) trainer.model().parameters()[0] = 0.25f;
    }
  };
  Split trainer(devices::cpu(2), sgd, {.seed = 1});
  trainer.fit(head(fashion().train, 120), {.epochs = 1, .batch_size = 60}, EditAtLastStep{});
  REQUIRE(trainer.model().parameters()[0] == 0.25f);
  // Without the edit the weight is another, so the check above can fail.
  Split reference(devices::cpu(2), sgd, {.seed = 1});
  reference.fit(head(fashion().train, 120), {.epochs = 1, .batch_size = 60});
  REQUIRE(reference.model().parameters()[0] != 0.25f);
}
