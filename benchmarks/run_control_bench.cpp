// What stopping on a signal and reporting a late rank cost, across the
// processes of mpirun (or in one process), JSON lines from rank 0:
//   stop_agreement       a DataParallel LeNet step with callbacks::StopOnSignal
//                        (one small collective per step, to agree on a signal)
//                        against the same step without it, alternated by round
//   stop_latency         SIGUSR1 raised on one rank during a step, to the
//                        fit's return on every rank (the step, the agreement,
//                        the checkpoint's save): the slowest rank's time,
//                        against the grace periods a job gets (mpirun 1 s,
//                        Slurm and Kubernetes 30 s)
//   collective_overhead  MpiComm::all_reduce (its polling wait, which also
//                        answers the side channel's questions) against
//                        MPI_Allreduce, for 1 and LeNet's last layer's 5010 floats
//
//   mpirun -np 2 build/benchmarks/run_control_bench [--steps N] [--rounds R]
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "lenet_bench.hpp"

using namespace loom;

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// The time of each optimizer step but the first (which plans memory).
struct StepTimes {
  std::vector<double>* ms;
  Clock::time_point last{};
  void on_fit_begin(const FitInfo&) { last = Clock::now(); }
  void on_step(const StepInfo& step) {
    if (step.step > 1) ms->push_back(ms_since(last));
    last = Clock::now();
  }
};

// Raises `signal` on rank `rank` after optimizer step `at`, and notes when.
struct RaiseAt {
  std::uint64_t at;
  int rank;
  Clock::time_point* raised;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() != at) return;
    *raised = Clock::now();
    if (static_cast<int>(trainer.process_rank()) == rank) ::raise(SIGUSR1);
  }
};

nlohmann::json stop_agreement(dist::Environment& mpi, const data::Dataset& train,
                              std::size_t batch, int steps, int rounds) {
  const auto part = data::head(train, batch * static_cast<std::size_t>(steps + 1));
  std::vector<double> with, without;
  const FitOptions fit{.epochs = 1, .batch_size = batch};
  for (int round = 0; round < rounds; ++round) {
    for (const bool stopping : {false, true}) {
      Trainer<bench::LeNet, DataParallel<>> trainer(mpi.devices(), {.lr = 0.01f, .momentum = 0.9f},
                                                    {}, comm::Comm(mpi.world()));
      std::vector<double> ms;
      if (stopping) {
        callbacks::StopOnSignal stop;
        trainer.fit(part, fit, StepTimes{&ms}, stop);
      } else {
        trainer.fit(part, fit, StepTimes{&ms});
      }
      (stopping ? with : without).push_back(median(ms));
    }
  }
  return {{"benchmark", "stop_agreement"}, {"network", "lenet"},
          {"processes", mpi.size()},       {"batch", batch},
          {"steps", steps},                {"rounds", rounds},
          {"step_ms_without", median(without)},
          {"step_ms_with", median(with)},
          {"with_over_without", median(with) / median(without)}};
}

nlohmann::json stop_latency(dist::Environment& mpi, const data::Dataset& train, std::size_t batch,
                            int rounds) {
  // Rank 0 saves (and locks) the checkpoint, and every rank must name the
  // same path: the folder is named by rank 0's process id.
  long pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  const auto folder =
      std::filesystem::temp_directory_path() / ("loom-bench-stop-" + std::to_string(pid));
  std::filesystem::create_directories(folder);
  const int rank = mpi.size() - 1;  // the last rank alone gets the signal
  std::vector<double> latencies;
  double save_ms = 0;
  for (int round = 0; round < rounds; ++round) {
    Trainer<bench::LeNet, DataParallel<>> trainer(mpi.devices(), {.lr = 0.01f, .momentum = 0.9f},
                                                  {}, comm::Comm(mpi.world()));
    callbacks::StopOnSignal stop;
    callbacks::Checkpoint checkpoint({.path = folder / "stopped.safetensors"});
    Clock::time_point raised{};
    trainer.fit(data::head(train, batch * 20), {.epochs = 1, .batch_size = batch},
                RaiseAt{5, rank, &raised}, stop, checkpoint);
    LOOM_CHECK(stop.stopped_by() == SIGUSR1 && trainer.steps() == 5,
               "stop_latency: the fit did not stop after step 5 (it ran ", trainer.steps(),
               " steps)");
    double mine = ms_since(raised), slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    latencies.push_back(slowest);
    const auto began = Clock::now();
    trainer.save((folder / "timed.safetensors").string());  // collective: rank 0 writes
    save_ms = ms_since(began);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (mpi.rank() == 0) std::filesystem::remove_all(folder);
  return {{"benchmark", "stop_latency"}, {"network", "lenet"},     {"processes", mpi.size()},
          {"batch", batch},              {"rounds", rounds},        {"signal", "SIGUSR1"},
          {"signalled_rank", rank},      {"stop_ms", median(latencies)},
          {"save_ms", save_ms},          {"mpirun_grace_ms", 1000.0},
          {"stop_over_mpirun_grace", median(latencies) / 1000.0}};
}

nlohmann::json collective_overhead(dist::Environment& mpi, std::size_t count, int calls) {
  comm::MpiComm world = mpi.world();
  std::vector<float> values(count, 1.0f);
  std::vector<double> loom_us, mpi_us;
  for (int round = 0; round < 5; ++round) {
    auto start = Clock::now();
    for (int k = 0; k < calls; ++k) world.all_reduce(std::span<float>(values), comm::ReduceOp::sum);
    loom_us.push_back(1000.0 * ms_since(start) / calls);
    start = Clock::now();
    for (int k = 0; k < calls; ++k)
      MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    mpi_us.push_back(1000.0 * ms_since(start) / calls);
  }
  return {{"benchmark", "collective_overhead"}, {"processes", mpi.size()},
          {"floats", count},                     {"calls", calls},
          {"loom_us", median(loom_us)},          {"mpi_us", median(mpi_us)},
          {"loom_over_mpi", median(loom_us) / median(mpi_us)}};
}

}  // namespace

int main(int argc, char** argv) {
  dist::Environment mpi(argc, argv);
  CLI::App app{"What stopping on a signal and reporting a late rank cost (JSON lines)"};
  std::size_t batch = 64;
  int steps = 40, rounds = 3, calls = 2000;
  std::string data_dir = data::default_fashion_mnist_dir;
  app.add_option("--batch", batch, "global batch")->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--steps", steps, "timed steps per fit")->check(CLI::Range(2, 900))->capture_default_str();
  app.add_option("--rounds", rounds, "fits with and without, alternated")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--calls", calls, "all-reduces per round")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--data", data_dir, "Fashion-MNIST folder")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::ostream quiet(nullptr);
  std::ostream& out = mpi.rank() == 0 ? std::cout : quiet;
  try {
    const auto train = data::fashion_mnist(data_dir).train;
    out << stop_agreement(mpi, train, batch, steps, rounds).dump() << std::endl;
    out << stop_latency(mpi, train, batch, rounds).dump() << std::endl;
    for (const std::size_t count : {std::size_t{1}, std::size_t{5010}})
      out << collective_overhead(mpi, count, calls).dump() << std::endl;
  } catch (const Error& error) {
    std::cerr << error.what() << '\n';
    if (mpi.size() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  return 0;
}
