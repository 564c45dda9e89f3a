// Callbacks for Trainer::fit. A callback implements any of
// on_fit_prepare(FitInfo, Fingerprint&[, Trainer&]),
// on_fit_begin(FitInfo[, Trainer&]), on_step_begin(StepBegin[, Trainer&]),
// on_step(StepInfo[, Trainer&]), on_epoch_end(EpochInfo[, Trainer&]) and
// on_fit_end([Trainer&]); the trainer calls the ones that exist, in the
// order the callbacks were given. on_fit_prepare comes first, before any
// collective: it adds what must be the same on every MPI process to the
// fingerprint the processes compare, and checks what it can check now (an
// error it raises is every process's, at once).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "../core/linkage.hpp"
#if LOOM_IMPLEMENT
#include <nlohmann/json.hpp>
#endif

#include "../data/data.hpp"
#include "../io/atomic_file.hpp"
#include "../io/file_lock.hpp"
#include "../optim/lr_schedule.hpp"
#include "trainer.hpp"

namespace loom::callbacks {

namespace detail {

inline std::string clock(double seconds) {
  const long s = seconds < 0 ? 0 : static_cast<long>(seconds + 0.5);
  std::ostringstream out;
  out << s / 60 << ':' << std::setw(2) << std::setfill('0') << s % 60;
  return out.str();
}

}  // namespace detail

// Progress: on a terminal, one bar per epoch redrawn in place; otherwise
// (logs, CI) plain lines, about `lines_per_epoch` per epoch. It also warns,
// once a fit, when the training loss grows by orders of magnitude while
// staying finite (a learning rate too high diverges so: no NaN stops it).
class Progress {
 public:
  // automatic: the bar when `out` is std::cout and stdout is a terminal
  // that is not an MPI launcher's (mpirun gives its processes a terminal
  // of its own even when its output goes to a file).
  enum class Style { automatic, bar, lines };

  struct Options {
    std::ostream* out = &std::cout;
    Style style = Style::automatic;
    int lines_per_epoch = 10;
    int bar_width = 24;
    // Warn when a step's loss exceeds this many times the fit's first
    // step's (0: never).
    double divergence_factor = 100.0;
  };

  Progress() : Progress(Options{}) {}
  explicit Progress(Options options)
      : options_(options),
        terminal_(options.style == Style::bar ||
                  (options.style == Style::automatic && options.out == &std::cout &&
                   ::isatty(STDOUT_FILENO) == 1 && !under_mpi_launcher())) {}

  void on_fit_begin(const FitInfo& info);

  void on_step(const StepInfo& step);
  // With the trainer: the divergence warning names its learning rate.
  template <class TrainerT>
  void on_step(const StepInfo& step, TrainerT& trainer) {
    on_step(step);
    watch_divergence(step, trainer.optimizer().options().lr);
  }

  void on_epoch_end(const EpochInfo& epoch);

  // Open MPI's and PMI's launchers (mpirun, srun) tell their processes so.
  static bool under_mpi_launcher() {
    for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
      if (std::getenv(name) != nullptr) return true;
    return false;
  }

 private:
  static double rate(std::size_t samples, double seconds) {
    return seconds > 0 ? static_cast<double>(samples) / seconds : 0.0;
  }

  std::string line(const StepInfo& step, bool bar) const;
  void watch_divergence(const StepInfo& step, float lr);

  Options options_;
  bool terminal_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
  // The fit's first finite step loss, and whether this fit was warned.
  std::optional<double> first_loss_;
  bool warned_ = false;
};

// Evaluate: measures a held-out dataset at the end of every epoch and keeps
// the results (`last`, `history`) for the caller.
class Evaluate {
 public:
  explicit Evaluate(const data::Dataset& dataset, std::ostream* out = &std::cout)
      : dataset_(&dataset), out_(out) {}
  // The callback keeps a pointer: a temporary dataset would be gone by then.
  Evaluate(const data::Dataset&&, std::ostream* = &std::cout) = delete;

  // Every process evaluates (a collective): the same data on each.
  void on_fit_prepare(const FitInfo&, Fingerprint& fingerprint) const {
    fingerprint.add_data("evaluate", *dataset_);
  }

  template <class TrainerT>
  void on_epoch_end(const EpochInfo& epoch, TrainerT& trainer) {
    std::ostringstream when;
    when << "epoch " << epoch.epoch << '/' << epoch.epochs;
    measure(trainer, when.str());
  }
  // With every_steps: also after every every_steps optimizer steps of the
  // fit (counted over its epochs; one that ends an epoch is measured at the
  // epoch's end alone).
  template <class TrainerT>
  void on_step(const StepInfo& step, TrainerT& trainer) {
    const std::size_t fit_step = static_cast<std::size_t>(step.epoch - 1) * step.steps + step.step;
    if (every_steps == 0 || fit_step % every_steps != 0 || step.step == step.steps) return;
    measure(trainer, "step " + std::to_string(fit_step));
  }

  EvalResult last{};
  std::vector<EvalResult> history;
  std::size_t every_steps = 0;
  // Report exp(loss) too: the perplexity of a next-token loss (nats per token).
  bool perplexity = false;

 private:
  template <class TrainerT>
  void measure(TrainerT& trainer, const std::string& when) {
    last = trainer.evaluate(*dataset_);
    history.push_back(last);
    if (out_ == nullptr) return;
    std::ostringstream text;
    text << when << ' ' << dataset_->name << ": loss " << std::fixed << std::setprecision(4)
         << last.loss;
    if (perplexity) text << ", perplexity " << std::setprecision(2) << std::exp(last.loss);
    text << ", accuracy " << std::setprecision(2) << 100.0 * last.accuracy << '%';
    if (last.error_rate) text << ", error rate " << 100.0 * *last.error_rate << '%';
    text << '\n';
    *out_ << text.str();
    out_->flush();
  }

  const data::Dataset* dataset_;
  std::ostream* out_;
};

// MultiStepLR: the learning rate is the trainer's base rate times `factor`
// for each epoch in `milestones` that has ended (PyTorch's MultiStepLR). A
// constant rate leaves the last epochs' test accuracy swinging by about
// 1 %; a late drop settles it. Set before each step from the epoch alone,
// so a resumed fit gets the same rates.
struct MultiStepLR {
  std::vector<int> milestones;
  float factor = 0.1f;
  std::ostream* out = &std::cout;

  float lr_in(int epoch, float base) const {
    float lr = base;
    for (const int m : milestones)
      if (m < epoch) lr *= factor;
    return lr;
  }

  void on_fit_prepare(const FitInfo&, Fingerprint& fingerprint) const {
    fingerprint.add("lr.milestones", milestones).add("lr.milestone_factor", factor);
  }

  template <class TrainerT>
  void on_step_begin(const StepBegin& step, TrainerT& trainer) {
    trainer.optimizer().set_lr(lr_in(step.epoch, trainer.base_lr()));
  }

  template <class TrainerT>
  void on_epoch_end(const EpochInfo& epoch, TrainerT& trainer) {
    if (out == nullptr || epoch.epoch >= epoch.epochs ||
        std::find(milestones.begin(), milestones.end(), epoch.epoch) == milestones.end())
      return;
    std::ostringstream text;
    text << "learning rate " << lr_in(epoch.epoch + 1, trainer.base_lr()) << " from epoch "
         << epoch.epoch + 1 << '\n';
    *out << text.str();
    out->flush();
  }
};

// LrSchedule: before each optimizer step, the learning rate becomes the
// trainer's base rate times schedule(step, total steps) (see
// optim/lr_schedule.hpp). With reference_batch > 0 the base rate is for
// that many samples per step and scales linearly with the global batch
// (the "linear scaling rule"; pair it with a Warmup): the same settings
// then suit 1 device or 64.
template <class Schedule = schedules::Constant>
struct LrSchedule {
  Schedule schedule{};
  std::size_t reference_batch = 0;

  double lr(const StepBegin& step, float base) const {
    double rate = static_cast<double>(base) * schedule(step.fit_step, step.total_steps);
    if (reference_batch > 0)
      rate *= static_cast<double>(step.global_batch) / static_cast<double>(reference_batch);
    return rate;
  }

  // The schedule's type and its factor at five points of the fit: a
  // schedule of other parameters shows in one of them.
  void on_fit_prepare(const FitInfo& info, Fingerprint& fingerprint) const {
    const std::size_t total = info.steps_per_epoch * static_cast<std::size_t>(info.epochs);
    std::vector<double> factors;
    if (total > 0)
      for (const std::size_t at : {std::size_t{0}, total / 4, total / 2, 3 * total / 4, total - 1})
        factors.push_back(schedule(at, total));
    fingerprint.add("lr.schedule", loom::detail::type_label<Schedule>())
        .add("lr.schedule_factors", factors)
        .add("lr.reference_batch", reference_batch);
  }

  template <class TrainerT>
  void on_step_begin(const StepBegin& step, TrainerT& trainer) {
    trainer.optimizer().set_lr(static_cast<float>(lr(step, trainer.base_lr())));
  }
};

// Checkpoint: saves the trainer (Trainer::save) every `every_steps`
// optimizer steps, at the end of every epoch, and when fit() ends, into
// one file that each save replaces atomically.
class Checkpoint {
 public:
  struct Options {
    std::filesystem::path path;
    std::size_t every_steps = 0;  // 0: not by steps
    bool every_epoch = true;
    bool at_end = true;
    std::ostream* out = nullptr;  // a line per save
  };

  // A missing folder is found now, not at the first save hours later.
  explicit Checkpoint(Options options) : options_(std::move(options)) {
    LOOM_CHECK(!options_.path.empty(), "callbacks::Checkpoint: no path given");
    const auto folder = options_.path.parent_path();
    std::error_code error;
    const auto status = std::filesystem::status(folder, error);
    LOOM_CHECK(folder.empty() || std::filesystem::is_directory(status),
               "callbacks::Checkpoint: the folder of '", options_.path.string(), "' ",
               std::filesystem::exists(status) ? "is not a folder" : "does not exist; create it first");
  }

  // Saves are collective: every process saves at the same steps. The
  // process that writes (rank 0) checks now that it can write there, rather
  // than at the first save, an epoch later, and locks the file for as long
  // as this callback lives (io::FileLock on "<path>.lock"): another run
  // saving to the same path is refused at its start, naming this process.
  template <class TrainerT>
  void on_fit_prepare(const FitInfo&, Fingerprint& fingerprint, TrainerT& trainer) {
    fingerprint.add("checkpoint.path", options_.path)
        .add("checkpoint.every_steps", options_.every_steps)
        .add("checkpoint.every_epoch", options_.every_epoch)
        .add("checkpoint.at_end", options_.at_end);
    if (trainer.process_rank() == 0) {
      check_writable();
      if (!lock_.held()) lock_ = io::FileLock::acquire(options_.path, "callbacks::Checkpoint");
    }
  }

  template <class TrainerT>
  void on_step(const StepInfo&, TrainerT& trainer) {
    if (needs_state_at_step(trainer.steps())) save(trainer);
  }
  // The steps it saves after: on a GPU the trainer then waits for the step
  // before it enqueues the next, so the saved state is this step's.
  bool needs_state_at_step(std::uint64_t steps) const {
    return options_.every_steps > 0 && steps % options_.every_steps == 0;
  }
  template <class TrainerT>
  void on_epoch_end(const EpochInfo&, TrainerT& trainer) {
    if (options_.every_epoch) save(trainer);
  }
  template <class TrainerT>
  void on_fit_end(TrainerT& trainer) {
    if (options_.at_end && (saves == 0 || last_step_ != trainer.steps() ||
                            last_ended_ != trainer.position().ended))
      save(trainer);
  }

  std::size_t saves = 0;

 private:
  // A folder in the file's place, or a folder this process cannot create a
  // file in, fails every save: a probe file beside the checkpoint is
  // created and removed (saves write a temporary file there too).
  void check_writable() const;

  template <class TrainerT>
  void save(TrainerT& trainer) {
    const auto began = std::chrono::steady_clock::now();
    trainer.save(options_.path);
    // How long a save takes bounds the grace period a job's stop needs.
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - began;
    ++saves;
    last_step_ = trainer.steps();
    last_ended_ = trainer.position().ended;
    if (options_.out != nullptr) {
      std::ostringstream text;
      text << "checkpoint " << options_.path.string() << " (step " << last_step_ << ") in "
           << std::fixed << std::setprecision(3) << took.count() << " s\n";
      *options_.out << text.str();
      options_.out->flush();
    }
  }

  Options options_;
  io::FileLock lock_;
  std::uint64_t last_step_ = 0;
  bool last_ended_ = false;
};

// Metrics: one JSON object per line, flushed as written (a crash loses at
// most the line in progress): {"kind": "step", ...} after every optimizer
// step and {"kind": "epoch", ...} at every epoch's end, with the test set's
// figures when an Evaluate callback given here ran before it (list it
// first). Across MPI processes give it to one process only.
// scripts/plot_metrics.py draws them.
//
// With `append` (a resumed run) each fit first drops the earlier lines the
// trainer is about to write again: those of steps after the checkpoint it
// resumes, and of an epoch whose end the checkpoint did not reach; the file
// is rewritten atomically. So each step keeps one line. A last line without
// its newline, cut short by a crash, goes too.
class Metrics {
 public:
  struct Options {
    std::filesystem::path path;
    bool append = false;  // a resumed run adds to its earlier lines
    const Evaluate* evaluate = nullptr;
  };

  explicit Metrics(Options options) : options_(std::move(options)) { open(); }

  template <class TrainerT>
  void on_fit_begin(const FitInfo&, TrainerT& trainer) {
    if (options_.append) {
      const auto& at = trainer.position();
      drop_lines_after(trainer.steps(), at.epoch > 0 && !at.ended);
    }
    last_ = std::chrono::steady_clock::now();
  }

  template <class TrainerT>
  void on_step(const StepInfo& step, TrainerT& trainer) {
    write_step(step, trainer.steps(), trainer.optimizer().options().lr,
               trainer.device_step_seconds(),
               trainer.precision() == Precision::fp16 ? std::optional(trainer.loss_scale())
                                                      : std::nullopt);
  }

  template <class TrainerT>
  void on_epoch_end(const EpochInfo& epoch, TrainerT& trainer) {
    write_epoch(epoch, trainer.steps(), trainer.optimizer().options().lr);
  }

 private:
  // The lines, written once for every trainer type. loss_scale: fp16's.
  void write_step(const StepInfo& step, std::uint64_t steps, float lr,
                  const std::vector<double>& device_step_seconds, std::optional<float> loss_scale);

  void write_epoch(const EpochInfo& epoch, std::uint64_t steps, float lr);

  void open();

  void write(const nlohmann::json& line);

  // Drops the lines of steps after `steps`, and the line of the epoch that
  // ended at step `steps` when `epoch_open` (the checkpoint was saved at its
  // last step, before its end: the resumed fit ends it again).
  void drop_lines_after(std::uint64_t steps, bool epoch_open);

  Options options_;
  std::ofstream file_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();  // last line
};

#if LOOM_IMPLEMENT
LOOM_DECL void Metrics::write_step(const StepInfo& step, std::uint64_t steps, float lr,
                                   const std::vector<double>& device_step_seconds,
                                   std::optional<float> loss_scale) {
  const auto now = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  nlohmann::json line{
      {"kind", "step"},
      {"step", steps},
      {"epoch", step.epoch},
      {"epoch_step", step.step},
      {"loss", step.step_loss},
      {"accuracy", step.step_accuracy},
      {"epoch_loss", step.loss},
      {"epoch_accuracy", step.accuracy},
      {"lr", lr},
      {"skipped", step.skipped},
      {"samples_per_second", seconds > 0 ? static_cast<double>(step.step_samples) / seconds : 0.0},
      {"device_step_seconds", device_step_seconds}};
  if (loss_scale) line["loss_scale"] = *loss_scale;
  if (step.error_rate) line["epoch_error_rate"] = *step.error_rate;
  if (!step.nonfinite.empty()) line["nonfinite"] = step.nonfinite;
  write(line);
}

LOOM_DECL void Metrics::write_epoch(const EpochInfo& epoch, std::uint64_t steps, float lr) {
  nlohmann::json line{
      {"kind", "epoch"},
      {"step", steps},
      {"epoch", epoch.epoch},
      {"loss", epoch.loss},
      {"accuracy", epoch.accuracy},
      {"seconds", epoch.seconds},
      {"samples_per_second",
       epoch.seconds > 0 ? static_cast<double>(epoch.samples) / epoch.seconds : 0.0},
      {"lr", lr}};
  if (options_.evaluate != nullptr && !options_.evaluate->history.empty()) {
    line["test_loss"] = options_.evaluate->last.loss;
    line["test_accuracy"] = options_.evaluate->last.accuracy;
    if (const auto rate = options_.evaluate->last.error_rate) line["test_error_rate"] = *rate;
  }
  if (epoch.error_rate) line["error_rate"] = *epoch.error_rate;
  write(line);
  last_ = std::chrono::steady_clock::now();  // the evaluation is not the next step's
}

LOOM_DECL void Metrics::open() {
  file_.open(options_.path, options_.append ? std::ios::app : std::ios::trunc);
  LOOM_CHECK(file_.is_open(), "callbacks::Metrics: cannot open '", options_.path.string(),
             "' for writing: ", std::strerror(errno));
}

LOOM_DECL void Metrics::write(const nlohmann::json& line) {
  file_ << line.dump() << '\n';
  file_.flush();
  LOOM_CHECK(file_.good(), "callbacks::Metrics: writing '", options_.path.string(),
             "' failed (disk full?)");
}

LOOM_DECL void Metrics::drop_lines_after(std::uint64_t steps, bool epoch_open) {
  file_.close();
  const std::string where = options_.path.string();
  std::ifstream in(options_.path, std::ios::binary);
  LOOM_CHECK(in.is_open(), "callbacks::Metrics: cannot read '", where,
             "' to append to it: ", std::strerror(errno));
  std::string kept;
  bool dropped = false;
  std::size_t number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (in.eof()) {  // no newline: the line a crash cut short
      dropped = true;
      break;
    }
    const auto record = nlohmann::json::parse(line, nullptr, false);
    const bool known = record.is_object() && record.contains("kind") &&
                       record["kind"].is_string() && record.contains("step") &&
                       record["step"].is_number_unsigned();
    LOOM_CHECK(known, "callbacks::Metrics: line ", number, " of '", where,
               "' is not a metrics line (a JSON object with a \"kind\" and a \"step\"): '",
               line.substr(0, 80),
               "'; appending needs the earlier lines' steps, so move the "
               "file away or mend the line");
    const auto step = record["step"].get<std::uint64_t>();
    if (step > steps || (step == steps && epoch_open && record["kind"] == "epoch")) {
      dropped = true;
      continue;
    }
    kept += line;
    kept += '\n';
  }
  LOOM_CHECK(!in.bad(), "callbacks::Metrics: reading '", where, "' failed: ", std::strerror(errno));
  in.close();
  if (dropped)
    io::write_file_atomically(options_.path, "metrics file", kept.size(), [&](std::FILE* file) {
      return kept.empty() || std::fwrite(kept.data(), 1, kept.size(), file) == kept.size();
    });
  open();
}

LOOM_DECL void Progress::on_fit_begin(const FitInfo& info) {
  first_loss_.reset();
  warned_ = false;
  *options_.out << "training: " << info.samples_per_epoch << " samples, " << info.epochs
                << " epoch(s) of " << info.steps_per_epoch << " steps, batch " << info.batch_size
                << '\n';
  if (info.placement.size() > 1)
    *options_.out << "placement (" << info.policy << "):\n" << describe_placement(info.placement);
  options_.out->flush();
}

LOOM_DECL void Progress::on_step(const StepInfo& step) {
  const auto now = std::chrono::steady_clock::now();
  const std::size_t every = std::max<std::size_t>(
      1, step.steps / static_cast<std::size_t>(std::max(1, options_.lines_per_epoch)));
  const bool last = step.step == step.steps;
  // A step skipped as non-finite (NonFinite::skip) gets a line of its own, always.
  if (!step.nonfinite.empty()) {
    *options_.out << (terminal_ ? "\r\x1b[K" : "") << "skipped: " << step.nonfinite << '\n';
    options_.out->flush();
  }
  if (terminal_) {
    // Redraws cost a terminal write; ten a second reads as smooth.
    if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    *options_.out << '\r' << line(step, true) << "\x1b[K";
    if (last) *options_.out << '\n';
    options_.out->flush();
  } else if (step.step % every == 0 || last) {
    *options_.out << line(step, false) << '\n';
    options_.out->flush();
  }
}

LOOM_DECL void Progress::watch_divergence(const StepInfo& step, float lr) {
  if (step.skipped || !std::isfinite(step.step_loss) || options_.divergence_factor <= 0) return;
  if (!first_loss_) {
    first_loss_ = step.step_loss;
    return;
  }
  if (warned_ || !(step.step_loss > options_.divergence_factor * std::max(*first_loss_, 1e-6)))
    return;
  warned_ = true;
  std::ostringstream text;
  text << (terminal_ ? "\r\x1b[K" : "") << "warning: the training loss grew from "
       << std::setprecision(4) << *first_loss_ << " (this fit's first step) to " << step.step_loss
       << " (epoch " << step.epoch << ", step " << step.step
       << ") while staying finite: training is diverging. Lower the learning rate (now " << lr
       << ")\n";
  *options_.out << text.str();
  options_.out->flush();
}

LOOM_DECL void Progress::on_epoch_end(const EpochInfo& epoch) {
  // Formatted apart, so the caller's stream keeps its own precision flags.
  std::ostringstream text;
  text << "epoch " << epoch.epoch << '/' << epoch.epochs << " done: loss " << std::fixed
       << std::setprecision(4) << epoch.loss << ", accuracy " << std::setprecision(2)
       << 100.0 * epoch.accuracy << "%, ";
  if (epoch.error_rate) text << "error rate " << 100.0 * *epoch.error_rate << "%, ";
  text << std::setprecision(0)
       << rate(epoch.samples, epoch.seconds) << " samples/s, " << std::setprecision(1)
       << epoch.seconds << " s\n";
  *options_.out << text.str();
  options_.out->flush();
}

LOOM_DECL std::string Progress::line(const StepInfo& step, bool bar) const {
  std::ostringstream out;
  out << "epoch " << step.epoch << '/' << step.epochs << ' ';
  if (bar) {
    const auto filled =
        static_cast<int>(options_.bar_width * step.step / std::max<std::size_t>(1, step.steps));
    out << '[' << std::string(static_cast<std::size_t>(filled), '=')
        << std::string(static_cast<std::size_t>(options_.bar_width - filled), ' ') << "] ";
  }
  const double per_step = step.step ? step.seconds / static_cast<double>(step.step) : 0.0;
  const double eta = per_step * static_cast<double>(step.steps - step.step);
  out << "step " << step.step << '/' << step.steps << " loss " << std::fixed << std::setprecision(4)
      << step.loss << " acc " << std::setprecision(2) << 100.0 * step.accuracy << "% ";
  if (step.error_rate) out << "err " << 100.0 * *step.error_rate << "% ";
  out << std::setprecision(0) << rate(step.samples, step.seconds) << " samples/s ETA "
      << detail::clock(eta);
  return out.str();
}

LOOM_DECL void Checkpoint::check_writable() const {
  const std::string where = options_.path.string();
  std::error_code error;
  LOOM_CHECK(!std::filesystem::is_directory(options_.path, error), "callbacks::Checkpoint: '",
             where, "' is a folder; give the checkpoint's file name (e.g. ",
             (options_.path / "checkpoint.safetensors").string(), ")");
  // Named as a save's own temporary file: what one can create, so can a save.
  const std::filesystem::path probe = options_.path.string() + ".tmp-" + std::to_string(::getpid());
  std::FILE* file = std::fopen(probe.c_str(), "wx");
  LOOM_CHECK(file != nullptr, "callbacks::Checkpoint: cannot create a file in the folder of '",
             where, "' (", std::strerror(errno),
             "); every save would fail: choose a "
             "writable place");
  std::fclose(file);
  std::filesystem::remove(probe, error);
}

#endif  // LOOM_IMPLEMENT

}  // namespace loom::callbacks
