// The pipeline schedule check (parallel/schedule_check.hpp): each stage's
// sends and receives derived from a schedule, GPipe and 1F1B proved to
// complete over 1..8 stages and 1..16 micro-batches at compile time and at
// run time, and broken schedules caught with the stage, transfer and
// micro-batch that fail.
#include <loom/parallel/schedule.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loom_test.hpp"

using namespace loom;

namespace {

using GPipeOrder = BuiltinSchedule<PipelineKind::gpipe>;
using OneFOneBOrder = BuiltinSchedule<PipelineKind::one_f_one_b>;

constexpr std::size_t max_stages = 8, max_micro_batches = 16;

// One constant evaluation per (S, M): g++ bounds the operations of each.
template <class Generator, std::size_t S, std::size_t M>
constexpr bool completes = pipeline_schedule_check<Generator, S, M>().ok();

// Every (S, M) in 1..8 x 1..16 at compile time: how many complete.
template <class Generator, std::size_t... I>
constexpr std::size_t completing(std::index_sequence<I...>) {
  return ((completes<Generator, I / max_micro_batches + 1, I % max_micro_batches + 1> ? 1 : 0) +
          ...);
}

constexpr auto every_size = std::make_index_sequence<max_stages * max_micro_batches>{};

// GPipe, except that stage `Stage` runs its backwards in reverse micro-batch order.
template <std::size_t Stage>
struct ReversedBackwards {
  template <class F>
  static constexpr void for_each_op(std::size_t, std::size_t stage, std::size_t m, F&& f) {
    for (std::size_t i = 0; i < m; ++i) f(PipelineOp{true, i});
    for (std::size_t i = 0; i < m; ++i) f(PipelineOp{false, stage == Stage ? m - 1 - i : i});
  }
};

// 1F1B, except that stage 0 runs each micro-batch's backward right after
// its forward: the gradient it waits for needs the next forward's send.
struct EagerFirstStage {
  template <class F>
  static constexpr void for_each_op(std::size_t stages, std::size_t stage, std::size_t m, F&& f) {
    if (stage > 0) return OneFOneBOrder::for_each_op(stages, stage, m, f);
    for (std::size_t i = 0; i < m; ++i) {
      f(PipelineOp{true, i});
      f(PipelineOp{false, i});
    }
  }
};

// GPipe, except that stage 2 never runs micro-batch 2's backward.
struct SkippedBackward {
  template <class F>
  static constexpr void for_each_op(std::size_t stages, std::size_t stage, std::size_t m, F&& f) {
    GPipeOrder::for_each_op(stages, stage, m, [&](PipelineOp op) {
      if (stage != 2 || op.forward || op.micro_batch != 2) f(op);
    });
  }
};

constexpr bool same(const PipelineScheduleCheck& a, const PipelineScheduleCheck& b) {
  return a.fault == b.fault && a.stage == b.stage && a.op == b.op && a.transfer == b.transfer &&
         a.micro_batch == b.micro_batch && a.peer_micro_batch == b.peer_micro_batch;
}

// The check finds `expected` at compile time and at run time, and describes it as `text`.
template <class Generator, std::size_t S, std::size_t M>
void require_found(const PipelineScheduleCheck& expected, const std::string& text) {
  constexpr PipelineScheduleCheck at_compile_time = pipeline_schedule_check<Generator, S, M>();
  CHECK(same(at_compile_time, expected));
  const auto at_run_time = pipeline_schedule_check<Generator>(S, M);
  CHECK(same(at_run_time, expected));
  CHECK(describe(at_run_time) == text);
}

template <class Generator>
std::vector<PipelineComm> comms_of(std::size_t stages, std::size_t stage, std::size_t m) {
  std::vector<PipelineComm> out;
  for_each_pipeline_comm<Generator>(stages, stage, m, [&](PipelineComm c) { out.push_back(c); });
  return out;
}

}  // namespace

TEST_CASE("schedule check: 1F1B's middle stage posts each pass's receive with the send before it",
          "[schedule]") {
  using T = PipelineTransfer;
  // Stage 1 of 3 over 3 micro-batches runs F0 F1 B0 F2 B1 B2.
  const std::vector<std::pair<T, std::size_t>> expected{
      {T::receive_activation, 0}, {T::send_activation, 0}, {T::receive_activation, 1},
      {T::send_activation, 1},    {T::receive_gradient, 0}, {T::send_gradient, 0},
      {T::receive_activation, 2}, {T::send_activation, 2},  {T::receive_gradient, 1},
      {T::send_gradient, 1},      {T::receive_gradient, 2}, {T::send_gradient, 2}};
  const std::vector<std::size_t> groups{0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6};
  const auto comms = comms_of<OneFOneBOrder>(3, 1, 3);
  REQUIRE(comms.size() == expected.size());
  for (std::size_t i = 0; i < comms.size(); ++i) {
    INFO("transfer " << i);
    CHECK(comms[i].transfer == expected[i].first);
    CHECK(comms[i].micro_batch == expected[i].second);
    CHECK(comms[i].group == groups[i]);
  }
  // The first stage only sends activations and receives gradients; one stage transfers nothing.
  const auto first = comms_of<GPipeOrder>(3, 0, 2);
  REQUIRE(first.size() == 4);
  CHECK(first[0].transfer == T::send_activation);
  CHECK(first[3].transfer == T::receive_gradient);
  CHECK(comms_of<OneFOneBOrder>(1, 0, 5).empty());
}

TEST_CASE("schedule check: GPipe and 1F1B complete for 1..8 stages and 1..16 micro-batches at "
          "compile time",
          "[schedule]") {
  STATIC_REQUIRE(completing<GPipeOrder>(every_size) == max_stages * max_micro_batches);
  STATIC_REQUIRE(completing<OneFOneBOrder>(every_size) == max_stages * max_micro_batches);
  STATIC_REQUIRE(pipeline_schedule_holds<OneFOneBOrder, max_stages, max_micro_batches>());
}

TEST_CASE("schedule check: GPipe and 1F1B complete for 1..8 stages and 1..16 micro-batches at "
          "run time",
          "[schedule]") {
  std::size_t checked = 0;
  for (std::size_t s = 1; s <= max_stages; ++s)
    for (std::size_t m = 1; m <= max_micro_batches; ++m) {
      INFO(s << " stages, " << m << " micro-batches");
      REQUIRE_NOTHROW(check_pipeline_schedule(PipelineKind::gpipe, s, m));
      REQUIRE_NOTHROW(check_pipeline_schedule(PipelineKind::one_f_one_b, s, m));
      ++checked;
    }
  CHECK(checked == max_stages * max_micro_batches);
  REQUIRE_THROWS_WITH(check_pipeline_schedule(PipelineKind::one_f_one_b, 4, 0),
                      Catch::Contains("a 1F1B pipeline needs at least one stage and one "
                                      "micro-batch, not 4 stage(s) and 0 micro-batch(es)"));
}

TEST_CASE("schedule check: a stage running its backwards in reverse order is out of order with "
          "its neighbour",
          "[schedule]") {
  // Stage 2 of 4 sends gradients 3, 2, 1, 0; stage 1 receives 0 first, as
  // its transfer 8 (after the four forwards' receive and send).
  require_found<ReversedBackwards<2>, 4, 4>(
      {PipelineScheduleFault::out_of_order, 1, 8, PipelineTransfer::receive_gradient, 0, 3},
      "sends and receives out of order: stage 1's transfer 8 (receives the gradient of "
      "micro-batch 0) meets stage 2's of micro-batch 3");
  // The first stage reversed: it receives micro-batch 2's gradient where stage 1 sends 0's.
  constexpr PipelineScheduleCheck first{PipelineScheduleFault::out_of_order, 0, 3,
                                        PipelineTransfer::receive_gradient, 2, 0};
  STATIC_REQUIRE(same(pipeline_schedule_check<ReversedBackwards<0>, 2, 3>(), first));
  // One micro-batch has no order to get wrong.
  STATIC_REQUIRE(pipeline_schedule_check<ReversedBackwards<1>, 3, 1>().ok());
}

TEST_CASE("schedule check: a backward waiting on a gradient that needs the stage's next forward "
          "deadlocks",
          "[schedule]") {
  // Stage 0 waits on micro-batch 0's gradient (its transfer 1, after
  // sending activation 0); stage 1 waits on activation 1 from stage 0.
  require_found<EagerFirstStage, 3, 4>(
      {PipelineScheduleFault::deadlock, 0, 1, PipelineTransfer::receive_gradient, 0, 0},
      "deadlocks: stage 0's transfer 1 (receives the gradient of micro-batch 0) waits on "
      "stage 1, itself stuck before posting its match");
  // Over two stages the last one runs F0 B0 F1 B1 ... too: nothing waits.
  STATIC_REQUIRE(pipeline_schedule_check<EagerFirstStage, 2, 4>().ok());
}

TEST_CASE("schedule check: a stage skipping a backward is malformed", "[schedule]") {
  // Stage 2 of 3 runs 7 passes: micro-batch 2's backward is missing after the last.
  require_found<SkippedBackward, 3, 4>(
      {PipelineScheduleFault::malformed, 2, 7, PipelineTransfer::receive_activation, 2, 0},
      "is malformed: stage 2's pass 7 does not run micro-batch 2's forward once and then its "
      "backward once");
}
