// Trainer: training on real data lowers the loss, is reproducible from its
// seeds, reports progress, and turns misuse into clear errors.
#include <cmath>
#include <limits>
#include <loom/loom.hpp>
#include <sstream>

#include "fashion_test.hpp"
#include "loom_test.hpp"

using namespace loom;
using loom::test::fashion;
using loom::test::head;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<64>, ReLU, Linear<10>>;
using SmallCnn =
    Sequential<Input<1, 28, 28>, Conv2d<8, 5>, ReLU, MaxPool2d<2>, Flatten, Linear<10>>;

}  // namespace

TEST_CASE("trainer: a small CNN learns Fashion-MNIST and evaluate() measures it") {
  const auto train = head(fashion().train, 6000);
  const auto test = head(fashion().test, 2000);
  Trainer<SmallCnn> trainer(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  const EvalResult before = trainer.evaluate(test);
  REQUIRE(before.samples == 2000);
  REQUIRE(before.accuracy < 0.3);  // untrained: near chance (0.1)
  std::ostringstream log;
  callbacks::Evaluate evaluate(test, &log);
  trainer.fit(train, {.epochs = 2, .batch_size = 50}, evaluate);
  REQUIRE(evaluate.history.size() == 2);
  REQUIRE(evaluate.last.loss < before.loss / 2);
  REQUIRE(evaluate.last.accuracy > 0.75);
  const EvalResult again = trainer.evaluate(test, 333);  // batch size does not matter
  REQUIRE(again.accuracy == evaluate.last.accuracy);
  REQUIRE(again.loss == Approx(evaluate.last.loss).epsilon(1e-6));
  REQUIRE(log.str().find("epoch 2/2 fashion-mnist") != std::string::npos);
}

TEST_CASE("trainer: the same seeds give the same weights, another data seed does not") {
  const auto train = head(fashion().train, 1000);
  auto run = [&](std::uint64_t data_seed) {
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f, .momentum = 0.9f}, {.seed = 5});
    trainer.fit(train, {.epochs = 1, .batch_size = 64, .seed = data_seed});
    const auto p = trainer.model().parameters();
    return std::vector<float>(p.begin(), p.end());
  };
  const auto a = run(1);
  test::require_equal(run(1), a, "weights after identical runs");
  REQUIRE(run(2) != a);
}

TEST_CASE("trainer: MultiStepLR lowers the learning rate after its milestone epochs") {
  const auto train = head(fashion().train, 128);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.08f});
  trainer.fit(train, {.epochs = 4, .batch_size = 64},
              callbacks::MultiStepLR{.milestones = {1, 3}, .factor = 0.5f, .out = &out});
  REQUIRE(trainer.optimizer().options().lr == 0.02f);
  REQUIRE(out.str() == "learning rate 0.04 from epoch 2\nlearning rate 0.02 from epoch 4\n");
  REQUIRE_THROWS_WITH(trainer.optimizer().set_lr(-0.5f),
                      Catch::Contains("learning rate must be >= 0"));
}

TEST_CASE("trainer: the progress callback prints plain lines off a terminal") {
  const auto train = head(fashion().train, 640);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  trainer.fit(train, {.epochs = 2, .batch_size = 64},
              callbacks::Progress({.out = &out, .lines_per_epoch = 5}));
  const std::string text = out.str();
  REQUIRE(text.find("training: 640 samples, 2 epoch(s) of 10 steps, batch 64") !=
          std::string::npos);
  REQUIRE(text.find("epoch 1/2 step 2/10 loss ") != std::string::npos);
  REQUIRE(text.find("epoch 2/2 step 10/10 loss ") != std::string::npos);
  REQUIRE(text.find("samples/s ETA 0:00") != std::string::npos);
  REQUIRE(text.find("epoch 2/2 done: loss ") != std::string::npos);
  REQUIRE(text.find('\r') == std::string::npos);
  // 5 lines per epoch + a summary each + the header.
  REQUIRE(std::count(text.begin(), text.end(), '\n') == 2 * 6 + 1);
}

TEST_CASE("trainer: the progress bar is redrawn in place") {
  const auto train = head(fashion().train, 640);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
  trainer.fit(train, {.epochs = 1, .batch_size = 64},
              callbacks::Progress(
                  {.out = &out, .style = callbacks::Progress::Style::bar, .bar_width = 10}));
  const std::string text = out.str();
  // The last redraw of the epoch: a full bar, erased to the end of the line,
  // then a newline so the summary starts on its own line.
  REQUIRE(text.find("\repoch 1/1 [==========] step 10/10 loss ") != std::string::npos);
  REQUIRE(text.find("\x1b[K\nepoch 1/1 done: loss ") != std::string::npos);
}

TEST_CASE("trainer: devices") {
  const auto all = devices::all();
  REQUIRE(all.size() == 1);
  REQUIRE(all[0].kind == Device::Kind::cpu);
  REQUIRE(all[0].threads == devices::hardware_threads());
  const auto workers = devices::cpu(2);
  REQUIRE(workers.size() == 2);
  REQUIRE(workers[1].name() == "cpu:1");
  REQUIRE(workers[0].threads == std::max(1, devices::hardware_threads() / 2));
  REQUIRE_THROWS_WITH(devices::cpu(0), Catch::Contains("need at least one device"));
}

TEST_CASE("trainer: misuse is a clear loom::Error") {
  SECTION("device count") {
    REQUIRE_THROWS_WITH((Trainer<Mlp>(devices::cpu(2), {})),
                        Catch::Contains("SingleDevice runs on 1 device(s) but 2 were given"));
  }
  SECTION("a GPU in a program the host compiler built (it has no CUDA executor)") {
    const Device gpu{.kind = Device::Kind::cuda, .index = 0};
    REQUIRE_THROWS_WITH((Trainer<Mlp>({gpu}, {})),
                        Catch::StartsWith("loom: device cuda:0 needs the CUDA backend: compile "
                                          "with nvcc, including <loom/loom.hpp>, or register "
                                          "this trainer from a CUDA translation unit "
                                          "(loom::gpu::register_trainers), to use GPUs ["));
    REQUIRE_THROWS_WITH((Trainer<Mlp, ModelSplit<Balanced<2>>>({gpu, gpu}, {})),
                        Catch::Contains("device cuda:0 needs the CUDA backend"));
  }
  SECTION("dataset shape") {
    using Wrong = Sequential<Input<1, 32, 32>, Flatten, Linear<10>>;
    Trainer<Wrong> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(
        trainer.fit(head(fashion().train, 10), {}),
        Catch::Contains("has samples of 1x28x28 = 784 values but the network's Input holds 1024"));
  }
  SECTION("more classes than outputs") {
    using Five = Sequential<Input<1, 28, 28>, Flatten, Linear<5>>;
    Trainer<Five> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.evaluate(head(fashion().test, 10)),
                        Catch::Contains("has 10 classes but the network outputs 5 scores"));
  }
  SECTION("a NaN loss stops training with the epoch and step") {
    auto bad = head(fashion().train, 256);
    bad.images[3 * bad.sample_size() + 100] = std::numeric_limits<float>::quiet_NaN();
    Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.01f});
    const auto p = trainer.model().parameters();
    const std::vector<float> initial(p.begin(), p.end());
    REQUIRE_THROWS_WITH(trainer.fit(bad, {.epochs = 1, .batch_size = 64, .shuffle = false}),
                        Catch::Contains("the training loss became nan at epoch 1, step 1"));
    // The failed step did not touch the weights.
    test::require_equal(trainer.model().parameters(), initial, "weights after the NaN step");
  }
  SECTION("an empty dataset") {
    Trainer<Mlp> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.evaluate(head(fashion().test, 0)), Catch::Contains("is empty"));
  }
  SECTION("bad fit options") {
    Trainer<Mlp> trainer(devices::cpu(1), {});
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.epochs = 0}),
                        Catch::Contains("epochs must be >= 1"));
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.batch_size = 0}),
                        Catch::Contains("fit: batch size must be >= 1"));
    REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.accumulation_steps = 0}),
                        Catch::Contains("fit: accumulation_steps must be >= 1"));
    for (const float norm : {-1.0f, std::numeric_limits<float>::quiet_NaN()})
      REQUIRE_THROWS_WITH(trainer.fit(head(fashion().train, 10), {.max_grad_norm = norm}),
                          Catch::Contains("fit: max_grad_norm must be a finite number >= 0 (0: "
                                          "no clipping), got "));
  }
}

namespace {

// A CPU trainer whose fit loop runs ahead, as TrainerCore lets an engine
// whose steps are queued on a device do (none does today: every engine's
// step is done when run_batch returns): each step's sums are read
// (finish_step) only once the next step's first batch has run. `calls`
// records the order.
class AheadTrainer : public Trainer<Mlp> {
 public:
  using Trainer<Mlp>::Trainer;
  std::vector<std::string> calls;        // "run <batch>", "finish <step>"
  std::size_t fail_finish_at_step = 0;   // finish_step of this step raises
  std::size_t fail_run_at_batch = 0;     // run_batch of this batch (1-based) raises
  std::uint64_t dropout_step() const { return batches_; }  // Dropout's batch counter

 protected:
  void start_fit(const detail::FitPlan& plan, std::size_t planned_batch) override {
    done_.clear();  // a failed fit's unread steps, as a GPU's executor drops them
    Trainer<Mlp>::start_fit(plan, planned_batch);
  }
  bool runs_ahead(const FitOptions&) const override { return true; }
  std::optional<cpu::LossSums> run_batch(const data::Batch& batch, std::size_t group_samples,
                                         bool accumulate, bool last, int epoch, std::size_t step,
                                         const FitOptions& options) override {
    ++runs_;
    if (runs_ == fail_run_at_batch) throw Error("test: run_batch fails");
    calls.push_back("run " + std::to_string(runs_));
    const auto sums =
        Trainer<Mlp>::run_batch(batch, group_samples, accumulate, last, epoch, step, options);
    if (sums) done_.push_back({*sums, nonfinite_});
    return std::nullopt;
  }
  cpu::LossSums finish_step(int, std::size_t step, const FitOptions&) override {
    if (step == fail_finish_at_step) throw Error("test: finish_step fails");
    calls.push_back("finish " + std::to_string(step));
    const auto [sums, nonfinite] = done_.front();
    done_.erase(done_.begin());
    nonfinite_ = nonfinite;  // as a GPU's finish_step says it
    return sums;
  }

 private:
  std::size_t runs_ = 0;
  std::vector<std::pair<cpu::LossSums, std::string>> done_;
};

// What a fit told its callbacks, but the clock: what step_begin said, and
// the steps and epochs (a trainer that runs ahead begins the next step
// before it reports the last).
struct Recorder {
  std::vector<std::string> begins, lines;
  void on_step_begin(const StepBegin& b) {
    begins.push_back("begin " + std::to_string(b.epoch) + "." + std::to_string(b.step) + " " +
                    std::to_string(b.fit_step));
  }
  void on_step(const StepInfo& s) {
    std::ostringstream line;
    line.precision(17);
    line << "step " << s.epoch << "." << s.step << "/" << s.steps << " loss " << s.loss << " acc "
         << s.accuracy << " samples " << s.samples << " own " << s.step_loss << " "
         << s.step_accuracy << " " << s.step_samples << " skipped " << s.skipped << " '"
         << s.nonfinite << "'";
    lines.push_back(line.str());
  }
  void on_epoch_end(const EpochInfo& e) {
    std::ostringstream line;
    line.precision(17);
    line << "epoch " << e.epoch << " " << e.loss << " " << e.accuracy << " " << e.samples;
    lines.push_back(line.str());
  }
};

// Step 3's callbacks read the trainer's state; step 5's stop the fit.
struct SavesAtThree {
  std::vector<std::string>* calls;
  std::vector<std::size_t> runs_seen;  // batches run when each step was reported
  bool needs_state_at_step(std::uint64_t steps) const { return steps == 3; }
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    runs_seen.push_back(static_cast<std::size_t>(std::count_if(
        calls->begin(), calls->end(), [](const std::string& c) { return c.starts_with("run"); })));
    if (trainer.steps() == 5) trainer.stop();
  }
};

// Fashion-MNIST's first 1000 samples, one image's pixel NaN: the batch that
// holds it has a non-finite loss.
data::Dataset with_nan_image() {
  auto data = head(fashion().train, 1000);
  data.images[417 * data.sample_size() + 300] = std::numeric_limits<float>::quiet_NaN();
  return data;
}

}  // namespace

TEST_CASE("fit loop: a trainer that runs ahead reports what one that runs at once does") {
  const auto data = with_nan_image();
  // Uneven batches (1000 = 15 x 64 + 40), two per step, a skipped step.
  const FitOptions fit{.epochs = 2,
                       .batch_size = 64,
                       .accumulation_steps = 2,
                       .on_nonfinite = NonFinite::skip};
  Trainer<Mlp> at_once(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  AheadTrainer ahead(devices::cpu(1), {.lr = 0.01f, .momentum = 0.9f});
  Recorder expected, got;
  at_once.fit(data, fit, expected);
  ahead.fit(data, fit, got);
  REQUIRE(expected.lines.size() == 2 * (8 + 1));
  REQUIRE(got.lines == expected.lines);
  REQUIRE(expected.begins.size() == 2 * 8);
  REQUIRE(got.begins == expected.begins);
  REQUIRE(at_once.nonfinite_steps() == 2);  // once an epoch
  REQUIRE(ahead.nonfinite_steps() == 2);
  REQUIRE(ahead.position().steps == 8);
  REQUIRE(ahead.position().batches == 16);
  const auto a = at_once.model().parameters(), b = ahead.model().parameters();
  REQUIRE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  // Step j is read once step j + 1's first batch has run; the epoch's last
  // step at its end.
  REQUIRE(std::vector<std::string>(ahead.calls.begin(), ahead.calls.begin() + 8) ==
          std::vector<std::string>{"run 1", "run 2", "run 3", "finish 1", "run 4", "run 5",
                                   "finish 2", "run 6"});
  REQUIRE(ahead.calls[23] == "finish 8");
  REQUIRE(ahead.calls[24] == "run 17");
}

TEST_CASE("fit loop: running ahead, a step whose callbacks need the state is read first, and "
          "stop() ends after the step already run") {
  const auto data = head(fashion().train, 640);
  AheadTrainer ahead(devices::cpu(1), {.lr = 0.01f});
  SavesAtThree saves{&ahead.calls, {}};
  ahead.fit(data, {.epochs = 1, .batch_size = 64}, saves);
  // Step 3 is read before step 4 runs; the others once the next has run.
  // stop() at step 5 takes effect at step 7's first batch: step 6, already
  // run, completes.
  REQUIRE(saves.runs_seen == std::vector<std::size_t>{2, 3, 3, 5, 6, 6});
  REQUIRE(ahead.position().steps == 6);
  REQUIRE(ahead.position().batches == 6);
  REQUIRE_FALSE(ahead.position().ended);
}

TEST_CASE("fit loop: running ahead, a step that fails leaves the trainer at the steps read") {
  const auto data = head(fashion().train, 640);
  const auto path = std::filesystem::temp_directory_path() / "loom_fit_loop_ahead.loom";
  {
    // Reading step 4 fails (as a lost device's wait does) once batch 5 has
    // run: steps 1-3 count, and save() refuses, the devices being past them.
    AheadTrainer ahead(devices::cpu(1), {.lr = 0.01f});
    ahead.fail_finish_at_step = 4;
    REQUIRE_THROWS_WITH(ahead.fit(data, {.epochs = 1, .batch_size = 64}),
                        "test: finish_step fails");
    REQUIRE(ahead.position().steps == 3);
    REQUIRE(ahead.position().batches == 3);
    REQUIRE(ahead.steps() == 3);
    REQUIRE(ahead.dropout_step() == 5);
    REQUIRE_THROWS_WITH(ahead.save(path), Catch::Contains("called while the GPU runs a step "
                                                          "that fit() has not reported"));
    // A loaded checkpoint is the devices' state: nothing is left unread.
    Trainer<Mlp> plain(devices::cpu(1), {.lr = 0.01f});
    plain.save(path);
    ahead.load(path);
    REQUIRE_NOTHROW(ahead.save(path));
  }
  {
    // Enqueueing batch 5 fails while step 4 is unread: Dropout's counter
    // stays past step 4, which ran, and save() refuses.
    AheadTrainer ahead(devices::cpu(1), {.lr = 0.01f});
    ahead.fail_run_at_batch = 5;
    REQUIRE_THROWS_WITH(ahead.fit(data, {.epochs = 1, .batch_size = 64}),
                        "test: run_batch fails");
    REQUIRE(ahead.position().steps == 3);
    REQUIRE(ahead.dropout_step() == 4);
    REQUIRE_THROWS_WITH(ahead.save(path), Catch::Contains("called while the GPU runs a step "
                                                          "that fit() has not reported"));
    // A fit that ended leaves nothing unread.
    ahead.fail_run_at_batch = 0;
    ahead.fit(data, {.epochs = 1, .batch_size = 64});
    REQUIRE_NOTHROW(ahead.save(path));
  }
  std::filesystem::remove(path);
}
