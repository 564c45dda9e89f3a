// A loss other than softmax cross-entropy under every policy: CTCLoss over
// sequences of varying length (garments read a row a frame, a per-frame
// MLP), on CPU worker devices and real data. Each policy trains to one
// device's weights and reports its sums (loss, sequences right, label error
// rate) over the same global batch.
#include <cmath>
#include <loom/loom.hpp>
#include <span>
#include <vector>

#include "fashion_test.hpp"
#include "garment_sequences.hpp"
#include "loom_test.hpp"

using namespace loom;
namespace test = loom::test;

namespace {

using Reader = Sequential<Input<56, 28>, Linear<32>, ReLU, Linear<24>, ReLU, Linear<11>>;
static_assert(Reader::output_shape::rank == 2 && Reader::output_shape::dims[0] == 56 &&
              Reader::output_shape::dims[1] == 11);

const SGD::Options sgd{.lr = 0.05f, .momentum = 0.9f};
// 200 samples in batches of 40 (the last epoch's order shuffled): 10 steps.
const FitOptions fit{.epochs = 2, .batch_size = 40, .seed = 3};

const data::Dataset& sequences() {
  static const data::Dataset set = test::garment_sequences(test::fashion().train, 200);
  return set;
}

struct Trained {
  std::vector<float> weights;
  EpochInfo last;
  EvalResult eval;
  std::uint64_t steps = 0;
};

// Net under Policy on `devices` CPU workers (one thread each), SGD and the
// loss (CTC unless named), seeded by `seed`, optionally from a checkpoint:
// its weights, last epoch and evaluation on `data` after fitting it.
template <class Net, class Policy, class Loss = CTCLoss, class... Callbacks>
Trained fit_sequences(std::size_t devices, std::uint64_t seed, const data::Dataset& data,
                      const FitOptions& options, const std::string& load,
                      Callbacks&&... callbacks) {
  auto workers = devices::cpu(devices);
  for (auto& d : workers) d.threads = 1;
  Trainer<Net, Policy, SGD, Loss> trainer(workers, sgd, {.seed = seed});
  if (!load.empty()) trainer.load(load);
  struct Last {
    void on_epoch_end(const EpochInfo& epoch) { *out = epoch; }
    EpochInfo* out;
  };
  Trained result;
  trainer.fit(data, options, Last{&result.last}, callbacks...);
  const auto w = trainer.model().parameters();
  result.weights.assign(w.begin(), w.end());
  result.eval = trainer.evaluate(data, 50);
  result.steps = trainer.steps();
  return result;
}

template <class Policy>
Trained train(std::size_t devices) {
  return fit_sequences<Reader, Policy>(devices, 11, sequences(), fit, {});
}

// A checkpoint file of this process's own (CTest may run other test
// programs at once), removed at the scope's end.
struct TempCheckpoint {
  explicit TempCheckpoint(const std::string& stem)
      : path((std::filesystem::temp_directory_path() /
              ("loom-" + stem + "-" + std::to_string(::getpid()) + ".safetensors"))
                 .string()) {}
  TempCheckpoint(const TempCheckpoint&) = delete;
  TempCheckpoint& operator=(const TempCheckpoint&) = delete;
  ~TempCheckpoint() { std::filesystem::remove(path); }
  std::string path;
};

void require_same_sums(const Trained& got, const Trained& ref, const char* what) {
  INFO(what);
  REQUIRE(got.last.loss == Approx(ref.last.loss).epsilon(1e-6));
  REQUIRE(got.last.accuracy == ref.last.accuracy);
  REQUIRE(got.last.error_rate.has_value());
  REQUIRE(*got.last.error_rate == Approx(*ref.last.error_rate).epsilon(1e-12));
  REQUIRE(got.eval.loss == Approx(ref.eval.loss).epsilon(1e-6));
  REQUIRE(*got.eval.error_rate == Approx(*ref.eval.error_rate).epsilon(1e-12));
}

}  // namespace

TEST_CASE("CTCLoss: one device learns and reports the loss's own sums") {
  const Trained one = train<SingleDevice>(1);
  // Two epochs of a per-frame MLP: far from trained, but the loss of a
  // blank-heavy start (about log(11) per frame over ~50 frames, over a
  // target of 1.7 labels) has come down, and every sum is in range.
  REQUIRE(std::isfinite(one.last.loss));
  REQUIRE(one.eval.samples == 200);
  REQUIRE(one.eval.error_rate.has_value());
  REQUIRE(*one.eval.error_rate >= 0.0);
  REQUIRE(one.eval.accuracy >= 0.0);
  REQUIRE(one.eval.accuracy <= 1.0);
  Trainer<Reader, SingleDevice, SGD, CTCLoss> untrained(devices::cpu(1), sgd, {.seed = 11});
  const auto before = untrained.evaluate(sequences(), 50);
  REQUIRE(one.eval.loss < 0.8 * before.loss);
}

TEST_CASE("CTCLoss trains to one device's weights under DataParallel, ModelSplit and Hybrid") {
  const Trained reference = train<SingleDevice>(1);
  // Sums of the same gradients in other orders: fp32 rounding over 10 SGD steps.
  const test::Tolerance tolerance{1e-6, 1e-4};
  const auto dp = train<DataParallel<>>(3);
  test::require_close(dp.weights, reference.weights, tolerance, "DataParallel over 3");
  require_same_sums(dp, reference, "DataParallel over 3");
  const auto split = train<ModelSplit<Balanced<2>, OneFOneB<4>>>(2);
  test::require_close(split.weights, reference.weights, tolerance, "ModelSplit over 2");
  require_same_sums(split, reference, "ModelSplit over 2");
  const auto hybrid = train<Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>>(4);
  test::require_close(hybrid.weights, reference.weights, tolerance, "Hybrid 2 x 2");
  require_same_sums(hybrid, reference, "Hybrid 2 x 2");
}

TEST_CASE("CTCLoss: a target that needs more frames than its sample has is refused, naming it") {
  data::Dataset set = sequences();
  // Sample 5 gets 2 frames and a target of one label twice: the repeat
  // needs a blank between, so 3 frames.
  set.frames[5] = 2;
  set.target_lengths[5] = 2;
  set.targets[5 * 2 + 1] = set.targets[5 * 2];
  Trainer<Reader, SingleDevice, SGD, CTCLoss> trainer(devices::cpu(1), sgd);
  REQUIRE_THROWS_WITH(trainer.fit(set, fit),
                      Catch::Contains("CTCLoss: sample 5 has a target of 2 labels (1 repeated "
                                      "in a row") &&
                          Catch::Contains("needs 3 frames, but the sample has 2"));
  // CTC<true> (zero_infinity) trains on, that sample adding nothing.
  Trainer<Reader, SingleDevice, SGD, CTC<true>> lenient(devices::cpu(1), sgd);
  lenient.fit(set, {.epochs = 1, .batch_size = 40});
  REQUIRE(lenient.steps() == 5);
}

TEST_CASE("a loss is given the targets it trains against, or the fit is refused by name") {
  Trainer<Reader, SingleDevice, SGD, CTCLoss> ctc(devices::cpu(1), sgd);
  data::Dataset classes = sequences();
  classes.max_target = 0;
  classes.targets.clear();
  classes.target_lengths.clear();
  classes.labels.assign(classes.count, 1);
  REQUIRE_THROWS_WITH(ctc.fit(classes, fit),
                      Catch::StartsWith("loom: fit: dataset 'fashion-mnist-train garment pairs' has one "
                                        "class per sample but the trainer's loss, CTCLoss, trains "
                                        "against a label sequence per sample"));
  using Mlp = Sequential<Input<56, 28>, Flatten, Linear<11>>;
  Trainer<Mlp, SingleDevice, SGD> softmax(devices::cpu(1), sgd);
  REQUIRE_THROWS_WITH(softmax.fit(sequences(), fit),
                      Catch::Contains("has a label sequence per sample but the trainer's loss, "
                                      "SoftmaxCrossEntropy, trains against one class per sample"));
  data::Dataset bad = sequences();
  bad.targets[7 * 2] = 11;
  REQUIRE_THROWS_WITH(ctc.fit(bad, fit),
                      Catch::Contains("sample 7 has label 11 at position 0 of its target; "
                                      "expected 1..10 (0 is the blank)"));
}

namespace {

// The garments' frames made long-tailed (most 4..12, a few up to 56: the
// per-frame MLP reads every row, CTC only a sample's frames).
const data::Dataset& skewed_sequences() {
  static const data::Dataset set = [] {
    data::Dataset s = sequences();
    for (std::size_t i = 0; i < s.count; ++i) {
      const double tail = 4.0 / std::pow(1.0 - uniform01(5, 0, i), 1.0 / 1.5);
      s.frames[i] = static_cast<std::int32_t>(std::min(56.0, std::max(4.0, tail)));
    }
    return s;
  }();
  return set;
}

// Batches of 40 drawn from buckets of 2 batches: 5 steps an epoch, each
// split 14, 13, 13 over 3 replicas, balanced by frames.
const FitOptions bucketed{.epochs = 2, .batch_size = 40, .seed = 3, .bucket = 2};

template <class Policy, class... Callbacks>
Trained train_skewed(std::size_t devices, const FitOptions& options, const std::string& load = {},
                     Callbacks&&... callbacks) {
  Trained result =
      fit_sequences<Reader, Policy>(devices, 11, skewed_sequences(), options, load, callbacks...);
  REQUIRE(result.steps == 10);
  return result;
}

}  // namespace

TEST_CASE(
    "CTCLoss with batches bucketed by length: DataParallel over 3 reaches one device's weights") {
  const Trained reference = train_skewed<SingleDevice>(1, bucketed);
  const Trained dp = train_skewed<DataParallel<>>(3, bucketed);
  test::require_close(dp.weights, reference.weights, {1e-6, 1e-4}, "DataParallel over 3, bucketed");
  require_same_sums(dp, reference, "DataParallel over 3, bucketed");
  // The buckets changed the batches: unbucketed, one device ends elsewhere.
  FitOptions plain = bucketed;
  plain.bucket = 0;
  const Trained unbucketed = train_skewed<SingleDevice>(1, plain);
  double differ = 0.0;
  for (std::size_t i = 0; i < unbucketed.weights.size(); ++i)
    differ = std::max(differ,
                      static_cast<double>(std::abs(unbucketed.weights[i] - reference.weights[i])));
  REQUIRE(differ > 1e-3);
}

TEST_CASE(
    "CTCLoss with bucketed batches resumes mid-epoch on the same batches, and another bucket is "
    "refused") {
  const Trained reference = train_skewed<SingleDevice>(1, bucketed);
  const TempCheckpoint file("bucketed");
  const std::string& path = file.path;
  // Saved after step 7: epoch 2, after its second batch.
  train_skewed<SingleDevice>(
      1, bucketed, {},
      callbacks::Checkpoint(
          {.path = path, .every_steps = 7, .every_epoch = false, .at_end = false}));
  const Trained resumed = train_skewed<DataParallel<>>(3, bucketed, path);
  test::require_close(resumed.weights, reference.weights, {1e-6, 1e-4}, "resumed over 3 replicas");
  Trainer<Reader, SingleDevice, SGD, CTCLoss> other(devices::cpu(1), sgd);
  other.load(path);
  FitOptions wider = bucketed;
  wider.bucket = 3;
  REQUIRE_THROWS_WITH(other.fit(skewed_sequences(), wider),
                      Catch::Contains("the loaded checkpoint stopped in a fit with bucket 2, but "
                                      "this fit has 3"));
  // Bucketing needs the samples' lengths.
  data::Dataset flat = sequences();
  flat.frames.clear();
  Trainer<Reader, SingleDevice, SGD, CTCLoss> fresh(devices::cpu(1), sgd);
  REQUIRE_THROWS_WITH(fresh.fit(flat, bucketed),
                      Catch::Contains("fit: FitOptions::bucket is 2 but dataset "
                                      "'fashion-mnist-train garment pairs' has no sample lengths "
                                      "(Dataset::frames)"));
}

namespace {

// The speech example's architecture, small: a strided Conv1d front end
// (56 frames become 28, each sample's length by the same rule), BatchNorm
// over time, a bidirectional GRU and a Linear per frame into CTC. Its
// BatchNorm is SyncBatchNorm1d, so that DataParallel's replicas normalise
// over the global batch as one device does; a pipeline of one micro-batch
// normalises the same batch. Hybrid's replicas each hold half: its model
// has no BatchNorm.
template <class Norm>
using SpeechLike = Sequential<Input<56, 28>, Conv1d<16, 3, 2, 1>, Norm, ReLU, BiGRU<12>,
                              Linear<11>>;
using SpeechNet = SpeechLike<SyncBatchNorm1d>;
using SpeechNetNoNorm = Sequential<Input<56, 28>, Conv1d<16, 3, 2, 1>, ReLU, BiGRU<12>, Linear<11>>;
static_assert(SpeechNet::output_shape::dims[0] == 28);

// SGD: the Conv1d's bias feeds BatchNorm, which cancels its gradient to
// rounding noise that the sum's order decides and Adam would scale up to
// whole steps.
template <class Net, class Policy>
Trained train_speech(std::size_t devices) {
  Trained result = fit_sequences<Net, Policy>(
      devices, 13, sequences(), {.epochs = 2, .batch_size = 40, .seed = 9, .bucket = 2}, {});
  REQUIRE(result.steps == 10);
  return result;
}

}  // namespace

TEST_CASE("the speech model (Conv1d, BatchNorm over time, BiGRU, CTC) trains to one device's "
          "weights under every policy") {
  const test::Tolerance tolerance{1e-6, 1e-4};
  const Trained one = train_speech<SpeechNet, SingleDevice>(1);
  const auto dp = train_speech<SpeechNet, DataParallel<>>(3);
  test::require_close(dp.weights, one.weights, tolerance, "DataParallel over 3");
  require_same_sums(dp, one, "DataParallel over 3");
  const auto split = train_speech<SpeechNet, ModelSplit<Balanced<2>, GPipe<1>>>(2);
  test::require_close(split.weights, one.weights, tolerance, "ModelSplit over 2");
  require_same_sums(split, one, "ModelSplit over 2");
  const Trained plain = train_speech<SpeechNetNoNorm, SingleDevice>(1);
  const auto hybrid = train_speech<SpeechNetNoNorm, Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>>(4);
  test::require_close(hybrid.weights, plain.weights, tolerance, "Hybrid 2 x 2");
  require_same_sums(hybrid, plain, "Hybrid 2 x 2");
}

namespace {

// A class per position from the same garments: row t of garment g is
// labelled with g's class (every fifth row ignored, -1), past a sample's
// frames nothing counts. The first 100 samples are cut to 6 frames, so
// batches of 20 in order (no shuffle) hold about 100 or about 700 counted
// positions: a step's micro-batches and replicas count very differently.
const data::Dataset& garment_rows() {
  static const data::Dataset set = [] {
    const data::Dataset& pairs = sequences();
    data::Dataset s = pairs;
    s.name = "garment rows";
    s.classes = 10;
    s.target_lengths.clear();
    s.max_target = 56;
    s.targets.assign(s.count * 56, -1);
    for (std::size_t i = 0; i < s.count; ++i) {
      if (i < 100) s.frames[i] = 6;
      for (std::size_t t = 0; t < 56; ++t)
        if (t % 5 != 4 && static_cast<std::int32_t>(t) < s.frames[i])
          s.targets[i * 56 + t] = pairs.targets[i * 2 + t / 28] - 1;
    }
    return s;
  }();
  return set;
}

double counted_positions(const data::Dataset& set, std::size_t first, std::size_t count) {
  double counted = 0.0;
  for (std::size_t i = first; i < first + count; ++i)
    for (std::size_t t = 0; t < static_cast<std::size_t>(set.frames[i]); ++t)
      counted += set.targets[i * set.max_target + t] >= 0 ? 1.0 : 0.0;
  return counted;
}

using RowReader = Sequential<Input<56, 28>, Linear<24>, ReLU, Linear<10>>;

// Steps of 40 samples: one batch of 40, or two of 20 added up.
template <class Policy>
Trained train_rows(std::size_t devices, std::size_t batch) {
  const FitOptions options{.epochs = 2,
                           .batch_size = batch,
                           .shuffle = false,
                           .accumulation_steps = 40 / batch};
  Trained result = fit_sequences<RowReader, Policy, PositionCrossEntropy>(
      devices, 5, garment_rows(), options, {});
  REQUIRE(result.steps == 10);
  return result;
}

void require_same_means(const Trained& got, const Trained& ref, const char* what) {
  INFO(what);
  REQUIRE(got.last.loss == Approx(ref.last.loss).epsilon(1e-6));
  REQUIRE(got.last.accuracy == ref.last.accuracy);
  REQUIRE(got.eval.loss == Approx(ref.eval.loss).epsilon(1e-6));
  REQUIRE(got.eval.denominator == ref.eval.denominator);
}

}  // namespace

TEST_CASE("PositionCrossEntropy: the mean over a step's counted positions reproduces one device "
          "under accumulation, DataParallel, ModelSplit and Hybrid") {
  const data::Dataset& rows = garment_rows();
  // The micro-batches of one step count very differently: a loss divided
  // by each micro-batch's (or each replica's) own positions would weigh the
  // short samples' positions about 7 times as much, and every comparison
  // below would fail by far more than its tolerance.
  REQUIRE(counted_positions(rows, 80, 20) * 5 < counted_positions(rows, 100, 20));
  const Trained reference = train_rows<SingleDevice>(1, 40);
  REQUIRE(reference.eval.denominator == counted_positions(rows, 0, rows.count));
  // Rows of garments (many blank), 2 epochs: well above chance (0.1).
  REQUIRE(reference.eval.accuracy > 0.18);
  // Sums of the same gradients in other orders: fp32 rounding over 10 SGD steps.
  const test::Tolerance tolerance{1e-6, 1e-4};
  const auto accumulated = train_rows<SingleDevice>(1, 20);
  test::require_close(accumulated.weights, reference.weights, tolerance, "one device, 2 x 20");
  require_same_means(accumulated, reference, "one device, 2 x 20");
  const auto dp = train_rows<DataParallel<>>(3, 20);
  test::require_close(dp.weights, reference.weights, tolerance, "DataParallel over 3, 2 x 20");
  require_same_means(dp, reference, "DataParallel over 3, 2 x 20");
  const auto split = train_rows<ModelSplit<Balanced<2>, OneFOneB<4>>>(2, 20);
  test::require_close(split.weights, reference.weights, tolerance, "ModelSplit over 2, 2 x 20");
  require_same_means(split, reference, "ModelSplit over 2, 2 x 20");
  const auto hybrid = train_rows<Hybrid<2, ModelSplit<Balanced<2>, GPipe<2>>>>(4, 20);
  test::require_close(hybrid.weights, reference.weights, tolerance, "Hybrid 2 x 2, 2 x 20");
  require_same_means(hybrid, reference, "Hybrid 2 x 2, 2 x 20");
}

TEST_CASE("PositionCrossEntropy: a step with no counted position updates nothing, on every "
          "policy") {
  data::Dataset rows = data::head(garment_rows(), 40);
  std::ranges::fill(rows.targets, -1);
  Trainer<RowReader, DataParallel<>, SGD, PositionCrossEntropy> trainer(devices::cpu(2), sgd,
                                                                       {.seed = 5});
  const auto before = trainer.model().parameters();
  const std::vector<float> initial(before.begin(), before.end());
  struct Steps {
    void on_step(const StepInfo& step) { skipped->push_back(step.skipped); }
    std::vector<bool>* skipped;
  };
  std::vector<bool> skipped;
  trainer.fit(rows, {.epochs = 1, .batch_size = 20, .shuffle = false}, Steps{&skipped});
  REQUIRE(skipped == std::vector<bool>{true, true});
  const auto after = trainer.model().parameters();
  REQUIRE(std::vector<float>(after.begin(), after.end()) == initial);
}

TEST_CASE("PositionCrossEntropy resumes mid-epoch from a checkpoint with the epoch's positions") {
  const Trained reference = train_rows<SingleDevice>(1, 40);
  const TempCheckpoint file("positions");
  const std::string& path = file.path;
  const FitOptions options{.epochs = 2, .batch_size = 40, .shuffle = false};
  // Saved after step 7: epoch 2, after its second step. The resumed epoch's
  // loss divides the saved sums by the saved positions (not its samples).
  fit_sequences<RowReader, SingleDevice, PositionCrossEntropy>(
      1, 5, garment_rows(), options, {},
      callbacks::Checkpoint(
          {.path = path, .every_steps = 7, .every_epoch = false, .at_end = false}));
  const Trained resumed = fit_sequences<RowReader, DataParallel<>, PositionCrossEntropy>(
      3, 5, garment_rows(), options, path);
  test::require_close(resumed.weights, reference.weights, {1e-6, 1e-4}, "resumed over 3");
  require_same_means(resumed, reference, "resumed over 3");
}
