// A rank lost in the middle of training, for rank_fault.cmake: started by
// mpiexec -np 2, rank 1 ends itself with SIGKILL ("kill") or freezes with
// SIGSTOP ("stop") as its step 4 begins, and rank 0, waiting for it in the
// step's gradient all-reduce, must raise a loom::Error within the collective
// timeout instead of waiting for ever.
//
// Usage: rank_fault kill|stop TIMEOUT_SECONDS REPORT_FILE
// Rank 0 writes REPORT_FILE: "raised after S s" and the error's message, or
// "finished" when training ended without an error. mpirun's exit status
// says little here (with --enable-recovery it is 0 whatever the ranks did),
// so the script reads the report.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <loom/loom.hpp>
#include <string>

#include "fashion_test.hpp"
#include "policy_test.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// Rank 1's fault as its step 4 begins; every rank notes when a step ended.
struct Fault {
  int rank;
  int signal;
  clock_type::time_point* last_step_end;
  void on_step_begin(const loom::StepBegin& step) const {
    if (rank == 1 && step.step == 4) raise(signal);
  }
  void on_step(const loom::StepInfo&) const { *last_step_end = clock_type::now(); }
};

}  // namespace

int main(int argc, char** argv) {
  using namespace loom;
  dist::Environment env(argc, argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: rank_fault kill|stop TIMEOUT_SECONDS REPORT_FILE\n");
    return 2;
  }
  const std::string fault = argv[1];
  env.set_collective_timeout(comm::Timeout(std::stod(argv[2])));
  std::ofstream report;
  if (env.rank() == 0) report.open(argv[3]);

  Trainer<test::Logistic, DataParallel<>> trainer(env.devices(), test::sgd, {.seed = 7},
                                                  comm::Comm(env.world()));
  auto last_step_end = clock_type::now();
  try {
    trainer.fit(test::head(test::fashion().train, 600), {.epochs = 1, .batch_size = 60},
                Fault{env.rank(), fault == "kill" ? SIGKILL : SIGSTOP, &last_step_end});
    report << "finished\n";
    return 0;
  } catch (const Error& error) {
    const std::chrono::duration<double> waited = clock_type::now() - last_step_end;
    std::fprintf(stderr, "rank %d: %s\n", env.rank(), error.what());
    report << "raised after " << waited.count() << " s\n" << error.what() << '\n';
    report.close();
    return 1;  // ~Environment ends the job (MPI_Abort): the call timed out
  }
}
