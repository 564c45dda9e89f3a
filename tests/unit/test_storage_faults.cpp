// Storage faults of checkpoints (issue 9): a writer killed with SIGKILL at
// spread-out points of a checkpoint's write, a full disk (a file size limit,
// and a real ENOSPC on a small tmpfs where mounting is allowed), paths that
// cannot be written, and temporary files left by killed writers. In each
// case the previous checkpoint stays whole and loads, the error names the
// path, the step and the reason, and the next save succeeds. The writer is
// a program of its own (checkpoint_writer.cpp), started with posix_spawn.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <loom/loom.hpp>
#include <map>
#include <string>
#include <vector>

#include "fashion_test.hpp"
#include "loom_test.hpp"
#include "temp_dir.hpp"

extern char** environ;

namespace fs = std::filesystem;
using namespace loom;
using loom::test::TempDir;

namespace {

// As in checkpoint_writer.cpp, so its checkpoints load here.
using Net = Sequential<Input<1, 28, 28>, Flatten, Linear<256>, ReLU, Linear<10>>;
using Writer = Trainer<Net, SingleDevice, Adam>;

Writer make_trainer() { return Writer(devices::cpu(1), {.lr = 0.001f}, {.seed = 7}); }

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A loom::Error's message without the " [file:line]" loom adds: what the
// user reads, compared whole.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& error) {
    const std::string text = error.what();
    return text.substr(0, text.rfind(" ["));
  }
  return "no error";
}

std::string without_location(const std::string& text) { return text.substr(0, text.rfind(" [")); }

std::vector<std::string> entries(const fs::path& folder) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The checkpoint writer, its stdout read through a pipe one line at a time.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    std::vector<std::string> words{LOOM_CHECKPOINT_WRITER};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& word : words) argv.push_back(word.data());
    argv.push_back(nullptr);
    const int error =
        ::posix_spawn(&pid_, LOOM_CHECKPOINT_WRITER, &actions, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    out_ = fds[0];
    INFO("posix_spawn " << LOOM_CHECKPOINT_WRITER << ": " << std::strerror(error));
    REQUIRE(error == 0);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // A failed REQUIRE leaves no writer running.
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
  }

  pid_t pid() const { return pid_; }
  const std::vector<std::string>& lines() const { return lines_; }

  // Takes in what the child wrote, waiting up to timeout_ms (-1: for ever)
  // for the first of it; false at end of output.
  bool read(int timeout_ms) {
    pollfd ready{out_, POLLIN, 0};
    if (::poll(&ready, 1, timeout_ms) <= 0) return true;
    char chunk[4096];
    const ssize_t got = ::read(out_, chunk, sizeof chunk);
    if (got <= 0) return false;
    pending_.append(chunk, static_cast<std::size_t>(got));
    for (std::size_t end; (end = pending_.find('\n')) != std::string::npos;) {
      lines_.push_back(pending_.substr(0, end));
      pending_.erase(0, end + 1);
    }
    return true;
  }

  // Waits until the child stops itself (SIGSTOP); false if it ended.
  bool wait_for_stop() {
    int status = 0;
    ::waitpid(pid_, &status, WUNTRACED);
    reaped_ = !WIFSTOPPED(status);
    return WIFSTOPPED(status);
  }

  // Waits for the exit, then reads all the output; the wait status.
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    while (read(-1)) {
    }
    return status;
  }

  // The "key: value" lines.
  std::map<std::string, std::string> report() const {
    std::map<std::string, std::string> values;
    for (const auto& line : lines_)
      if (const auto colon = line.find(": "); colon != std::string::npos)
        values[line.substr(0, colon)] = line.substr(colon + 2);
    return values;
  }

 private:
  pid_t pid_ = 0;
  int out_ = -1;
  bool reaped_ = false;
  std::string pending_;
  std::vector<std::string> lines_;
};

// While it lives, this thread watches the child's write from a CPU of its
// own, before other work on the machine (nice -20, where allowed): the write
// lasts about a millisecond, and sharing a CPU with the child, or waiting
// for one, the watcher sees nothing until the write is over.
class Urgent {
 public:
  explicit Urgent(pid_t child) : nice_(::getpriority(PRIO_PROCESS, 0)) {
    CPU_ZERO(&mask_);
    ::sched_getaffinity(0, sizeof mask_, &mask_);
    cpu_set_t mine, theirs = mask_;
    CPU_ZERO(&mine);
    for (int cpu = 0; cpu < CPU_SETSIZE && CPU_COUNT(&mine) == 0; ++cpu)
      if (CPU_ISSET(cpu, &mask_)) {
        CPU_SET(cpu, &mine);
        CPU_CLR(cpu, &theirs);
      }
    separate = CPU_COUNT(&theirs) > 0 && ::sched_setaffinity(child, sizeof theirs, &theirs) == 0 &&
               ::sched_setaffinity(0, sizeof mine, &mine) == 0;
    ::setpriority(PRIO_PROCESS, 0, -20);
  }
  Urgent(const Urgent&) = delete;
  Urgent& operator=(const Urgent&) = delete;
  ~Urgent() {
    ::setpriority(PRIO_PROCESS, 0, nice_);
    ::sched_setaffinity(0, sizeof mask_, &mask_);
  }

  bool separate = false;  // the watcher and the child on different CPUs

 private:
  int nice_;
  cpu_set_t mask_;
};

// The steps of the last "begin: <n>" line and the last line of
// callbacks::Checkpoint ("checkpoint <path> (step <n>)"), 0 for none.
struct Progress {
  std::uint64_t begun = 0, saved = 0;
  int begins = 0;
};

Progress progress(const std::vector<std::string>& lines) {
  Progress p;
  for (const auto& line : lines) {
    if (line.starts_with("begin: ")) {
      p.begun = std::stoull(line.substr(7));
      ++p.begins;
    } else if (line.starts_with("checkpoint ")) {
      p.saved = std::stoull(line.substr(line.rfind("(step ") + 6));
    }
  }
  return p;
}

std::string reference(const fs::path& refs, std::uint64_t step) {
  return read_bytes(refs / ("step-" + std::to_string(step) + ".safetensors"));
}

// Runs `checkpoint_writer full-disk <how>` and checks what it reports: the
// save into the too-small disk fails with `reason` and `hint`, leaves no
// temporary file (the folder holds `entries_after_failure`) and the step-1
// checkpoint as it was; with space again the same save succeeds and
// training goes on. The report, for more checks.
std::map<std::string, std::string> full_disk(const std::string& how, const TempDir& dir,
                                             const std::string& reason, const std::string& hint,
                                             const std::string& entries_after_failure) {
  Child child({"full-disk", how, dir.path(), LOOM_TEST_DATA_DIR});
  const int status = child.wait();
  auto report = child.report();
  if (how == "tmpfs" && WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    REQUIRE(report.contains("skipped"));
    return report;
  }
  INFO("checkpoint_writer said:\n"
       << [&] {
            std::string text;
            for (const auto& line : child.lines()) text += line + '\n';
            return text;
          }());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  const std::string path = dir.file("checkpoint.safetensors");
  const std::string temp = path + ".tmp-" + report["pid"];
  // The failed save was of the same state as the retry: the same size.
  REQUIRE(without_location(report["error"]) ==
          "loom: cannot write safetensors file '" + path + "' (through the temporary file '" +
              temp + "'): writing it failed: " + reason + "; " + hint + ": the file needs " +
              report["retry size"] + " bytes" +
              (how == "tmpfs" ? ", while the file it replaces stays until it is written" : "") +
              "; a file already at that path is unchanged");
  REQUIRE(report["entries"] == entries_after_failure);
  REQUIRE(report["previous"] == "identical");
  REQUIRE(report["loaded steps"] == "1");
  REQUIRE(report["saved steps"] == "3");
  REQUIRE(report["entries after"] == "checkpoint.safetensors");
  return report;
}

}  // namespace

TEST_CASE(
    "storage faults: SIGKILL at spread-out points of a checkpoint write keeps a whole "
    "checkpoint that loads, and the next save succeeds") {
  const auto began = std::chrono::steady_clock::now();
  TempDir dir;
  const fs::path path = dir.file("checkpoint.safetensors");
  const fs::path refs = fs::path(dir.path()) / "refs";
  const std::string temp_prefix = path.filename().string() + ".tmp-";
  // Kill k waits until the temporary file holds (k % 9) / 8 of the
  // checkpoint's bytes: 0 (just created) to all of them (in fsync or rename).
  constexpr int kills = 27;
  int mid_write = 0, empty = 0, partial = 0;
  bool separate = true;
  std::vector<std::string> landed;  // where each kill landed, for the log
  for (int k = 0; k < kills; ++k) {
    INFO("kill " << k);
    Child child({"train", dir.path(), LOOM_TEST_DATA_DIR});
    const std::string temp = path.string() + ".tmp-" + std::to_string(child.pid());
    // The child's second checkpoint write: the first must have succeeded
    // in the folder the killed writer before it left.
    for (int save = 1;; ++save) {
      REQUIRE(child.wait_for_stop());
      if (save == 2) break;
      REQUIRE(::kill(child.pid(), SIGCONT) == 0);
    }
    // Written before the stop: in the pipe now.
    while (progress(child.lines()).begins < 2) REQUIRE(child.read(0));
    const Progress p = progress(child.lines());
    REQUIRE(p.begins == 2);
    REQUIRE(p.saved == p.begun - 1);
    const auto full = fs::file_size(refs / ("step-" + std::to_string(p.begun) + ".safetensors"));
    const auto threshold = full * static_cast<unsigned>(k % 9) / 8;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    const Urgent urgent(child.pid());
    separate = separate && urgent.separate;
    REQUIRE(::kill(child.pid(), SIGCONT) == 0);
    for (unsigned spin = 0;; ++spin) {
      struct stat status {};
      if (::stat(temp.c_str(), &status) == 0 &&
          static_cast<std::uintmax_t>(status.st_size) >= threshold)
        break;
      // Every so often: has the write ended before the temporary file grew enough?
      if (spin % 64 == 0) {
        REQUIRE(child.read(0));
        if (progress(child.lines()).saved >= p.begun) break;
        REQUIRE(std::chrono::steady_clock::now() < deadline);
      }
    }
    REQUIRE(::kill(child.pid(), SIGKILL) == 0);
    const int status = child.wait();
    REQUIRE(WIFSIGNALED(status));
    REQUIRE(WTERMSIG(status) == SIGKILL);

    // The temporary file outlives its writer only if the kill came between
    // its creation and the rename: in the middle of the write.
    const Progress after = progress(child.lines());
    const bool in_write = fs::exists(temp);
    std::uint64_t survivor = 0;
    if (in_write) {
      REQUIRE(after.begun == p.begun);
      REQUIRE(after.saved == p.begun - 1);
      REQUIRE(read_bytes(path) == reference(refs, after.saved));
      survivor = after.saved;
      const auto size = fs::file_size(temp);
      ++mid_write;
      if (size == 0) ++empty;
      if (size > 0 && size < full) ++partial;
      landed.push_back(std::to_string(size * 100 / full) + "%");
    } else {
      // Killed after the rename (before or after the line saying so).
      const std::string bytes = read_bytes(path);
      REQUIRE((bytes == reference(refs, after.saved) || bytes == reference(refs, after.begun)));
      survivor = bytes == reference(refs, after.begun) ? after.begun : after.saved;
      landed.push_back("after");
    }
    Writer reader = make_trainer();
    reader.load(path);
    REQUIRE(reader.steps() == survivor);
    // The killed writer's temporary file, if any, is the only one: the
    // earlier writers' went at this writer's first save.
    for (const auto& name : entries(dir.path()))
      if (name.starts_with(temp_prefix)) REQUIRE(name == fs::path(temp).filename().string());
    for (const auto& ref : entries(refs))
      if (ref != "step-" + std::to_string(survivor) + ".safetensors") fs::remove(refs / ref);
  }
  // A save in-process, over the last killed writer's leftovers.
  Writer last = make_trainer();
  last.load(path);
  const auto steps = last.steps();
  last.save(path);
  // The killed writers' Checkpoint lock file stays (one per path, reused by
  // the next run), and no process holds it any more.
  REQUIRE(entries(dir.path()) == std::vector<std::string>{"checkpoint.safetensors",
                                                          "checkpoint.safetensors.lock", "refs"});
  REQUIRE(io::FileLock::acquire(path, "the test").held());
  Writer reader = make_trainer();
  reader.load(path);
  REQUIRE(reader.steps() == steps);

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::string where;
  for (const auto& l : landed) where += " " + l;
  std::printf(
      "%d kills: %d in the middle of the write (the temporary file empty in %d, "
      "part-written in %d, whole in %d), %d after the rename; %.1f s; the temporary "
      "file's share of the checkpoint at each death:%s\n",
      kills, mid_write, empty, partial, mid_write - empty - partial, kills - mid_write, seconds,
      where.c_str());
  // Most kills must land in the write, and some part-way through its bytes:
  // on a busy machine (2 cores, load 6) 10 to 16 of 27 did. With one CPU the
  // watcher cannot see the write while it happens.
  REQUIRE(mid_write >= kills * 2 / 3);
  if (separate)
    REQUIRE(partial >= kills / 9);
  else
    WARN("one CPU only: where in the write the kills landed is not checked");
}

TEST_CASE(
    "storage faults: a full disk (a file size limit, EFBIG) fails the save clearly and "
    "keeps the previous checkpoint") {
  TempDir dir;
  full_disk("fsize", dir, "File too large",
            "raise the file size limit (ulimit -f) or write to another file system",
            "checkpoint.safetensors");
  // Also seen from here: no temporary file, and the last save loads.
  REQUIRE(entries(dir.path()) == std::vector<std::string>{"checkpoint.safetensors"});
  Writer reader = make_trainer();
  reader.load(dir.file("checkpoint.safetensors"));
  REQUIRE(reader.steps() == 3);
}

// Hidden from catch_discover_tests: CTest runs it on its own, with
// SKIP_RETURN_CODE 77 for a container that may not mount a tmpfs.
TEST_CASE(
    "storage faults: a full disk (ENOSPC on a small tmpfs) fails the save clearly and "
    "keeps the previous checkpoint",
    "[.][tmpfs]") {
  std::string skipped;
  {  // the folder goes before the exit below, which runs no destructors
    TempDir dir;
    const auto report =
        full_disk("tmpfs", dir, "No space left on device",
                  "free space on the disk (or raise the quota)", "ballast checkpoint.safetensors");
    if (report.contains("skipped")) skipped = report.at("skipped");
  }
  if (!skipped.empty()) {
    std::printf("skipped: %s\n", skipped.c_str());
    std::fflush(stdout);
    std::_Exit(77);
  }
}

TEST_CASE(
    "storage faults: unwritable checkpoint paths fail naming the path, the step and the "
    "reason, and lose nothing") {
  TempDir dir;
  const std::string good = dir.file("checkpoint.safetensors");
  Writer trainer = make_trainer();
  trainer.fit(test::head(test::fashion().test, 32), {.epochs = 1, .batch_size = 32});
  trainer.save(good);
  const std::string previous = read_bytes(good);
  const std::string pid = std::to_string(::getpid());
  const auto cannot = [&](const std::string& path, const std::string& step) {
    return "loom: cannot write safetensors file '" + path + "' (through the temporary file '" +
           path + ".tmp-" + pid + "'): " + step;
  };
  std::vector<std::string> expected{"checkpoint.safetensors"};

  SECTION("a missing folder") {
    const std::string path = dir.file("missing/checkpoint.safetensors");
    REQUIRE(error_of([&] { trainer.save(path); }) ==
            cannot(path,
                   "creating it failed: No such file or directory; check that the folder "
                   "exists and is writable"));
    REQUIRE(error_of([&] { callbacks::Checkpoint({.path = path}); }) ==
            "loom: callbacks::Checkpoint: the folder of '" + path +
                "' does not exist; create it first");
  }
  SECTION("a folder that is a regular file") {
    write_bytes(dir.file("notes"), "kept");
    const std::string path = dir.file("notes/checkpoint.safetensors");
    REQUIRE(error_of([&] { trainer.save(path); }) ==
            cannot(path,
                   "creating it failed: Not a directory; check that the folder exists and "
                   "is writable"));
    REQUIRE(error_of([&] { callbacks::Checkpoint({.path = path}); }) ==
            "loom: callbacks::Checkpoint: the folder of '" + path + "' is not a folder");
    REQUIRE(read_bytes(dir.file("notes")) == "kept");
    expected.push_back("notes");
  }
  SECTION("the path is a folder") {
    const std::string path = dir.file("run");
    fs::create_directory(path);
    write_bytes(dir.file("run/log.txt"), "kept");
    REQUIRE(error_of([&] { trainer.save(path); }) ==
            cannot(path,
                   "renaming it over the target failed: Is a directory; check that the "
                   "target is not a folder; a file already there is unchanged"));
    REQUIRE(entries(path) == std::vector<std::string>{"log.txt"});
    REQUIRE(read_bytes(dir.file("run/log.txt")) == "kept");
    expected.push_back("run");
  }
  // Nothing left behind, the previous checkpoint as it was, and the trainer
  // goes on: it trains and saves over it.
  std::sort(expected.begin(), expected.end());
  REQUIRE(entries(dir.path()) == expected);
  REQUIRE(read_bytes(good) == previous);
  trainer.fit(test::head(test::fashion().test, 32), {.epochs = 1, .batch_size = 32});
  trainer.save(good);
  Writer reader = make_trainer();
  reader.load(good);
  REQUIRE(reader.steps() == 2);
}

TEST_CASE("storage faults: temporary files of killed writers neither break a save nor pile up") {
  TempDir dir;
  const std::string path = dir.file("checkpoint.safetensors");
  // A process id that was in use and is not now.
  pid_t dead = 0;
  {
    Child child({"--usage"});
    dead = child.pid();
    const int status = child.wait();
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 2);
  }
  REQUIRE(::kill(dead, 0) == -1);
  const std::string garbage(3 << 20, 'x');  // larger than the checkpoint
  write_bytes(path + ".tmp-" + std::to_string(dead), garbage);
  write_bytes(path + ".tmp-" + std::to_string(::getpid()), garbage);  // this process's name
  write_bytes(path + ".tmp-1", "alive");     // a live process's: maybe another writer's
  write_bytes(path + ".tmp-x", "not mine");  // not a writer's name
  write_bytes(path + ".tmp-" + std::to_string(dead) + ".bak", "not mine");

  Writer trainer = make_trainer();
  trainer.save(dir.file("reference.safetensors"));
  trainer.save(path);
  REQUIRE(read_bytes(path) == read_bytes(dir.file("reference.safetensors")));
  Writer reader = make_trainer();
  reader.load(path);
  REQUIRE(reader.steps() == 0);
  REQUIRE(entries(dir.path()) ==
          std::vector<std::string>{"checkpoint.safetensors", "checkpoint.safetensors.tmp-1",
                                   "checkpoint.safetensors.tmp-" + std::to_string(dead) + ".bak",
                                   "checkpoint.safetensors.tmp-x", "reference.safetensors"});
  REQUIRE(read_bytes(path + ".tmp-1") == "alive");
}
