// A rank lost in the middle of training, for rank_fault.cmake: started by
// mpiexec, the last rank ends itself with SIGKILL ("kill") or freezes with
// SIGSTOP ("stop") as its step 4 begins, and every other rank, waiting for
// it in the step's gradient all-reduce, must raise a loom::Error within the
// collective timeout instead of waiting for ever.
//
// Usage: rank_fault kill|stop TIMEOUT_SECONDS REPORT_PREFIX
// Each surviving rank r writes REPORT_PREFIX.r: "raised after S s" and the
// error's message, or "finished" when training ended without an error.
// mpirun's exit status says little here (with --enable-recovery it is 0
// whatever the ranks did), so the script reads the reports.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <fstream>
#include <loom/loom.hpp>
#include <string>

#include "fashion_test.hpp"
#include "policy_test.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// The faulty rank's fault as its step 4 begins; every rank notes when a
// step ended.
struct Fault {
  bool faulty;
  int signal;
  clock_type::time_point* last_step_end;
  void on_step_begin(const loom::StepBegin& step) const {
    if (faulty && step.step == 4) raise(signal);
  }
  void on_step(const loom::StepInfo&) const { *last_step_end = clock_type::now(); }
};

}  // namespace

int main(int argc, char** argv) {
  using namespace loom;
  dist::Environment env(argc, argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: rank_fault kill|stop TIMEOUT_SECONDS REPORT_PREFIX\n");
    return 2;
  }
  const std::string fault = argv[1];
  env.set_collective_timeout(comm::Timeout(std::stod(argv[2])));
  const bool faulty = env.rank() == env.size() - 1;
  std::ofstream report;
  if (!faulty) report.open(std::string(argv[3]) + "." + std::to_string(env.rank()));

  Trainer<test::Logistic, DataParallel<>> trainer(env.devices(), test::sgd, {.seed = 7},
                                                  comm::Comm(env.world()));
  auto last_step_end = clock_type::now();
  try {
    trainer.fit(test::head(test::fashion().train, 600), {.epochs = 1, .batch_size = 60},
                Fault{faulty, fault == "kill" ? SIGKILL : SIGSTOP, &last_step_end});
    report << "finished\n";
    return 0;
  } catch (const Error& error) {
    const std::chrono::duration<double> waited = clock_type::now() - last_step_end;
    std::fprintf(stderr, "rank %d: %s\n", env.rank(), error.what());
    report << "raised after " << waited.count() << " s\n" << error.what() << '\n';
    report.close();
    // The first survivor to leave ends the job (~Environment: MPI_Abort,
    // since the call timed out); the others, timed out at about the same
    // moment, get time to write their reports first.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    return 1;
  }
}
