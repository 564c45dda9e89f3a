// A pipeline schedule whose sends and receives deadlock: 1F1B, except that
// stage 0 of 3 runs no warm-up forwards, so it waits on micro-batch 0's
// gradient while stage 1 waits on micro-batch 1's activation from it.
#include <loom/parallel/schedule.hpp>

using namespace loom;

struct FirstStageWarmup {
  template <class F>
  static constexpr void for_each_op(std::size_t stages, std::size_t stage, std::size_t m, F&& f) {
#ifdef LOOM_COMPILE_FAIL
    const std::size_t warmup = stage == 0 ? 0 : stages - stage - 1;
#else
    const std::size_t warmup = stages - stage - 1;
#endif
    for (std::size_t i = 0; i < warmup; ++i) f(PipelineOp{true, i});
    for (std::size_t i = 0; i + warmup < m; ++i) {
      f(PipelineOp{true, warmup + i});
      f(PipelineOp{false, i});
    }
    for (std::size_t i = m - warmup; i < m; ++i) f(PipelineOp{false, i});
  }
};

static_assert(pipeline_schedule_holds<FirstStageWarmup, 3, 4>());

int main() { return 0; }
