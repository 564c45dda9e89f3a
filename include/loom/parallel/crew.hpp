// Crew<Job>: one worker thread per rank of a parallel policy, each running
// the same job on its own rank; run() hands every worker the job and waits
// for all. DataParallel's replicas and ModelSplit's stages are crews.
//
// A worker that fails calls on_error (which cancels its communicator, so
// the other ranks' pending calls raise instead of waiting for it); run()
// then raises the first rank's own error, not the "aborted the group"
// echoes of the others, and refuses every later job: the ranks are no
// longer in step.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <span>
#include <vector>

#include "../core/targets.hpp"
#include "../backend/cpu/threads.hpp"
#include "../core/error.hpp"
#include "../core/precision.hpp"
#include "../core/stop_signals.hpp"

namespace loom::data {
struct Dataset;
}

namespace loom {

// How an optimizer step trains, besides its data (the trainer's settings
// for this step).
struct StepSettings {
  float lr = 0.0f;
  float max_grad_norm = 0.0f;  // clip the gradients to this global norm (0: never)
  Precision precision = Precision::fp32;
  float loss_scale = 1.0f;  // fp16: the loss gradient's scale, divided out before the update
  // fp16 at LossScaling::min_scale: an overflow is a non-finite step, whose
  // first non-finite gradient the ranks find and agree on.
  bool at_min_scale = false;
};

}  // namespace loom

namespace loom::detail {

// The job a policy engine hands its crew: its kind (the engine's own enum)
// and what a training step, an evaluation or a weight copy needs.
template <class Kind>
struct EngineJob {
  Kind kind{};
  const float* images = nullptr;
  const std::int32_t* labels = nullptr;  // targets.labels (the GPU pipeline reads these)
  Targets targets{};                     // the batch's, from its first sample
  std::size_t n = 0;              // samples of the batch (evaluation: per piece)
  std::size_t group_samples = 0;  // samples of the optimizer step
  bool accumulate = false;        // add to the step's earlier gradients
  bool last = true;               // the step's last batch: reduce and update
  StepSettings settings{};  // training steps
  Precision precision = Precision::fp32;  // evaluations
  Pass pass{};  // training: seed and step (each rank adds its samples' offset)
  const data::Dataset* dataset = nullptr;
  float* whole = nullptr;  // the whole network's weights (gather, scatter)
  double value = 0.0;      // summed over the ranks (agreement across processes)
  // Gathered over the ranks instead, when given: every rank's row into
  // `rows` (the first local rank's result).
  std::span<const double> row{};
  std::vector<double>* rows = nullptr;
};

template <class Job>
class Crew {
 public:
  using Body = std::function<void(std::size_t worker, const Job& job)>;
  using OnError = std::function<void(std::size_t worker, const std::string& why)>;

  Crew(const char* owner, int threads) : owner_(owner), threads_(threads) {}
  Crew(const Crew&) = delete;
  Crew& operator=(const Crew&) = delete;
  ~Crew() { stop(); }

  // Starts `workers` threads running body for each job.
  void start(std::size_t workers, Body body, OnError on_error) {
    body_ = std::move(body);
    on_error_ = std::move(on_error);
    for (std::size_t i = 0; i < workers; ++i) threads_list_.push_back(
        detail::start_quiet_thread("loom-worker", [this, i] { work(i); }));
  }

  // The only rank of its group (a grid of one): no other rank can be left
  // apart from it, so it may go on after a job that failed.
  void set_alone() { alone_ = true; }

  // Ends the threads (after their current job). Idempotent.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_list_)
      if (t.joinable()) t.join();
    threads_list_.clear();
  }

  void run(const Job& job) {
    LOOM_CHECK(!failed_, owner_,
               ": an earlier step failed and left the ranks apart; make a new Trainer");
    cpu::set_threads(threads_);
    std::unique_lock lock(mutex_);
    job_ = job;
    running_ = threads_list_.size();
    errors_.clear();
    ++job_id_;
    wake_.notify_all();
    finished_.wait(lock, [&] { return running_ == 0; });
    if (errors_.empty()) return;
    failed_ = !alone_;
    std::exception_ptr first = errors_.front();
    for (const auto& error : errors_) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        if (std::string_view(e.what()).find("aborted the group") == std::string_view::npos) {
          first = error;
          break;
        }
      } catch (...) {
      }
    }
    std::rethrow_exception(first);
  }

 private:
  void work(std::size_t worker) {
    std::uint64_t seen = 0;
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || job_id_ != seen; });
        if (stop_) return;
        seen = job_id_;
        job = job_;
      }
      try {
        body_(worker, job);
      } catch (const std::exception& error) {
        on_error_(worker, error.what());
        record(std::current_exception());
      } catch (...) {
        on_error_(worker, "unknown error");
        record(std::current_exception());
      }
      {
        std::lock_guard lock(mutex_);
        if (--running_ == 0) finished_.notify_all();
      }
    }
  }

  void record(std::exception_ptr error) {
    std::lock_guard lock(mutex_);
    errors_.push_back(std::move(error));
  }

  const char* owner_;
  int threads_;
  Body body_;
  OnError on_error_;
  std::vector<std::thread> threads_list_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  Job job_{};
  std::uint64_t job_id_ = 0;
  std::size_t running_ = 0;
  bool stop_ = false;
  bool failed_ = false;
  bool alone_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace loom::detail
