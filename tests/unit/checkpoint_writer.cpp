// The process the storage-fault tests (test_storage_faults.cpp) start, kill
// and starve of disk: it trains a small MLP on Fashion-MNIST and checkpoints
// it, and reports on stdout, one "key: value" line at a time, what it did
// and saw, for the test to check. A separate program, started with
// posix_spawn, so that a SIGKILL or a file size limit hits a process that
// does nothing else.
//
//   checkpoint_writer train FOLDER DATA_DIR
//     Resumes from FOLDER/checkpoint.safetensors if it is there, then saves
//     after every step: first a reference copy FOLDER/refs/step-<n>.safetensors,
//     then "begin: <n>" and SIGSTOP (the test sends SIGCONT), then
//     callbacks::Checkpoint writes the checkpoint ("checkpoint ... (step <n>)").
//     Stops after 6 steps unless killed.
//   checkpoint_writer full-disk fsize|tmpfs FOLDER DATA_DIR
//     Saves step 1, makes the disk too small for the next save (a file size
//     limit, or a tmpfs mounted on FOLDER in a mount namespace of its own,
//     filled), tries to save step 2, reports what happened, frees the space
//     and saves again. Exits 77 when it may not mount a tmpfs.
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <loom/loom.hpp>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace loom;

namespace {

// 784 * 256 + 256 + 2570 weights, and Adam's two buffers: a 2.4 MB file,
// large enough that a kill can land in the middle of writing it.
using Net = Sequential<Input<1, 28, 28>, Flatten, Linear<256>, ReLU, Linear<10>>;
using Writer = Trainer<Net, SingleDevice, Adam>;

constexpr std::size_t samples = 256;
constexpr std::size_t batch_size = 32;

Writer make_trainer() { return Writer(devices::cpu(1), {.lr = 0.001f}, {.seed = 7}); }

// Fashion-MNIST's test split only: it is a seventh of the training split's
// size, and this program starts some thirty times per test run.
data::Dataset load_data(const std::string& dir) {
  const auto idx = [&](const std::string& stem) {
    const fs::path gz = fs::path(dir) / (stem + ".gz");
    return data::read_idx(fs::exists(gz) ? gz.string() : (fs::path(dir) / stem).string());
  };
  return data::head(
      data::make_image_dataset(idx("t10k-images-idx3-ubyte"), idx("t10k-labels-idx1-ubyte"), 10, {},
                               "fashion-mnist-test"),
      samples);
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::string entries(const fs::path& folder) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : " ") + name;
  return text;
}

void report(const std::string& key, const std::string& value) {
  std::cout << key << ": " << value << '\n' << std::flush;
}

// Before each checkpoint: the same state saved elsewhere, whole, so the test
// can compare the checkpoint file with it byte for byte; then the signal
// that the checkpoint's write begins, and a stop until the test says go on:
// a write takes about a millisecond, less than the test may need to wake
// up, and it must be watching when the write begins.
struct SaveReference {
  fs::path folder;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    trainer.save(folder / ("step-" + std::to_string(trainer.steps()) + ".safetensors"));
    report("begin", std::to_string(trainer.steps()));
    ::raise(SIGSTOP);
  }
};

struct StopAfterSteps {
  std::uint64_t last;
  template <class T>
  void on_step(const StepInfo&, T& trainer) {
    if (trainer.steps() >= last) trainer.stop();
  }
};

int train(const fs::path& folder, const std::string& data_dir) {
  const auto data = load_data(data_dir);
  const fs::path path = folder / "checkpoint.safetensors";
  fs::create_directories(folder / "refs");
  Writer trainer = make_trainer();
  if (fs::exists(path)) trainer.load(path);
  report("pid", std::to_string(::getpid()));
  report("resumed", std::to_string(trainer.steps()));
  // Epochs enough never to end: only the kill, or the stop, ends the run.
  trainer.fit(data, {.epochs = 1000, .batch_size = batch_size}, SaveReference{folder / "refs"},
              callbacks::Checkpoint({.path = path,
                                     .every_steps = 1,
                                     .every_epoch = false,
                                     .at_end = false,
                                     .out = &std::cout}),
              StopAfterSteps{trainer.steps() + 6});
  report("finished", std::to_string(trainer.steps()));
  return 0;
}

// One more optimizer step: a new fit of one batch.
void step(Writer& trainer, const data::Dataset& data) {
  trainer.fit(data::head(data, batch_size), {.epochs = 1, .batch_size = batch_size});
}

int full_disk(const std::string& how, const fs::path& folder, const std::string& data_dir) {
  const bool tmpfs = how == "tmpfs";
  // A mount namespace of its own: the tmpfs is gone when this process is,
  // however it ends. unshare needs a process with one thread: first thing.
  if (tmpfs && ::unshare(CLONE_NEWNS) != 0) {
    report("skipped", std::string("cannot make a mount namespace: ") + std::strerror(errno));
    return 77;
  }
  const auto data = load_data(data_dir);
  const fs::path path = folder / "checkpoint.safetensors";
  Writer trainer = make_trainer();
  step(trainer, data);
  // The size of a checkpoint, to size the disk: a probe file, then gone.
  trainer.save(path);
  const auto size = fs::file_size(path);
  fs::remove(path);
  if (tmpfs) {
    const std::string options = "size=" + std::to_string(2 * size + (1 << 20));
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("loom-test", folder.c_str(), "tmpfs", 0, options.c_str()) != 0) {
      report("skipped", std::string("cannot mount a tmpfs: ") + std::strerror(errno));
      return 77;
    }
  }
  trainer.save(path);
  const std::string previous = read_bytes(path);
  report("pid", std::to_string(::getpid()));
  report("previous size", std::to_string(previous.size()));

  if (tmpfs) {
    // Leaves half a checkpoint free: the next save runs out half-way.
    struct statvfs disk {};
    ::statvfs(folder.c_str(), &disk);
    const auto free = std::uint64_t{disk.f_bavail} * disk.f_frsize;
    std::ofstream(folder / "ballast", std::ios::binary)
        << std::string(free - previous.size() / 2, '\0');
  } else {
    // Ignored, SIGXFSZ would kill the process; then write() fails with EFBIG.
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = previous.size() / 2;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }

  step(trainer, data);
  try {
    trainer.save(path);
    report("error", "none");
  } catch (const Error& error) {
    report("error", error.what());
  }
  report("entries", entries(folder));
  report("previous", read_bytes(path) == previous ? "identical" : "changed");
  Writer reader = make_trainer();
  reader.load(path);
  report("loaded steps", std::to_string(reader.steps()));

  if (tmpfs) {
    fs::remove(folder / "ballast");
  } else {
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  // With space again, the save that failed succeeds, and training goes on.
  trainer.save(path);
  report("retry size", std::to_string(fs::file_size(path)));
  step(trainer, data);
  trainer.save(path);
  Writer again = make_trainer();
  again.load(path);
  report("saved steps", std::to_string(again.steps()));
  report("entries after", entries(folder));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 3 && args[0] == "train") return train(args[1], args[2]);
    if (args.size() == 4 && args[0] == "full-disk" && (args[1] == "fsize" || args[1] == "tmpfs"))
      return full_disk(args[1], args[2], args[3]);
  } catch (const std::exception& error) {
    report("failed", error.what());
    return 1;
  }
  std::cerr << "usage: checkpoint_writer train FOLDER DATA_DIR\n"
               "       checkpoint_writer full-disk fsize|tmpfs FOLDER DATA_DIR\n";
  return 2;
}
