// DataParallel<BucketBytes>: one replica of the network per device, each
// global batch split over them, the gradients summed so every replica takes
// the same optimizer step. Written against comm::Comm: the replicas are
// worker threads of one process (devices::cpu(n), LocalComm) or one per MPI
// process (MpiComm, see comm/mpi.hpp).
//
// Exactness: a rank holding n_r of a global batch of N samples scales its
// loss gradient by 1/N (not 1/n_r), so the summed gradient is the global
// mean whatever the split, and a rank with no samples adds zeros. Initial
// weights are broadcast from rank 0.
//
// Overlap: backward reports each layer as it finishes; a gradient bucket
// (BucketPlan: compile-time slices of the flat gradient buffer in reverse
// layer order) goes to the replica's communication thread as soon as its
// lowest layer is done, so its all-reduce runs while the layers before it
// are still back-propagating.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../backend/cpu/threads.hpp"
#include "../comm/communicator.hpp"
#include "../comm/local_comm.hpp"
#include "../core/device.hpp"
#include "../core/error.hpp"
#include "../data/dataset.hpp"
#include "../loss/softmax_cross_entropy.hpp"
#include "../net/model.hpp"
#include "../optim/clip.hpp"
#include "../optim/loss_scaler.hpp"
#include "buckets.hpp"
#include "crew.hpp"
#include "reducer.hpp"
#include "single_device.hpp"
#include "step_protocol.hpp"

namespace loom {

// 64 KiB, measured (benchmarks/data_parallel_bench, LeNet, batch 256, 2
// workers; benchmarks/RESULTS.md): LeNet's gradients go in three buckets
// (both Linears, conv2, conv1) and 96-97 % of the all-reduce time is hidden
// under backward, against 84-91 % with 1 MiB (two buckets: conv2 waits for
// the end) and 0 % with 4 MiB (one bucket), at the same step time.
inline constexpr std::size_t default_bucket_bytes = std::size_t{64} << 10;

template <std::size_t BucketBytes = default_bucket_bytes>
struct DataParallel {
  static constexpr std::size_t devices_needed = 0;  // any number, at least one
  static constexpr const char* name = "DataParallel";
  static constexpr std::size_t bucket_bytes = BucketBytes;
};

template <class Policy>
inline constexpr bool is_data_parallel = false;
template <std::size_t B>
inline constexpr bool is_data_parallel<DataParallel<B>> = true;

// The samples of a global batch of n that rank r of `ranks` takes:
// contiguous, and the first n % ranks ranks take one more than the others.
struct BatchShare {
  std::size_t first = 0;
  std::size_t count = 0;
};
constexpr BatchShare batch_share(std::size_t n, std::size_t ranks, std::size_t rank) {
  const std::size_t base = n / ranks, extra = n % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

// When one replica's backward ran in a step, and each bucket's all-reduce
// (from the call, so a wait for slower ranks counts in it).
struct StepTimeline {
  using Clock = std::chrono::steady_clock;
  Clock::time_point backward_begin, backward_end;
  std::vector<Clock::time_point> reduce_begin, reduce_end;  // per bucket, in plan order
};

namespace detail {

// Every rank of `c` checks that all run the same network, policy and
// optimizer types (a hash of their names), before any other collective:
// ranks built from different programs get this error, not a hang.
// `policy`: its type's label and what it fixes at run time (the replicas).
template <class Net, class Optimizer>
void check_same_program(comm::Comm& c, const std::string& policy) {
  const std::string identity = "network " + type_label<Net>() + ", policy " + policy +
                               ", optimizer " + type_label<Optimizer>();
  const auto ranks = static_cast<std::size_t>(c.size());
  std::vector<std::uint64_t> hashes(ranks, 0);
  const std::uint64_t mine = fnv1a(identity, Net::parameter_count);
  hashes[static_cast<std::size_t>(c.rank())] = mine;
  c.all_reduce(std::span<std::uint64_t>(hashes), comm::ReduceOp::sum);
  for (std::size_t r = 0; r < ranks; ++r)
    LOOM_CHECK(hashes[r] == mine, "rank ", r, " of ", ranks,
               " trains a different network, policy or optimizer than rank ", c.rank(),
               " (identity hash ", hashes[r], " vs ", mine, "); rank ", c.rank(), " runs ",
               identity, ". Start every rank from the same program");
}
template <class Net, class Policy, class Optimizer>
void check_same_program(comm::Comm& c) {
  check_same_program<Net, Optimizer>(c, type_label<Policy>());
}

// A step's (loss sum, correct count) as the engines keep them, for the caller.
template <std::size_t N>
cpu::LossSums loss_sums(const std::array<double, N>& stats) {
  return {stats[0], static_cast<std::size_t>(stats[1])};
}

template <class Net, class Policy, class Optimizer>
class DataParallelEngine {
 public:
  using Plan = BucketPlan<Net, Policy::bucket_bytes, float>;
  using OptimizerState = typename Optimizer::template State<float>;
  static constexpr std::size_t classes = Net::output_shape::size;
  static constexpr std::size_t sample_size = Net::input_shape::size;

  // One replica per device, ranks of a LocalComm; or, with `processes` (an
  // MPI world), one device here and the replicas are the processes.
  DataParallelEngine(const std::vector<Device>& devices, comm::Comm processes, std::uint64_t seed,
                     typename Optimizer::Options options)
      : crew_(Policy::name, devices.front().threads) {
    std::vector<comm::Comm> comms;
    if (processes) {
      LOOM_CHECK(devices.size() == 1, Policy::name, " over ", processes.size(),
                 " processes takes one device per process, but this one was given ",
                 devices.size(), "; pass dist::Environment::devices()");
      comms.push_back(processes);
    } else {
      for (auto& local : comm::LocalComm::create(static_cast<int>(devices.size())))
        comms.emplace_back(std::move(local));
    }
    for (auto& c : comms)
      replicas_.push_back(std::make_unique<Replica>(seed, options, std::move(c)));
    crew_.start(
        replicas_.size(), [this](std::size_t i, const Job& job) { work(*replicas_[i], job); },
        [this](std::size_t i, const std::string& why) {
          replicas_[i]->comm.cancel(why);
          // Made by the start job: read only once every rank has made it.
          if (started_) replicas_[i]->statistics.comm.cancel(why);
        });
    // Every rank checks it runs the same program, then takes rank 0's weights.
    try {
      run({.kind = JobKind::start});
      started_ = Net::syncs;
    } catch (...) {
      shutdown();  // no destructor runs for a constructor that throws
      throw;
    }
  }

  DataParallelEngine(const DataParallelEngine&) = delete;
  DataParallelEngine& operator=(const DataParallelEngine&) = delete;
  ~DataParallelEngine() { shutdown(); }

  int world() const { return replicas_.front()->comm.size(); }
  std::size_t local_replicas() const { return replicas_.size(); }
  Model<Net, float>& model() { return replicas_.front()->model; }
  // Every replica runs in this process (no other process shares the group).
  bool all_local() const { return world() == static_cast<int>(replicas_.size()); }
  // Weights or running statistics were changed through model() (replica
  // 0's): every replica takes them, as at the start.
  void share_first_replica() { run({.kind = JobKind::share}); }
  const Model<Net, float>& model() const { return replicas_.front()->model; }
  Model<Net, float>& replica_model(std::size_t i) { return replicas_.at(i)->model; }
  OptimizerState& replica_optimizer(std::size_t i) { return replicas_.at(i)->optimizer; }
  // Each local replica's time in the last optimizer step (its batches'
  // forward, backward, reduction and update).
  std::vector<double> step_seconds() const {
    std::vector<double> seconds;
    for (const auto& r : replicas_) seconds.push_back(r->step_seconds);
    return seconds;
  }
  // When the last step's backward and reductions ran on local replica i.
  const StepTimeline& last_timeline(std::size_t i = 0) const { return replicas_.at(i)->timeline; }

  // Sizes each replica for its share of global batches of up to `batch`.
  void reserve(std::size_t batch) {
    const std::size_t most = batch_share(batch, static_cast<std::size_t>(world()), 0).count;
    for (auto& r : replicas_) r->model.reserve(std::max<std::size_t>(most, 1));
  }

  // One micro-batch of an optimizer step. group_samples: the samples of all
  // the step's micro-batches (the loss is their mean); accumulate: add to
  // the gradients of earlier micro-batches; last: reduce and update.
  // Returns the step's global loss and correct-count sums when `last`;
  // a non-finite loss skips the update on every rank (checked by the caller).
  // A step whose scaled gradients overflowed is skipped on every rank
  // (LossSums::overflowed).
  cpu::LossSums micro_step(const float* images, const std::int32_t* labels, std::size_t n,
                           std::size_t group_samples, bool accumulate, bool last,
                           const StepSettings& settings, const Pass& pass = {.training = true}) {
    // A replica without a sample would miss the statistics' collectives.
    if constexpr (Net::syncs)
      LOOM_CHECK(n >= static_cast<std::size_t>(world()), Policy::name, ": a batch of ", n,
                 " sample(s) over ", world(), " replicas leaves a replica without one, and "
                 "SyncBatchNorm needs every replica's statistics; use batches of at least ",
                 world(), " (the last batch of an epoch included)");
    run({.kind = JobKind::train,
         .images = images,
         .labels = labels,
         .n = n,
         .group_samples = group_samples,
         .accumulate = accumulate,
         .last = last,
         .settings = settings,
         .pass = pass});
    auto sums = loss_sums(replicas_.front()->stats);
    sums.overflowed = replicas_.front()->overflowed;
    return sums;
  }

  // After a step whose loss or gradients went non-finite (and which every
  // rank skipped): where it happened first, over every replica.
  const NonFiniteSpot& fault() const { return replicas_.front()->fault; }

  // The sum of `value` over the ranks, one per process (a collective: a
  // checkpoint that one process could not write or read stops them all).
  double sum_over_ranks(double value) {
    run({.kind = JobKind::agree, .value = value});
    return replicas_.front()->stats[0];
  }

  // Every rank's `row` (all of one size), rank r's as row r (a collective:
  // the trainer's agreement before a fit or a load).
  std::vector<double> gather_rows(std::span<const double> row) {
    std::vector<double> rows;
    run({.kind = JobKind::agree, .row = row, .rows = &rows});
    return rows;
  }

  // Loss and correct-count sums over a data set, each rank taking its share.
  cpu::LossSums evaluate(const data::Dataset& dataset, std::size_t batch,
                         Precision precision = Precision::fp32) {
    run({.kind = JobKind::evaluate, .n = batch, .precision = precision, .dataset = &dataset});
    return loss_sums(replicas_.front()->stats);
  }

 private:
  enum class JobKind { start, train, evaluate, agree, share };
  using Job = EngineJob<JobKind>;

  struct Replica {
    Replica(std::uint64_t seed, typename Optimizer::Options options, comm::Comm c)
        : model(seed), optimizer(options, Net::parameter_count), comm(c), reducer(c, Plan::count) {
      timeline.reduce_begin.resize(Plan::count);
      timeline.reduce_end.resize(Plan::count);
    }

    // SyncBatchNorm's sums, on a communicator of their own: the reducer's
    // thread all-reduces gradient buckets on `comm` meanwhile.
    struct StatisticsSum final : ReplicaSum {
      comm::Comm comm;
      void sum(std::span<double> values) override { comm.all_reduce(values, comm::ReduceOp::sum); }
    };

    Model<Net, float> model;
    OptimizerState optimizer;
    comm::Comm comm;
    StatisticsSum statistics;  // made at start when the network syncs statistics
    std::array<double, 2> stats{};  // loss sum, correct count (this step, then global)
    StepTimeline timeline;
    double step_seconds = 0.0;  // the last optimizer step's jobs, end to end
    bool overflowed = false;    // the last step's scaled gradients were not finite
    NonFiniteSpot fault;        // the step's first non-finite value (agreed by the ranks)
    Reducer reducer;  // the replica's communication thread
  };

  // The workers stop before the replicas (and their reducers) go.
  void shutdown() { crew_.stop(); }

  void run(const Job& job) { crew_.run(job); }

  void work(Replica& replica, const Job& job) {
    if (job.kind == JobKind::start) {
      start(replica);
    } else if (job.kind == JobKind::train) {
      const auto began = std::chrono::steady_clock::now();
      if (!job.accumulate) replica.step_seconds = 0.0;
      train(replica, job);
      replica.step_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    } else if (job.kind == JobKind::agree && job.rows != nullptr) {
      auto all = comm::gather_rows(replica.comm, job.row);
      if (&replica == replicas_.front().get()) *job.rows = std::move(all);
    } else if (job.kind == JobKind::agree) {
      replica.stats = {job.value, 0.0};
      replica.comm.all_reduce(std::span<double>(replica.stats), comm::ReduceOp::sum);
    } else if (job.kind == JobKind::share) {
      replica.comm.broadcast(replica.model.parameters(), 0);
      share_state(replica);
    } else {
      evaluate(replica, job);
    }
  }

  void start(Replica& replica) {
    check_same_program<Net, Policy, Optimizer>(replica.comm);
    replica.comm.broadcast(replica.model.parameters(), 0);
    if constexpr (Net::syncs) replica.statistics.comm = replica.comm.split(0, replica.comm.rank());
  }

  // Running statistics (BatchNorm) are replica 0's, as PyTorch's
  // DistributedDataParallel broadcasts its buffers: every replica
  // normalises its share with its own batch statistics, and evaluates with
  // the same running statistics.
  static void share_state(Replica& replica) {
    if constexpr (Net::state_count > 0) replica.comm.broadcast(replica.model.state(), 0);
  }

  void train(Replica& replica, const Job& job) {
    const auto ranks = static_cast<std::size_t>(replica.comm.size());
    const auto share = batch_share(job.n, ranks, static_cast<std::size_t>(replica.comm.rank()));
    if (!job.accumulate) {
      replica.stats = {};
      replica.overflowed = false;
      replica.fault = {};
    }
    auto& model = replica.model;
    model.set_precision(job.settings.precision);
    std::size_t next_bucket = 0;
    const auto post_ready = [&](std::size_t layer) {
      // Stamped before the last buckets are posted: once posted, the
      // communication thread may take this thread's core.
      if (layer == 0) replica.timeline.backward_end = StepTimeline::Clock::now();
      while (next_bucket < Plan::count && Plan::buckets[next_bucket].ready_after == layer)
        post_bucket(replica, next_bucket++);
    };
    share_state(replica);
    if (!job.accumulate) model.keep_state();
    if (share.count > 0) {
      Pass pass = job.pass;
      pass.first_sample = share.first;
      if constexpr (Net::syncs) pass.replicas = &replica.statistics;
      const float* logits =
          model.forward(job.images + share.first * sample_size, share.count, 0, pass);
      const auto sums = SoftmaxCrossEntropy::evaluate<float>(
          logits, job.labels + share.first, share.count, classes, job.group_samples,
          model.output_gradient(), job.settings.loss_scale);
      replica.stats[0] += sums.loss;
      replica.stats[1] += static_cast<double>(sums.correct);
      // Looked for now, while this batch's outputs are alive.
      if (!std::isfinite(sums.loss) && !replica.fault)
        replica.fault = model.find_nonfinite_output(0);
      replica.timeline.backward_begin = StepTimeline::Clock::now();
      // SyncBatchNorm's backward calls collectives of its own: the buckets
      // then wait for the backward's end, so that no two threads of a rank
      // are in MPI at once (MPI_THREAD_SERIALIZED).
      if (job.last && !Net::syncs) {
        model.backward(job.accumulate, post_ready);
      } else {
        model.backward(job.accumulate);
        replica.timeline.backward_end = StepTimeline::Clock::now();
      }
    } else if (!job.accumulate) {
      std::fill(model.gradients().begin(), model.gradients().end(), 0.0f);
    }
    if (!job.last) return;
    while (next_bucket < Plan::count) post_bucket(replica, next_bucket++);
    replica.reducer.post(std::span<double>(replica.stats));
    replica.reducer.drain();
    replica.timeline.reduce_begin = replica.reducer.begun();
    replica.timeline.reduce_end = replica.reducer.ended();
    // Every rank holds the same global sums and reduced gradients, so all
    // skip or all update; a skipped step keeps the running statistics of
    // the step before, too.
    ModelExecutor<Net, OptimizerState> executor{.model = model,
                                                 .optimizer = replica.optimizer,
                                                 .spot = replica.fault,
                                                 .loss = replica.stats[0],
                                                 .has_outputs = share.count > 0,
                                                 .replicas = &replica.comm};
    replica.overflowed = step_protocol(executor, job.settings) == StepEnd::overflowed;
  }

  void evaluate(Replica& replica, const Job& job) {
    share_state(replica);
    replica.model.set_precision(job.precision);
    const auto& data = *job.dataset;
    const auto share = batch_share(data.count, static_cast<std::size_t>(replica.comm.size()),
                                   static_cast<std::size_t>(replica.comm.rank()));
    const auto mine = evaluate_samples(replica.model, data, share.first, share.count, job.n);
    std::array<double, 2> sums{mine.loss, static_cast<double>(mine.correct)};
    replica.comm.all_reduce(std::span<double>(sums), comm::ReduceOp::sum);
    replica.stats = sums;
  }

  static void post_bucket(Replica& replica, std::size_t b) {
    const auto& bucket = Plan::buckets[b];
    replica.reducer.post(replica.model.gradients().subspan(bucket.begin, bucket.size()), b);
  }

  std::vector<std::unique_ptr<Replica>> replicas_;
  std::atomic<bool> started_ = false;  // every replica's statistics communicator exists
  Crew<Job> crew_;  // after replicas_: its threads stop before the replicas go
};

}  // namespace detail
}  // namespace loom
