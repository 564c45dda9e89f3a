// Trainer::save and load, and a resumed fit's checks: a checkpoint holds
// the whole network's layout and the position in the fit, so it loads under
// any policy and device count.
#pragma once

#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <sstream>
#include <string>

#include "trainer_core.hpp"

namespace loom::detail {

#if LOOM_IMPLEMENT
LOOM_DECL void TrainerCore::save_with(const std::filesystem::path& path,
                                      const std::function<void(CheckpointImage&)>& fill,
                                      const ImageWriter& write) {
  LOOM_CHECK(gpu_unreported_ == 0, "Trainer::save: called while the GPU runs a step that "
             "fit() has not reported (the GPU runs a step ahead of the callbacks, and a fit "
             "that failed may leave one behind); save from callbacks::Checkpoint, at an "
             "epoch's end, from a step callback whose needs_state_at_step(steps) is true for "
             "that step, or after a fit that ended");
  detail::CheckpointImage image;
  fill(image);
  image.base_lr = base_lr_;
  image.steps = steps_;
  image.seed = options_.seed;
  image.batches = batches_;
  image.precision = std::string(precision_name(options_.precision));
  image.loss_scale = scaler_.scale();
  image.good_steps = scaler_.good_steps();
  image.skipped_steps = skipped_steps_;
  image.nonfinite_steps = nonfinite_steps_;
  image.position = position_;
  image.fit = fit_;
  // Rank 0 writes; every process learns whether it could.
  std::string failure;
  if (process_rank_ == 0) {
    try {
      write(path, image);
    } catch (const std::exception& error) {  // out of memory too: the others must hear
      failure = error.what();
    }
  }
  if (any_process_failed(!failure.empty())) {
    if (!failure.empty()) throw Error(failure);
    LOOM_FAIL("Trainer::save: process 0 could not write checkpoint '", path.string(),
              "' (its error says why)");
  }
}

LOOM_DECL void TrainerCore::load_with(const std::filesystem::path& path, bool resume,
                                      const std::function<CheckpointImage()>& read_image,
                                      const std::function<void(const CheckpointImage&)>& restore) {
  // Across processes every one reads the file; all go on only if all
  // could, and read the same: a stale copy on one node would split them.
  detail::CheckpointImage image;
  std::exception_ptr failure;
  Fingerprint read;
  try {
    image = read_image();
    read.add("checkpoint contents", detail::fingerprint(image)).add("load.resume", resume);
  } catch (...) {
    failure = std::current_exception();
  }
  const auto differ = compare_processes(detail::AgreementPhase::load, read, failure);
  using Kind = detail::Disagreement::Kind;
  LOOM_CHECK(differ.kind != Kind::failed, "Trainer::load: another process could not read "
             "checkpoint '", path.string(), "' (process ", differ.rank, ": ", differ.failure,
             "); every process needs the file");
  LOOM_CHECK(differ.kind != Kind::field || differ.name != "checkpoint contents",
             "Trainer::load: checkpoint '", path.string(), "' is not the same file on every "
             "process (its weights or position differ); give every process the same checkpoint");
  if (differ.kind != Kind::none)
    throw Error(detail::disagreement_text(differ, detail::AgreementPhase::load, process_rank_));
  // Before restore, which hands fp16's scale to the GPUs.
  scaler_.restore(image.loss_scale, image.good_steps);
  skipped_steps_ = image.skipped_steps;
  restore(image);
  if (resume) {
    base_lr_ = image.base_lr;
    fit_ = image.fit;
    position_ = image.position;
  } else {
    position_ = {};  // a new fit's, not the checkpoint's
  }
  steps_ = image.steps;
  options_.seed = image.seed;  // Dropout's masks go on as they would have
  batches_ = image.batches;
  nonfinite_steps_ = image.nonfinite_steps;
  gpu_unreported_ = 0;  // the devices hold the checkpoint's state now
  resume_ = resume && image.position.epoch > 0 ? std::optional(image.position) : std::nullopt;
  resume_fit_ = resume ? image.fit : std::nullopt;
}

LOOM_DECL std::optional<TrainingPosition> TrainerCore::resume_position(
    const FitIdentity& identity, std::size_t batches_per_epoch) {
  if (!resume_ || !resume_fit_) {
    resume_.reset();
    resume_fit_.reset();
    fit_ = identity;
    // A new fit's position from its start: a save before its first epoch
    // (a stop() in on_fit_begin) must not pair the last fit's position
    // with this fit's options.
    position_ = {};
    return std::nullopt;
  }
  const auto& saved = resume_fit_;
  const auto differs = [](const char* setting, const char* what, auto was, auto now) {
    if (was == now) return;
    std::ostringstream text;
    text << "loom: fit: the loaded checkpoint stopped in a fit with " << what << " " << was
         << ", but this fit has " << now << "; resume with the same data and FitOptions, "
         << "or load(path, false) to start a new fit from the checkpoint's weights";
    throw ResumeMismatch(text.str(), setting, (std::ostringstream() << was).str(),
                         (std::ostringstream() << now).str());
  };
  differs("samples", "training samples", saved->samples, identity.samples);
  differs("batch_size", "batch size", saved->batch_size, identity.batch_size);
  differs("accumulation_steps", "accumulation_steps", saved->accumulation_steps,
          identity.accumulation_steps);
  differs("seed", "seed", saved->seed, identity.seed);
  differs("shuffle", "shuffle", saved->shuffle, identity.shuffle);
  differs("drop_last", "drop_last", saved->drop_last, identity.drop_last);
  differs("augment.crop_padding", "augment.crop_padding", saved->crop_padding,
          identity.crop_padding);
  differs("augment.horizontal_flip", "augment.horizontal_flip", saved->horizontal_flip,
          identity.horizontal_flip);
  differs("bucket", "bucket", saved->bucket, identity.bucket);
  LOOM_CHECK(resume_->batches <= batches_per_epoch && resume_->epoch >= 1, "fit: the loaded "
             "checkpoint stopped after batch ", resume_->batches, " of epoch ", resume_->epoch,
             ", but its fit's epochs have ", batches_per_epoch, " batches; it is corrupt");
  fit_ = identity;
  resume_fit_.reset();
  return std::exchange(resume_, std::nullopt);
}

#endif  // LOOM_IMPLEMENT

}  // namespace loom::detail
