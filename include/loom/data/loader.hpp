// Mini-batches over a Dataset. The order of an epoch is a pure function of
// (seed, epoch), so a run is reproducible whatever the thread timing; a
// background thread gathers batch k+1 into one of two owned buffers while the
// caller trains on batch k in the other.
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
#include <mutex>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

namespace loom::data {

// Seeded augmentation, applied by the loader thread as it gathers a batch:
// a random crop of the image zero-padded by crop_padding pixels on every side
// (zero is the data set's mean after normalisation), then a horizontal flip
// with probability 1/2. Each sample's draw is a function of (seed, epoch,
// sample index), so a run is reproducible under every policy.
struct Augment {
  std::size_t crop_padding = 0;
  bool horizontal_flip = false;
  bool active() const { return crop_padding > 0 || horizontal_flip; }
};

struct LoaderOptions {
  std::size_t batch_size = 64;
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
  Augment augment{};
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

// The sample order of one epoch: identity without shuffle, otherwise a
// Fisher-Yates permutation drawn from the seed's shuffle stream for `epoch`.
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

// Driven from one thread. The Loader keeps a reference to the Dataset, which
// must outlive it.
class Loader {
 public:
  Loader(const Dataset& dataset, LoaderOptions options)
      : dataset_(dataset), options_(options), sample_size_(dataset.sample_size()) {
    LOOM_CHECK(options_.batch_size > 0, "LoaderOptions::batch_size is 0; it must be at least 1");
    check_targets(dataset);
    const std::size_t count = dataset.count;
    batches_ = data::batches_per_epoch(count, options_.batch_size, options_.drop_last);
    max_batch_ = batches_ == 0 ? 0 : std::min(options_.batch_size, count);
    for (Slot& slot : slots_) {
      slot.images.resize(max_batch_ * sample_size_);
      if (dataset.has_sequences()) {
        slot.sequences.resize(max_batch_ * dataset.max_target);
        slot.sequence_lengths.resize(max_batch_);
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
    std::vector<std::size_t> order = epoch_order(dataset_.count, options_, epoch);
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
      out.targets.sequence_lengths = slot.sequence_lengths.data();
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
      slot.sequence_lengths[j] = dataset_.target_lengths[index];
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
