// Replays committed fuzz inputs through a harness in the ordinary build, so
// that every crash fuzzing ever found stays a test:
//   loom_fuzz_replay_<target> SEEDS [REGRESSIONS]
// Each file of SEEDS (the seed corpus: valid files) must parse; each file of
// REGRESSIONS (the inputs behind each reader fix fuzzing led to) must parse
// or be refused with loom::Error. An empty or missing SEEDS fails, so that a
// wrong path cannot pass by replaying nothing; REGRESSIONS may be absent
// while a target has none.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz.hpp"

namespace fs = std::filesystem;

namespace {

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file()) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::uint8_t> contents(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Tally {
  std::size_t parsed = 0, refused = 0, failed = 0;
};

// Runs one input and counts its outcome; another exception is a failure.
void replay(const fs::path& path, Tally& tally) {
  const auto bytes = contents(path);
  // Named before the run: a sanitizer or a broken invariant aborts the process.
  std::printf("%s (%zu bytes): ", path.c_str(), bytes.size());
  std::fflush(stdout);
  try {
    const loom::fuzz::Outcome outcome = loom::fuzz::run(bytes);
    const bool parsed = outcome == loom::fuzz::Outcome::parsed;
    if (parsed)
      std::printf("parsed\n");
    else
      std::printf("refused with loom::Error: %s\n", loom::fuzz::last_error().c_str());
    ++(parsed ? tally.parsed : tally.refused);
    return;
  } catch (const std::exception& error) {
    std::printf("FAIL: not a loom::Error but another exception: %s\n", error.what());
  } catch (...) {
    std::printf("FAIL: an exception that is not even a std::exception\n");
  }
  ++tally.failed;
}

// Replays every file of `dir`; false when one failed, or when `seeds` and
// one was refused (a seed is a valid file).
bool replay_dir(const fs::path& dir, bool seeds) {
  Tally tally;
  const auto files = files_in(dir);
  for (const auto& path : files) replay(path, tally);
  std::printf("%zu %s from %s: %zu parsed, %zu refused with loom::Error, %zu failed\n",
              files.size(), seeds ? "seeds" : "regression inputs", dir.c_str(), tally.parsed,
              tally.refused, tally.failed);
  if (seeds && tally.refused)
    std::printf(
        "FAIL: the seeds must be valid files; write them again (loom_fuzz_make_seeds) "
        "if the format changed\n");
  return tally.failed == 0 && !(seeds && tally.refused);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s SEEDS_DIR [REGRESSIONS_DIR]\n", argv[0]);
    return 2;
  }
  const fs::path seeds = argv[1];
  if (!fs::is_directory(seeds) || files_in(seeds).empty()) {
    std::printf("FAIL: seed corpus '%s' is missing or empty\n", seeds.c_str());
    return 1;
  }
  bool ok = replay_dir(seeds, true);
  if (argc == 3 && fs::is_directory(argv[2]))
    ok = replay_dir(argv[2], false) && ok;
  else if (argc == 3)
    std::printf("no regression inputs: %s does not exist\n", argv[2]);
  return ok ? 0 : 1;
}
