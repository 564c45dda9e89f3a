// Mini-batches over a Dataset. The order of an epoch is a pure function of
// (seed, epoch), so a run is reproducible whatever the thread timing; a
// background thread gathers batch k+1 into one of two owned buffers while the
// caller trains on batch k in the other.
//
// Batches bucketed by length (LoaderOptions::bucket = k, for data with
// Dataset::frames): the epoch's shuffled order is cut into buckets of k
// batches' samples, each bucket sorted by frames (stably: equal lengths stay
// in their shuffled order) and cut into batches, and the epoch's batches are
// shuffled by a second draw from (seed, epoch). A batch then pads little past
// its samples' frames, while which samples share a batch, and when, is still
// random. The order stays a pure function of (seed, epoch), the same on every
// process and rank count, so a resumed epoch draws the same batches. The
// epoch's short batch (count % batch_size samples) stays last: without
// drop_last it holds the last bucket's longest samples; with drop_last, which
// leaves it out, the shuffled order's last samples, so that the samples left
// out are random, not the longest ones.
//
// Within each bucketed batch the samples are ordered so that every
// contiguous run of them holds about its share of the frames (a greedy walk
// along the batch's mean length, detail::balance_batch): the contiguous
// split of a global batch over replicas (parallel/grid_engine.hpp's
// batch_share), and of a share into micro-batches, then gives each about the
// same frames whatever their count. On long-tailed lengths, in buckets of 10
// batches of 24, the largest of 3 shares held 1.02x the smallest's frames on
// average and 1.30x at worst, against 1.31x and 3.8x for the batch sorted by
// length; the padding fell from 0.80 of the padded frames to 0.31 (0.07 with
// buckets of 50); tests/unit/test_data.cpp measures both. (A batch that the
// replica count does not divide gives some replicas one sample more, whatever
// the order.)
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <loom/core/error.hpp>
#include <loom/core/rng.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/data/dataset.hpp>
#include <loom/data/spec_augment.hpp>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace loom::data {

// Seeded augmentation, applied by the loader thread as it gathers a batch:
// a random crop of the image zero-padded by crop_padding pixels on every side
// (zero is the data set's mean after normalisation), then a horizontal flip
// with probability 1/2; or, for sequences of features (frames x features,
// such as log-mel bands), SpecAugment's masks over each sample's valid
// frames (`spec`). Each sample's draw is a function of (seed, epoch, sample
// index), so a run is reproducible under every policy.
struct Augment {
  std::size_t crop_padding = 0;
  bool horizontal_flip = false;
  std::optional<SpecAugmentOptions> spec{};
  bool active() const { return crop_padding > 0 || horizontal_flip; }
};

struct LoaderOptions {
  std::size_t batch_size = 64;
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
  Augment augment{};
  // Batches of similar length (see above): 0 off, else the batches per
  // bucket (50: each batch's samples are drawn from 50 batches' worth of
  // similar length). Needs Dataset::frames.
  std::size_t bucket = 0;
};

// Crops and flips one C x H x W image in place as `augment` and the draw
// (seed, epoch, index) say; scratch holds a copy of the image.
inline void augment_image(float* image, std::size_t channels, std::size_t height,
                          std::size_t width, const Augment& augment, std::uint64_t seed,
                          std::size_t epoch, std::size_t index, std::vector<float>& scratch) {
  const std::uint64_t stream = stream_key(RngPurpose::augment, epoch);
  const std::uint64_t span = 2 * augment.crop_padding + 1;
  const long dy = static_cast<long>(hash_key(seed, stream, 3 * index) % span) -
                  static_cast<long>(augment.crop_padding);
  const long dx = static_cast<long>(hash_key(seed, stream, 3 * index + 1) % span) -
                  static_cast<long>(augment.crop_padding);
  const bool flip = augment.horizontal_flip && (hash_key(seed, stream, 3 * index + 2) & 1) != 0;
  scratch.assign(image, image + channels * height * width);
  const long h_max = static_cast<long>(height), w_max = static_cast<long>(width);
  for (std::size_t c = 0; c < channels; ++c)
    for (long h = 0; h < h_max; ++h)
      for (long w = 0; w < w_max; ++w) {
        const long sh = h + dy, sw = (flip ? w_max - 1 - w : w) + dx;
        image[(c * height + static_cast<std::size_t>(h)) * width + static_cast<std::size_t>(w)] =
            sh < 0 || sh >= h_max || sw < 0 || sw >= w_max
                ? 0.0f
                : scratch[(c * height + static_cast<std::size_t>(sh)) * width +
                          static_cast<std::size_t>(sw)];
      }
}

// Valid until the next call to Loader::next() or Loader::start_epoch().
struct Batch {
  const float* images = nullptr;  // size * sample_size(), NCHW
  const std::int32_t* labels = nullptr;  // targets.labels
  std::size_t size = 0;
  std::size_t first = 0;  // position of its first sample in this epoch's order
  Targets targets{};      // what its samples train against (labels, or label sequences)
};

// The sample order of one epoch without bucketing: identity without
// shuffle, otherwise a Fisher-Yates permutation drawn from the seed's
// shuffle stream for `epoch`.
inline std::vector<std::size_t> epoch_order(std::size_t count, const LoaderOptions& options,
                                            std::size_t epoch) {
  std::vector<std::size_t> order(count);
  std::iota(order.begin(), order.end(), std::size_t{0});
  if (options.shuffle && count > 1) {
    CounterRng rng(options.seed, stream_key(RngPurpose::shuffle, epoch));
    for (std::size_t i = count - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  }
  return order;
}

namespace detail {

// Orders one batch's samples so that each contiguous run of them holds about
// its share of the batch's frames: position k takes the remaining sample
// that brings the first k + 1 samples' frames nearest to k + 1 times the
// batch's mean (the shorter one on a tie). A sorted batch would give its
// first replica the shortest samples and its last the longest; this order
// serves every replica count at once, as a split must (the order is fixed
// before the rank count is known). Integer arithmetic: the same on every
// machine. `frames` is indexed by sample.
inline void balance_batch(std::span<std::size_t> batch, std::span<const std::int32_t> frames) {
  const auto n = static_cast<std::int64_t>(batch.size());
  if (n < 3) return;
  std::vector<std::size_t> left(batch.begin(), batch.end());
  std::stable_sort(left.begin(), left.end(),
                   [&](std::size_t a, std::size_t b) { return frames[a] < frames[b]; });
  std::int64_t total = 0;
  for (const std::size_t i : left) total += frames[i];
  // n * (frames of the first k) - k * total: 0 when they hold their share.
  std::int64_t ahead = 0;
  for (std::size_t k = 0; k < batch.size(); ++k) {
    // The frames x that brings `ahead + n * x - total` nearest 0.
    const auto at_least = std::partition_point(
        left.begin(), left.end(), [&](std::size_t i) { return ahead + n * frames[i] - total < 0; });
    auto pick = at_least;
    if (pick == left.end() || (pick != left.begin() && total - ahead - n * frames[*(pick - 1)] <=
                                                           ahead + n * frames[*pick] - total))
      --pick;
    batch[k] = *pick;
    ahead += n * frames[*pick] - total;
    left.erase(pick);
  }
}

}  // namespace detail

// The sample order of one epoch over `set`: epoch_order(count, ...), then
// with options.bucket its batches bucketed by length as the header says.
inline std::vector<std::size_t> epoch_order(const Dataset& set, const LoaderOptions& options,
                                            std::size_t epoch) {
  std::vector<std::size_t> order = epoch_order(set.count, options, epoch);
  if (options.bucket == 0) return order;
  LOOM_CHECK(set.frames.size() == set.count, "LoaderOptions::bucket is ", options.bucket,
             " but dataset '", set.name, "' has ", set.frames.size(),
             " sample lengths (Dataset::frames) for ", set.count,
             " samples; bucketing by length needs each sample's frames (or set bucket 0)");
  LOOM_CHECK(options.batch_size > 0, "LoaderOptions::batch_size is 0; it must be at least 1");
  const std::size_t size = options.batch_size, full = set.count / size;
  const std::span<const std::int32_t> frames(set.frames);
  const auto by_frames = [&](std::size_t a, std::size_t b) { return frames[a] < frames[b]; };
  // With drop_last the short batch's samples are left out: the shuffled
  // order's last ones, random. Otherwise they join the last bucket, and the
  // short batch holds its longest samples.
  const std::size_t sorted = options.drop_last ? full * size : set.count;
  const std::size_t span = std::min(options.bucket, std::max<std::size_t>(full, 1)) * size;
  for (std::size_t first = 0; first < sorted; first += span) {
    const std::size_t end = first + span >= full * size ? sorted : first + span;
    std::stable_sort(order.begin() + static_cast<std::ptrdiff_t>(first),
                     order.begin() + static_cast<std::ptrdiff_t>(end), by_frames);
    if (end == sorted) break;
  }
  std::vector<std::size_t> batches(full);
  std::iota(batches.begin(), batches.end(), std::size_t{0});
  if (options.shuffle && full > 1) {
    CounterRng rng(options.seed, stream_key(RngPurpose::bucket, epoch));
    for (std::size_t i = full - 1; i > 0; --i) std::swap(batches[i], batches[rng.below(i + 1)]);
  }
  std::vector<std::size_t> bucketed;
  bucketed.reserve(set.count);
  for (const std::size_t b : batches)
    bucketed.insert(bucketed.end(), order.begin() + static_cast<std::ptrdiff_t>(b * size),
                    order.begin() + static_cast<std::ptrdiff_t>((b + 1) * size));
  bucketed.insert(bucketed.end(), order.begin() + static_cast<std::ptrdiff_t>(full * size),
                  order.end());
  for (std::size_t first = 0; first < set.count; first += size)
    detail::balance_batch(std::span(bucketed).subspan(first, std::min(size, set.count - first)),
                          frames);
  return bucketed;
}

// Driven from one thread. The Loader keeps a reference to the Dataset, which
// must outlive it.
class Loader {
 public:
  Loader(const Dataset& dataset, LoaderOptions options)
      : dataset_(dataset), options_(options), sample_size_(dataset.sample_size()) {
    LOOM_CHECK(options_.batch_size > 0, "LoaderOptions::batch_size is 0; it must be at least 1");
    check_targets(dataset);
    LOOM_CHECK(options_.bucket == 0 || !dataset.frames.empty(), "LoaderOptions::bucket is ",
               options_.bucket, " but dataset '", dataset.name,
               "' has no sample lengths (Dataset::frames): every sample is as long as the "
               "next; bucketing by length needs them (or set bucket 0)");
    const std::size_t count = dataset.count;
    batches_ = data::batches_per_epoch(count, options_.batch_size, options_.drop_last);
    max_batch_ = batches_ == 0 ? 0 : std::min(options_.batch_size, count);
    for (Slot& slot : slots_) {
      slot.images.resize(max_batch_ * sample_size_);
      if (dataset.has_sequences()) {
        slot.sequences.resize(max_batch_ * dataset.max_target);
        slot.sequence_lengths.resize(dataset.target_lengths.empty() ? 0 : max_batch_);
      } else {
        slot.labels.resize(max_batch_);
      }
      if (!dataset.frames.empty()) slot.frames.resize(max_batch_);
    }
    worker_ = loom::detail::start_quiet_thread("loom-loader", [this] { run(); });
  }

  // A temporary Dataset would die before the Loader that references it.
  Loader(const Dataset&&, LoaderOptions) = delete;
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  ~Loader() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_one();
    worker_.join();
  }

  std::size_t batches_per_epoch() const { return batches_; }
  std::size_t max_batch() const { return max_batch_; }

  // Abandons any epoch in progress (its batches become invalid) and starts
  // prefetching batch `first_batch` of `epoch` (a resumed run skips those
  // it has trained on: the order is a function of the seed and epoch).
  void start_epoch(std::size_t epoch, std::size_t first_batch = 0) {
    LOOM_CHECK(first_batch <= batches_, "Loader::start_epoch: batch ", first_batch, " of ",
               batches_, " in an epoch");
    std::vector<std::size_t> order = epoch_order(dataset_, options_, epoch);
    {
      std::unique_lock lock(mutex_);
      // The worker reads order_ and writes a slot without the lock while it gathers.
      ready_cv_.wait(lock, [&] { return !gathering_; });
      order_ = std::move(order);
      epoch_ = epoch;
      for (Slot& slot : slots_) {
        slot.state = Slot::State::empty;
        slot.error = nullptr;
      }
      held_ = nullptr;
      fill_ = first_batch;
      take_ = first_batch;
      started_ = true;
    }
    work_cv_.notify_one();
  }

  // Fills `out` with the next batch of the epoch, or returns false at its end.
  // Rethrows an exception raised while the batch was gathered; the epoch then
  // ends.
  bool next(Batch& out) {
    std::unique_lock lock(mutex_);
    LOOM_CHECK(started_,
               "Loader::next() called before start_epoch(); call start_epoch(epoch) first");
    if (held_) {
      held_->state = Slot::State::empty;
      held_ = nullptr;
      work_cv_.notify_one();
    }
    if (take_ == batches_) return false;
    Slot& slot = slots_[take_ % 2];
    ready_cv_.wait(lock, [&] {
      return slot.state == Slot::State::ready || slot.state == Slot::State::failed;
    });
    if (slot.state == Slot::State::failed) {
      const std::exception_ptr error = std::exchange(slot.error, nullptr);
      slot.state = Slot::State::empty;
      take_ = batches_;
      std::rethrow_exception(error);
    }
    slot.state = Slot::State::held;
    held_ = &slot;
    ++take_;
    out = Batch{.images = slot.images.data(),
                .labels = slot.labels.empty() ? nullptr : slot.labels.data(),
                .size = slot.size,
                .first = slot.first};
    out.targets.labels = out.labels;
    if (!slot.sequences.empty()) {
      out.targets.sequences = slot.sequences.data();
      out.targets.sequence_lengths =
          slot.sequence_lengths.empty() ? nullptr : slot.sequence_lengths.data();
      out.targets.max_target = dataset_.max_target;
    }
    if (!slot.frames.empty()) out.targets.frames = slot.frames.data();
    return true;
  }

 private:
  struct Slot {
    enum class State { empty, ready, failed, held };
    State state = State::empty;
    std::vector<float> images;
    std::vector<std::int32_t> labels;
    std::vector<std::int32_t> sequences, sequence_lengths, frames;
    std::size_t size = 0;
    std::size_t first = 0;
    std::exception_ptr error;
  };

  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_cv_.wait(lock, [&] {
        return stop_ ||
               (started_ && fill_ < batches_ && slots_[fill_ % 2].state == Slot::State::empty);
      });
      if (stop_) return;
      const std::size_t batch = fill_;
      Slot& slot = slots_[batch % 2];
      gathering_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        gather(batch, slot);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      gathering_ = false;
      slot.state = error ? Slot::State::failed : Slot::State::ready;
      slot.error = error;
      fill_ = error ? batches_ : batch + 1;
      ready_cv_.notify_all();
    }
  }

  // Labels are checked here, where they are read, because a Dataset is a plain
  // aggregate that its owner may build or edit after constructing the Loader.
  void gather(std::size_t batch, Slot& slot) {
    const std::size_t first = batch * options_.batch_size;
    const std::size_t size = std::min(options_.batch_size, dataset_.count - first);
    for (std::size_t j = 0; j < size; ++j) {
      const std::size_t index = order_[first + j];
      std::copy_n(dataset_.images.begin() + static_cast<std::ptrdiff_t>(index * sample_size_),
                  sample_size_,
                  slot.images.begin() + static_cast<std::ptrdiff_t>(j * sample_size_));
      if (options_.augment.active())
        augment_image(slot.images.data() + j * sample_size_, dataset_.channels, dataset_.height,
                      dataset_.width, options_.augment, options_.seed, epoch_, index, scratch_);
      if (options_.augment.spec) {
        // Its valid frames only: the padding stays zero.
        const std::size_t rows = dataset_.channels * dataset_.height;
        const std::size_t frames =
            dataset_.frames.empty() ? rows : static_cast<std::size_t>(dataset_.frames[index]);
        spec_augment(std::span<float>(slot.images.data() + j * sample_size_,
                                      frames * dataset_.width),
                     frames, dataset_.width, *options_.augment.spec, options_.seed, epoch_, index);
      }
      gather_targets(index, j, slot);
    }
    slot.size = size;
    slot.first = first;
  }

  void gather_targets(std::size_t index, std::size_t j, Slot& slot) const {
    if (dataset_.has_sequences()) {
      const std::size_t width = dataset_.max_target;
      std::copy_n(dataset_.targets.begin() + static_cast<std::ptrdiff_t>(index * width), width,
                  slot.sequences.begin() + static_cast<std::ptrdiff_t>(j * width));
      if (!slot.sequence_lengths.empty()) slot.sequence_lengths[j] = dataset_.target_lengths[index];
    } else {
      const std::int32_t label = dataset_.labels[index];
      LOOM_CHECK(label >= 0 && static_cast<std::size_t>(label) < dataset_.classes, "dataset '",
                 dataset_.name, "' has label ", label, " at sample ", index, "; expected 0..",
                 dataset_.classes - 1, " for ", dataset_.classes, " classes");
      slot.labels[j] = label;
    }
    if (!slot.frames.empty()) slot.frames[j] = dataset_.frames[index];
  }

  const Dataset& dataset_;
  const LoaderOptions options_;
  const std::size_t sample_size_;
  std::size_t batches_ = 0;
  std::size_t max_batch_ = 0;

  std::mutex mutex_;
  std::condition_variable work_cv_;   // caller -> worker: a slot is free, or stop
  std::condition_variable ready_cv_;  // worker -> caller: a slot is filled, or gathering ended
  std::vector<std::size_t> order_;
  std::size_t epoch_ = 0;
  std::vector<float> scratch_;  // the worker's copy of the image it augments
  Slot slots_[2];
  Slot* held_ = nullptr;  // the slot behind the Batch the caller holds
  std::size_t fill_ = 0;  // next batch the worker gathers
  std::size_t take_ = 0;  // next batch next() returns
  bool gathering_ = false;
  bool started_ = false;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace loom::data
