// What ends or guards a run besides its data: a signal that stops the fit
// at a step's end (callbacks::StopOnSignal), the threads loom starts never
// taking such a signal, the lock on a checkpoint's file, the sample shape
// checked against Input<>, and the warning when the loss diverges while
// staying finite.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <loom/loom.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "temp_dir.hpp"

using namespace loom;
using loom::test::fashion;
using loom::test::head;

namespace {

using Mlp = Sequential<Input<1, 28, 28>, Flatten, Linear<32>, ReLU, Linear<10>>;

// Raises `signal` in this thread during on_step after optimizer step `at`
// (raise() runs the handler before it returns).
struct RaiseAt {
  std::uint64_t at;
  int signal;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() == at) ::raise(signal);
  }
};

// The signals blocked in the threads of this process named `name`, read
// from /proc: one mask per thread.
std::vector<unsigned long long> blocked_in_threads(const std::string& name) {
  std::vector<unsigned long long> masks;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string thread_name;
    std::getline(comm, thread_name);
    if (thread_name != name) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("SigBlk:", 0) == 0) masks.push_back(std::stoull(line.substr(7), nullptr, 16));
  }
  return masks;
}

bool blocks_stop_signals(unsigned long long mask) {
  for (const int s : stop_signals)
    if ((mask & (1ULL << (s - 1))) == 0) return false;
  return true;
}

}  // namespace

TEST_CASE("StopOnSignal: a signal during a step ends the fit after that step, saved") {
  const auto train = head(fashion().train, 640);  // 10 steps of 64
  test::TempDir dir;
  const std::string path = dir.file("stopped.safetensors");
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f});
  std::ostringstream said;
  callbacks::StopOnSignal stop({.out = &said});
  callbacks::Checkpoint checkpoint({.path = path});
  for (const int signal : {SIGTERM, SIGINT, SIGUSR1}) {
    DYNAMIC_SECTION(signal_name(signal)) {
      trainer.fit(train, {.epochs = 2, .batch_size = 64}, RaiseAt{3, signal}, stop, checkpoint);
      REQUIRE(trainer.steps() == 3);
      REQUIRE(trainer.position().steps == 3);
      REQUIRE(stop.received() == signal);
      REQUIRE(stop.stopped_by() == signal);
      REQUIRE(stop.stopped_after_step() == 3);
      REQUIRE(stop.exit_status() == 128 + signal);
      REQUIRE(said.str() == signal_name(signal) +
                                ": stopping after step 3; a second signal ends the program at "
                                "once\n");
      // The checkpoint of the fit's end holds step 3, and resumes there.
      REQUIRE(checkpoint.saves == 1);
      Trainer<Mlp> resumed(devices::cpu(1), {.lr = 0.05f});
      resumed.load(path);
      REQUIRE(resumed.steps() == 3);
      REQUIRE(resumed.position().epoch == 1);
      REQUIRE(resumed.position().batches == 3);
    }
  }
}

TEST_CASE("StopOnSignal: a signal before the fit (start-up) ends it before its first step") {
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f});
  callbacks::StopOnSignal stop;
  ::raise(SIGTERM);
  REQUIRE(stop.received() == SIGTERM);
  REQUIRE(stop.stopped_by() == 0);  // not yet agreed: no fit ran
  trainer.fit(head(fashion().train, 256), {.epochs = 1, .batch_size = 64}, stop);
  REQUIRE(trainer.steps() == 0);
  REQUIRE(stop.stopped_by() == SIGTERM);
  REQUIRE(stop.exit_status() == 143);
}

TEST_CASE(
    "StopOnSignal: a signal during the epoch's evaluation stops the fit before the next step") {
  struct RaiseAtEpochEnd {
    void on_epoch_end(const EpochInfo&) { ::raise(SIGUSR1); }
  };
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 0.05f});
  callbacks::StopOnSignal stop;
  trainer.fit(head(fashion().train, 256), {.epochs = 3, .batch_size = 64}, RaiseAtEpochEnd{}, stop);
  REQUIRE(trainer.steps() == 4);  // epoch 1's four steps
  REQUIRE(trainer.position().epoch == 1);
  REQUIRE(trainer.position().ended);
  REQUIRE(stop.stopped_by() == SIGUSR1);
}

TEST_CASE("StopOnSignal: the second signal ends the process at once, by that signal") {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Exit statuses say how far the child came: 3 the first signal was
    // not recorded, 4 the second did not end it.
    callbacks::StopOnSignal stop;
    ::raise(SIGINT);
    if (stop.received() != SIGINT) ::_exit(3);
    ::raise(SIGINT);
    ::_exit(4);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(WTERMSIG(status) == SIGINT);
}

TEST_CASE("StopOnSignal: one at a time, and the replaced handlers come back") {
  struct sigaction before {};
  REQUIRE(::sigaction(SIGTERM, nullptr, &before) == 0);
  {
    callbacks::StopOnSignal stop;
    struct sigaction during {};
    REQUIRE(::sigaction(SIGTERM, nullptr, &during) == 0);
    REQUIRE(during.sa_handler == &loom::detail::on_stop_signal);
    REQUIRE_THROWS_WITH(
        callbacks::StopOnSignal(),
        Catch::StartsWith("loom: callbacks::StopOnSignal: another one is alive; a process has one "
                          "set of signal handlers: share that one"));
  }
  struct sigaction after {};
  REQUIRE(::sigaction(SIGTERM, nullptr, &after) == 0);
  REQUIRE(after.sa_handler == before.sa_handler);
  callbacks::StopOnSignal again;  // the first one's end freed the place
}

TEST_CASE("threads loom starts block the stop signals: the loader's, the worker devices' and their reducers'") {
  const auto train = head(fashion().train, 256);
  {
    data::Loader loader(train, {.batch_size = 64});
    const auto masks = blocked_in_threads("loom-loader");
    REQUIRE(masks.size() == 1);
    REQUIRE(blocks_stop_signals(masks[0]));
  }
  Trainer<Mlp, DataParallel<>> trainer(devices::cpu(2), {.lr = 0.05f});
  trainer.fit(train, {.epochs = 1, .batch_size = 64});
  for (const char* name : {"loom-worker", "loom-reducer"}) {
    INFO(name);
    const auto masks = blocked_in_threads(name);
    REQUIRE(masks.size() >= 2);  // one or more a device
    for (const auto mask : masks) REQUIRE(blocks_stop_signals(mask));
  }
  // This thread, which started them, still takes them.
  sigset_t mine;
  REQUIRE(::pthread_sigmask(SIG_BLOCK, nullptr, &mine) == 0);
  for (const int s : stop_signals) REQUIRE(::sigismember(&mine, s) == 0);
}

TEST_CASE("Checkpoint: a second writer of the same file is refused, naming the holder") {
  const auto train = head(fashion().train, 128);
  test::TempDir dir;
  const std::string path = dir.file("shared.safetensors");
  Trainer<Mlp> first(devices::cpu(1), {.lr = 0.05f}), second(devices::cpu(1), {.lr = 0.05f});
  callbacks::Checkpoint one({.path = path}), two({.path = path});
  first.fit(train, {.epochs = 1, .batch_size = 64}, one);
  REQUIRE(std::filesystem::exists(path + ".lock"));
  REQUIRE_THROWS_WITH(
      second.fit(train, {.epochs = 1, .batch_size = 64}, two),
      Catch::StartsWith("loom: callbacks::Checkpoint: '" + path + "' is being written by process " +
                        std::to_string(::getpid()) + " (this one), which holds '" + path +
                        ".lock'; two runs saving to one file would replace each other's "
                        "checkpoints: give this run another path, or end that run first"));
  REQUIRE(second.steps() == 0);
  // The holder's next fit keeps its lock; once it is gone the path is free.
  first.fit(train, {.epochs = 1, .batch_size = 64}, one);
  { const callbacks::Checkpoint gone = std::move(one); }
  REQUIRE_FALSE(std::filesystem::exists(path + ".lock"));
  second.fit(train, {.epochs = 1, .batch_size = 64}, two);
  REQUIRE(two.saves == 1);
}

TEST_CASE("Checkpoint: another process holding the lock is named by its process id") {
  test::TempDir dir;
  const std::string path = dir.file("other.safetensors");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const auto lock = io::FileLock::acquire(path, "child");
    const char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) ::_exit(3);
    ::pause();  // until the parent ends it
    ::_exit(0);
  }
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  REQUIRE_THROWS_WITH(io::FileLock::acquire(path, "callbacks::Checkpoint"),
                      Catch::Contains("'" + path + "' is being written by process " +
                                      std::to_string(child) + ", which holds"));
  ::kill(child, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  // A holder that died (even by SIGKILL) frees the lock at once.
  const auto mine = io::FileLock::acquire(path, "callbacks::Checkpoint");
  REQUIRE(mine.held());
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST_CASE("fit and evaluate check the sample shape against Input<>, not only its size") {
  const auto train = head(fashion().train, 64);
  using Wrong = Sequential<Input<4, 14, 14>, Flatten, Linear<10>>;
  Trainer<Wrong> wrong(devices::cpu(1), {});
  const std::string said =
      "has samples of 1x28x28 but the network's Input is <4, 14, 14>: the same 784 values in "
      "another shape. Give Input<1, 28, 28>, or a flat Input<784> to take any sample of 784 "
      "values";
  REQUIRE_THROWS_WITH(wrong.fit(train, {}),
                      Catch::StartsWith("loom: fit: dataset '" + train.name + "' " + said));
  REQUIRE_THROWS_WITH(wrong.evaluate(train),
                      Catch::StartsWith("loom: evaluate: dataset '" + train.name + "' " + said));
  using Rows = Sequential<Input<14, 56>, Flatten, Linear<10>>;
  Trainer<Rows> rows(devices::cpu(1), {});
  REQUIRE_THROWS_WITH(rows.fit(train, {}), Catch::Contains("the network's Input is <14, 56>"));
  // A flat Input takes any sample of its size; rows x features the image's rows.
  using Flat = Sequential<Input<784>, Linear<10>>;
  Trainer<Flat> flat(devices::cpu(1), {});
  flat.fit(train, {.epochs = 1, .batch_size = 64});
  REQUIRE(flat.steps() == 1);
  using ImageRows = Sequential<Input<28, 28>, Flatten, Linear<10>>;
  Trainer<ImageRows> image_rows(devices::cpu(1), {});
  image_rows.fit(train, {.epochs = 1, .batch_size = 64});
  REQUIRE(image_rows.steps() == 1);
}

TEST_CASE("Progress warns once when the loss grows by orders of magnitude while finite") {
  const auto train = head(fashion().train, 1280);
  std::ostringstream out;
  Trainer<Mlp> trainer(devices::cpu(1), {.lr = 100.0f});
  trainer.fit(train, {.epochs = 1, .batch_size = 64, .on_nonfinite = NonFinite::skip},
              callbacks::Progress({.out = &out, .style = callbacks::Progress::Style::lines}));
  const std::string text = out.str();
  const auto at = text.find("warning: the training loss grew from 2.");
  REQUIRE(at != std::string::npos);
  REQUIRE(text.find(") while staying finite: training is diverging. Lower the learning rate "
                    "(now 100)\n",
                    at) != std::string::npos);
  REQUIRE(text.find("warning:", at + 1) == std::string::npos);  // once a fit
  // A learning rate that trains gives no warning.
  std::ostringstream calm;
  Trainer<Mlp> fine(devices::cpu(1), {.lr = 0.05f});
  fine.fit(train, {.epochs = 2, .batch_size = 64},
           callbacks::Progress({.out = &calm, .style = callbacks::Progress::Style::lines}));
  REQUIRE(calm.str().find("warning") == std::string::npos);
}
