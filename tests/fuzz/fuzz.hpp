// What the fuzz harnesses share. A harness (fuzz_<target>.cpp) defines
// loom::fuzz::run for one reader; libfuzzer_entry.cpp hands it libFuzzer's
// inputs and replay.cpp the committed corpus, so a crash found by fuzzing
// stays a test in the ordinary build. loom::Error is a reader's answer to bad
// input; anything else (another exception, a sanitizer report, a broken
// invariant, a hang, a huge allocation) is a finding.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <loom/core/error.hpp>
#include <span>
#include <string>

namespace loom::fuzz {

enum class Outcome { parsed, rejected };

// Feeds `bytes` to the harness's reader and checks what it returned.
Outcome run(std::span<const std::uint8_t> bytes);

// A broken invariant: reported like a sanitizer's finding, by aborting, so
// that libFuzzer saves the input and the replay test fails.
[[noreturn]] inline void finding(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "loom fuzz: invariant '%s' broken at %s:%d\n", condition, file, line);
  std::abort();
}

#define LOOM_FUZZ_REQUIRE(condition) \
  ((condition) ? void() : ::loom::fuzz::finding(#condition, __FILE__, __LINE__))

// The message of the last loom::Error outcome_of caught, for the replay to
// show why an input was refused.
inline std::string& last_error() {
  static std::string message;
  return message;
}

// parsed, or rejected when `read` throws loom::Error; other exceptions pass.
template <class Read>
Outcome outcome_of(Read&& read) {
  try {
    read();
    return Outcome::parsed;
  } catch (const Error& error) {
    last_error() = error.what();
    return Outcome::rejected;
  }
}

// One file per process for the readers that take a path, in RAM (/dev/shm,
// else $TMPDIR, else /tmp) so that writing it for every input costs little.
class ScratchFile {
 public:
  ScratchFile() {
    const char* tmpdir = std::getenv("TMPDIR");
    for (const char* base : {"/dev/shm", tmpdir, "/tmp"}) {
      if (!base || !*base) continue;
      std::string pattern = std::string(base) + "/loom-fuzz-XXXXXX";
      if (::mkdtemp(pattern.data())) {
        dir_ = pattern;
        path_ = dir_ + "/input";
        return;
      }
    }
    std::fprintf(stderr, "loom fuzz: cannot create a folder in /dev/shm, $TMPDIR or /tmp: %s\n",
                 std::strerror(errno));
    std::abort();
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  ~ScratchFile() {
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }

  // Replaces the file's contents with `bytes`; returns its path.
  const std::string& write(std::span<const std::uint8_t> bytes) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    bool ok = fd >= 0;
    for (std::size_t done = 0; ok && done < bytes.size();) {
      const ssize_t wrote = ::write(fd, bytes.data() + done, bytes.size() - done);
      ok = wrote > 0 || (wrote < 0 && errno == EINTR);
      if (wrote > 0) done += static_cast<std::size_t>(wrote);
    }
    if (fd >= 0) ok = ::close(fd) == 0 && ok;
    if (!ok) {
      std::fprintf(stderr, "loom fuzz: cannot write '%s': %s\n", path_.c_str(),
                   std::strerror(errno));
      std::abort();
    }
    return path_;
  }

 private:
  std::string dir_, path_;
};

inline const std::string& scratch_file(std::span<const std::uint8_t> bytes) {
  static ScratchFile file;
  return file.write(bytes);
}

}  // namespace loom::fuzz
