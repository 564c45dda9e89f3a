// What a checkpoint holds and how it maps onto a safetensors file: the
// network's tensors by name ("1.conv.weight", see net/tensors.hpp), the
// optimizer's buffers under "optimizer.<buffer>.<tensor>", and in the
// metadata the optimizer's step count, learning rate and other options, the
// trainer's counters and where in which fit training stopped. Everything is
// in the whole network's layout, whatever the policy that wrote it, so a
// checkpoint loads under any policy and device count.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/linkage.hpp"
#include "../core/meta.hpp"
#include "../data/dataset.hpp"
#include "../io/safetensors.hpp"
#include "../net/tensors.hpp"

namespace loom {

// Where training stands: the epoch in progress (or last ended) and how far
// it went, with its running sums, so a resumed epoch reports what an
// uninterrupted one would.
struct TrainingPosition {
  int epoch = 0;  // 1-based; 0: no fit has run
  std::size_t batches = 0;  // of the epoch, trained
  std::size_t steps = 0;    // of the epoch, optimizer steps taken
  bool ended = false;       // the epoch's end (and its callbacks) reached
  double loss_sum = 0.0;
  // What loss_sum and correct divide by: the samples of the steps taken
  // (a per-sample loss), or their counted positions (PositionCrossEntropy).
  double denominator = 0.0;
  std::size_t correct = 0;
  double errors = 0.0, references = 0.0;  // the loss's error rate, where it has one
  std::size_t samples = 0;
  double seconds = 0.0;
};

// The fit a position belongs to: a resumed fit must draw the same batches.
struct FitIdentity {
  std::size_t samples = 0;  // of the training set
  std::size_t batch_size = 0;
  std::size_t accumulation_steps = 0;
  std::uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;
  std::size_t crop_padding = 0;
  bool horizontal_flip = false;
  std::size_t bucket = 0;  // FitOptions::bucket: it orders the batches

  bool operator==(const FitIdentity&) const = default;
};

namespace detail {

inline constexpr std::string_view checkpoint_format = "loom.checkpoint.1";

struct CheckpointImage {
  std::vector<float> parameters, state;
  std::vector<std::string> buffer_names;  // the optimizer's, in its order
  std::vector<std::vector<float>> buffers;
  std::string optimizer;
  std::uint64_t optimizer_steps = 0;
  // Its options but lr (Options::hyperparameters()); read: those the file has.
  std::vector<std::pair<std::string, float>> optimizer_options;
  float lr = 0.0f, base_lr = 0.0f;
  std::uint64_t steps = 0;    // optimizer steps the trainer has taken
  std::uint64_t seed = 0;     // the trainer's: Dropout's masks are keyed by it
  std::string precision;      // what it trained in, for messages
  float loss_scale = 1.0f;    // fp16's loss scaler
  std::size_t good_steps = 0;
  std::uint64_t skipped_steps = 0;
  std::uint64_t nonfinite_steps = 0;  // skipped under NonFinite::skip
  std::uint64_t batches = 0;  // training batches: Dropout's step counter
  TrainingPosition position;
  std::optional<FitIdentity> fit;
  std::string network, policy;  // what wrote it, for messages
  std::string mesh;  // its ranks' layout (Mesh::describe), empty in older checkpoints
};

// A 40-bit digest of what a checkpoint restores (weights, running
// statistics, optimizer state and position), to check that every process
// read the same file.
inline double fingerprint(const CheckpointImage& image) {
  std::uint64_t h = fnv1a_basis;
  const auto add = [&](const void* data, std::size_t bytes) { h = fnv1a(data, bytes, h); };
  add(image.parameters.data(), image.parameters.size() * sizeof(float));
  add(image.state.data(), image.state.size() * sizeof(float));
  for (const auto& buffer : image.buffers) add(buffer.data(), buffer.size() * sizeof(float));
  add(&image.steps, sizeof image.steps);
  add(&image.position.epoch, sizeof image.position.epoch);
  add(&image.position.batches, sizeof image.position.batches);
  return static_cast<double>(h >> 24);
}

// Numbers in the metadata (strings): doubles in their shortest form that
// reads back to the same value, so a resumed run is bit-identical.
template <class N>
std::string number_text(N value) {
  char text[64];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  return std::string(text, end);
}

template <class N>
N parse_number(const io::SafetensorsFile& file, const std::string& key, const std::string& path) {
  const std::string text = file.metadata(key);
  N value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  LOOM_CHECK(error == std::errc{} && end == text.data() + text.size(), "checkpoint '", path,
             "': metadata '", key, "' is '", text, "', not a number");
  return value;
}

// The options of an optimizer (Options::hyperparameters()), by name.
using OptimizerOptions = std::span<const std::pair<const char*, float>>;

// Defined below; compiled once under LOOM_SEPARATE_COMPILATION (core/linkage.hpp).
LOOM_DECL void write_checkpoint(const std::filesystem::path& path, const CheckpointImage& image,
                                const std::vector<TensorSlot>& table);
LOOM_DECL void check_position(const TrainingPosition& p, const FitIdentity& f,
                              const std::string& where);
LOOM_DECL CheckpointImage read_checkpoint(const std::filesystem::path& path,
                                          std::string_view optimizer,
                                          const std::vector<std::string>& buffer_names,
                                          OptimizerOptions options,
                                          const std::vector<TensorSlot>& table,
                                          std::size_t parameter_count, std::size_t state_count);
LOOM_DECL void check_resumed_options(const CheckpointImage& image, OptimizerOptions options,
                                     const std::string& where);

#if LOOM_IMPLEMENT
// `table`: the network's tensors (tensor_table<Net>()). Not a template, so
// that it is compiled once however many networks a program checkpoints.
LOOM_DECL void write_checkpoint(const std::filesystem::path& path, const CheckpointImage& image,
                                const std::vector<TensorSlot>& table) {
  io::SafetensorsWriter writer;
  for (const auto& slot : table) {
    const auto& from = slot.state ? image.state : image.parameters;
    writer.add(slot.name, std::span<const float>(from).subspan(slot.offset, slot.size()),
               slot.shape);
  }
  for (std::size_t b = 0; b < image.buffers.size(); ++b)
    for (const auto& slot : table)
      if (!slot.state)
        writer.add("optimizer." + image.buffer_names[b] + "." + slot.name,
                   std::span<const float>(image.buffers[b]).subspan(slot.offset, slot.size()),
                   slot.shape);
  writer.set_metadata("format", std::string(checkpoint_format));
  writer.set_metadata("network", image.network);
  writer.set_metadata("policy", image.policy);
  writer.set_metadata("mesh", image.mesh);
  writer.set_metadata("optimizer", image.optimizer);
  writer.set_metadata("optimizer.steps", number_text(image.optimizer_steps));
  writer.set_metadata("optimizer.lr", number_text(image.lr));
  for (const auto& [name, value] : image.optimizer_options)
    writer.set_metadata("optimizer." + name, number_text(value));
  writer.set_metadata("trainer.base_lr", number_text(image.base_lr));
  writer.set_metadata("trainer.steps", number_text(image.steps));
  writer.set_metadata("trainer.seed", number_text(image.seed));
  writer.set_metadata("trainer.precision", image.precision);
  writer.set_metadata("scaler.scale", number_text(image.loss_scale));
  writer.set_metadata("scaler.good_steps", number_text(image.good_steps));
  writer.set_metadata("scaler.skipped_steps", number_text(image.skipped_steps));
  writer.set_metadata("trainer.nonfinite_steps", number_text(image.nonfinite_steps));
  writer.set_metadata("trainer.batches", number_text(image.batches));
  const auto& p = image.position;
  writer.set_metadata("position.epoch", number_text(p.epoch));
  writer.set_metadata("position.batches", number_text(p.batches));
  writer.set_metadata("position.steps", number_text(p.steps));
  writer.set_metadata("position.ended", p.ended ? "1" : "0");
  writer.set_metadata("position.loss_sum", number_text(p.loss_sum));
  writer.set_metadata("position.correct", number_text(p.correct));
  // Only where it is not the samples: older checkpoints, which lack it, load alike.
  if (p.denominator != static_cast<double>(p.samples))
    writer.set_metadata("position.denominator", number_text(p.denominator));
  if (p.references > 0) {
    writer.set_metadata("position.errors", number_text(p.errors));
    writer.set_metadata("position.references", number_text(p.references));
  }
  writer.set_metadata("position.samples", number_text(p.samples));
  writer.set_metadata("position.seconds", number_text(p.seconds));
  if (image.fit) {
    const auto& f = *image.fit;
    writer.set_metadata("fit.samples", number_text(f.samples));
    writer.set_metadata("fit.batch_size", number_text(f.batch_size));
    writer.set_metadata("fit.accumulation_steps", number_text(f.accumulation_steps));
    writer.set_metadata("fit.seed", number_text(f.seed));
    writer.set_metadata("fit.shuffle", f.shuffle ? "1" : "0");
    writer.set_metadata("fit.drop_last", f.drop_last ? "1" : "0");
    writer.set_metadata("fit.crop_padding", number_text(f.crop_padding));
    writer.set_metadata("fit.horizontal_flip", f.horizontal_flip ? "1" : "0");
    writer.set_metadata("fit.bucket", number_text(f.bucket));
  }
  writer.write(path);
}

// A position is where its fit's batches left it: every field follows from
// the epoch, the batches trained and the fit's data and batch options. A
// field that does not is named; the file is corrupt (or edited).
LOOM_DECL void check_position(const TrainingPosition& p, const FitIdentity& f,
                              const std::string& where) {
  const auto corrupt = [&](const char* field, auto value, const auto&... why) {
    LOOM_FAIL("checkpoint '", where, "': metadata ", field, " is ", value, ", but ", why...,
              "; the checkpoint is corrupt (its position does not fit its fit's options)");
  };
  const std::size_t batches_per_epoch = data::batches_per_epoch(f.samples, f.batch_size, f.drop_last);
  const std::size_t epoch_samples = f.drop_last ? batches_per_epoch * f.batch_size : f.samples;
  const std::size_t k = f.accumulation_steps;
  if (p.epoch < 0) corrupt("position.epoch", p.epoch, "an epoch is 0 (none yet) or more");
  if (p.epoch == 0) {
    if (p.batches != 0 || p.steps != 0 || p.samples != 0 || p.ended)
      corrupt("position.epoch", 0, "position.batches ", p.batches, ", position.steps ", p.steps,
              ", position.samples ", p.samples, " and position.ended ", p.ended,
              " must all be 0 before the first epoch");
    return;
  }
  if (p.batches > batches_per_epoch)
    corrupt("position.batches", p.batches, "an epoch of fit.samples ", f.samples,
            " in batches of fit.batch_size ", f.batch_size, " has ", batches_per_epoch);
  if (p.ended && p.batches != batches_per_epoch)
    corrupt("position.ended", 1, "position.batches ", p.batches, " is short of the epoch's ",
            batches_per_epoch);
  if (p.batches % k != 0 && p.batches != batches_per_epoch)
    corrupt("position.batches", p.batches, "optimizer steps of fit.accumulation_steps ", k,
            " batches end only at multiples of ", k, " or at the epoch's end");
  if (const std::size_t steps = (p.batches + k - 1) / k; p.steps != steps)
    corrupt("position.steps", p.steps, "position.batches ", p.batches, " in steps of ", k,
            " batch(es) make ", steps);
  if (const std::size_t samples = std::min(p.batches * f.batch_size, epoch_samples);
      p.samples != samples)
    corrupt("position.samples", p.samples, "position.batches ", p.batches, " of fit.batch_size ",
            f.batch_size, " hold ", samples, " of the epoch's ", epoch_samples);
  if (p.denominator == static_cast<double>(p.samples) && p.correct > p.samples)
    corrupt("position.correct", p.correct, "only position.samples ", p.samples, " were seen");
  if (!(p.denominator >= 0.0) || !std::isfinite(p.denominator) ||
      static_cast<double>(p.correct) > p.denominator)
    corrupt("position.denominator", p.denominator,
            "a count is finite, >= 0 and at least position.correct ", p.correct);
  if (!(p.loss_sum >= 0.0) || !std::isfinite(p.loss_sum))
    corrupt("position.loss_sum", p.loss_sum, "a sum of cross-entropies is finite and >= 0");
  if (!(p.seconds >= 0.0) || !std::isfinite(p.seconds))
    corrupt("position.seconds", p.seconds, "a duration is finite and >= 0");
}

// Reads and checks everything before the caller changes anything: a
// checkpoint that does not fit leaves the trainer as it was.
// `buffer_names`: the optimizer's buffers this trainer keeps; `options`:
// its options, whose names are read (check_resumed_options compares them).
// `table`: the network's tensors (tensor_table<Net>()), `parameter_count`
// and `state_count` its sizes.
LOOM_DECL CheckpointImage read_checkpoint(const std::filesystem::path& path,
                                          std::string_view optimizer,
                                          const std::vector<std::string>& buffer_names,
                                          OptimizerOptions options,
                                          const std::vector<TensorSlot>& table,
                                          std::size_t parameter_count, std::size_t state_count) {
  const std::string where = path.string();
  const auto file = io::SafetensorsFile::read(path);
  LOOM_CHECK(file.metadata().contains("format") && file.metadata("format") == checkpoint_format,
             "checkpoint '", where, "' is a safetensors file but not a loom checkpoint (its "
             "metadata has no format '", checkpoint_format, "'); load weights-only files with "
             "io::SafetensorsFile");
  CheckpointImage image;
  image.optimizer = file.metadata("optimizer");
  image.network = file.metadata("network");
  image.policy = file.metadata("policy");
  if (file.metadata().contains("mesh")) image.mesh = file.metadata("mesh");
  LOOM_CHECK(image.optimizer == optimizer, "checkpoint '", where, "' was written by a trainer "
             "using ", image.optimizer, ", but this one uses ", optimizer,
             "; its optimizer state would not fit");
  image.parameters.assign(parameter_count, 0.0f);
  image.state.assign(state_count, 0.0f);
  std::size_t expected = table.size();
  for (const auto& slot : table) {
    LOOM_CHECK(file.contains(slot.name), "checkpoint '", where, "' has no tensor '", slot.name,
               "' of this network; it was written for ", image.network);
    auto& into = slot.state ? image.state : image.parameters;
    file.read(slot.name, std::span<float>(into).subspan(slot.offset, slot.size()), slot.shape);
  }
  image.buffer_names = buffer_names;
  for (const auto& name : buffer_names) {
    auto& buffer = image.buffers.emplace_back(parameter_count, 0.0f);
    for (const auto& slot : table) {
      if (slot.state) continue;
      const std::string key = "optimizer." + name + "." + slot.name;
      LOOM_CHECK(file.contains(key), "checkpoint '", where, "' has no optimizer tensor '", key,
                 "': it was written by ", image.optimizer, " with other options (e.g. without "
                 "momentum)");
      file.read(key, std::span<float>(buffer).subspan(slot.offset, slot.size()), slot.shape);
      ++expected;
    }
  }
  for (const auto& tensor : file.tensors()) {
    bool known = false;
    for (const auto& slot : table) known = known || tensor.name == slot.name;
    for (const auto& name : buffer_names)
      for (const auto& slot : table)
        known = known || (!slot.state && tensor.name == "optimizer." + name + "." + slot.name);
    LOOM_CHECK(known, "checkpoint '", where, "' holds tensor '", tensor.name,
               "', which this network or optimizer does not have; it was written for ",
               image.network, " with ", image.optimizer);
  }
  LOOM_CHECK(file.tensors().size() == expected, "checkpoint '", where, "' holds ",
             file.tensors().size(), " tensors where ", expected, " were expected");
  image.optimizer_steps = parse_number<std::uint64_t>(file, "optimizer.steps", where);
  // Checkpoints from before the options were kept have none to compare.
  for (const auto& [name, value] : options)
    if (const std::string key = std::string("optimizer.") + name; file.metadata().contains(key))
      image.optimizer_options.emplace_back(name, parse_number<float>(file, key, where));
  image.lr = parse_number<float>(file, "optimizer.lr", where);
  image.base_lr = parse_number<float>(file, "trainer.base_lr", where);
  image.steps = parse_number<std::uint64_t>(file, "trainer.steps", where);
  image.seed = parse_number<std::uint64_t>(file, "trainer.seed", where);
  // Checkpoints from before mixed precision have no scaler: fp32's.
  if (file.metadata().contains("scaler.scale")) {
    image.precision = file.metadata("trainer.precision");
    image.loss_scale = parse_number<float>(file, "scaler.scale", where);
    image.good_steps = parse_number<std::size_t>(file, "scaler.good_steps", where);
    image.skipped_steps = parse_number<std::uint64_t>(file, "scaler.skipped_steps", where);
  }
  // Checkpoints from before the non-finite steps were kept: none counted.
  if (file.metadata().contains("trainer.nonfinite_steps"))
    image.nonfinite_steps = parse_number<std::uint64_t>(file, "trainer.nonfinite_steps", where);
  LOOM_CHECK(image.loss_scale > 0.0f && std::isfinite(image.loss_scale), "checkpoint '", where,
             "': loss scale ", image.loss_scale, " must be positive and finite");
  image.batches = parse_number<std::uint64_t>(file, "trainer.batches", where);
  auto& p = image.position;
  p.epoch = parse_number<int>(file, "position.epoch", where);
  p.batches = parse_number<std::size_t>(file, "position.batches", where);
  p.steps = parse_number<std::size_t>(file, "position.steps", where);
  p.ended = parse_number<int>(file, "position.ended", where) != 0;
  p.loss_sum = parse_number<double>(file, "position.loss_sum", where);
  p.correct = parse_number<std::size_t>(file, "position.correct", where);
  // Written by losses with an error rate (CTCLoss) only.
  if (file.metadata().contains("position.references")) {
    p.errors = parse_number<double>(file, "position.errors", where);
    p.references = parse_number<double>(file, "position.references", where);
  }
  p.samples = parse_number<std::size_t>(file, "position.samples", where);
  p.denominator = file.metadata().contains("position.denominator")
                      ? parse_number<double>(file, "position.denominator", where)
                      : static_cast<double>(p.samples);
  p.seconds = parse_number<double>(file, "position.seconds", where);
  LOOM_CHECK(image.lr >= 0.0f && image.base_lr > 0.0f, "checkpoint '", where,
             "': learning rates ", image.lr, " (now) and ", image.base_lr,
             " (base) must be >= 0 and > 0");
  if (file.metadata().contains("fit.samples")) {
    FitIdentity f;
    f.samples = parse_number<std::size_t>(file, "fit.samples", where);
    f.batch_size = parse_number<std::size_t>(file, "fit.batch_size", where);
    f.accumulation_steps = parse_number<std::size_t>(file, "fit.accumulation_steps", where);
    f.seed = parse_number<std::uint64_t>(file, "fit.seed", where);
    f.shuffle = parse_number<int>(file, "fit.shuffle", where) != 0;
    f.drop_last = parse_number<int>(file, "fit.drop_last", where) != 0;
    f.crop_padding = parse_number<std::size_t>(file, "fit.crop_padding", where);
    f.horizontal_flip = parse_number<int>(file, "fit.horizontal_flip", where) != 0;
    // Written since FitOptions::bucket was added; before, no fit bucketed.
    if (file.metadata().contains("fit.bucket"))
      f.bucket = parse_number<std::size_t>(file, "fit.bucket", where);
    LOOM_CHECK(f.batch_size > 0 && f.accumulation_steps > 0 && f.samples > 0, "checkpoint '",
               where, "': its fit has batch size ", f.batch_size, ", ", f.accumulation_steps,
               " batches per step and ", f.samples, " samples; none may be 0");
    image.fit = f;
    check_position(image.position, f, where);
  }
  return image;
}

// A resumed run continues the one that wrote the checkpoint only with the
// same optimizer options; lr aside, which schedules change (the checkpoint's
// goes on).
LOOM_DECL void check_resumed_options(const CheckpointImage& image, OptimizerOptions options,
                                     const std::string& where) {
  for (const auto& [name, was] : image.optimizer_options)
    for (const auto& [this_name, now] : options)
      if (name == this_name && was != now)
        throw ResumeMismatch("loom: checkpoint '" + where + "' was written by a trainer using " +
                                 image.optimizer + " with " + name + " " + number_text(was) +
                                 ", but this one has " + number_text(now) +
                                 "; resume with the same " + image.optimizer +
                                 " options (lr may differ), or load(path, false) to start a "
                                 "new fit from the checkpoint's weights and optimizer state",
                             name, number_text(was), number_text(now));
}

#endif  // LOOM_IMPLEMENT

}  // namespace detail
}  // namespace loom
