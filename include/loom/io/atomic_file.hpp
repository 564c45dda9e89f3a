// Replacing a file whole: the new contents go to "<path>.tmp-<pid>", which
// is synced, renamed over the path, and its folder synced, so a crash at any
// point leaves the old file or the new one, never a mix. Checkpoints
// (SafetensorsWriter) and the metrics log (callbacks::Metrics) are written so.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <loom/core/error.hpp>
#include <string>
#include <string_view>
#include <system_error>

namespace loom::io {

namespace detail {

// A writer killed mid-write (SIGKILL, the OOM killer, a preempted job)
// leaves its temporary file "<name>.tmp-<pid>", as large as the file, and a
// run that is killed and resumed again and again would pile them up until
// the disk is full. So each write removes the temporary files of its target
// whose process is gone. A process alive on this host keeps its file: it may
// be another writer of the same path, and removing its file would fail its
// rename. Best effort: what cannot be removed is left for the next write.
inline void remove_stale_temporaries(const std::filesystem::path& path) {
  const std::string prefix = path.filename().string() + ".tmp-";
  if (prefix == ".tmp-") return;
  const std::filesystem::path folder = path.has_parent_path() ? path.parent_path() : ".";
  std::error_code error;
  for (std::filesystem::directory_iterator it(folder, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix) || !it->is_regular_file(error)) continue;
    const char* digits = name.c_str() + prefix.size();
    const char* digits_end = name.c_str() + name.size();
    pid_t pid = 0;
    const auto [stop, parsed] = std::from_chars(digits, digits_end, pid);
    if (parsed != std::errc{} || stop != digits_end || pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    std::filesystem::remove(it->path(), ignored);
  }
}

}  // namespace detail

// Writes `path` as above: `fill(file)` writes the contents into the
// temporary file and returns whether every write succeeded (errno then says
// why). `what` names the kind of file in messages ("safetensors file");
// `bytes` is its size, which a full disk's message gives. A failure is a
// loom::Error naming the step and the reason, and leaves a file already at
// `path` unchanged and no temporary file.
template <class Fill>
void write_file_atomically(const std::filesystem::path& path, std::string_view what,
                           std::size_t bytes, Fill&& fill) {
  std::filesystem::path temp = path;
  temp += ".tmp-" + std::to_string(::getpid());

  const auto fail = [&](const char* step, int error, std::string_view hint) {
    LOOM_FAIL("cannot write ", what, " '", path.string(), "' (through the temporary file '",
              temp.string(), "'): ", step, " failed: ", std::strerror(error), "; ", hint);
  };

  detail::remove_stale_temporaries(path);
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (!file) fail("creating it", errno, "check that the folder exists and is writable");

  bool ok = fill(file);
  // fsync before rename: otherwise a crash can leave the new name on empty data.
  ok = ok && std::fflush(file) == 0 && ::fsync(::fileno(file)) == 0;
  int error = errno;
  if (std::fclose(file) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (!ok) {
    ::unlink(temp.c_str());
    // A full disk and a file size limit need different remedies; both need
    // to know how much must fit, and that nothing was lost.
    const std::string size = "the file needs " + std::to_string(bytes) + " bytes";
    const std::string kept = "; a file already at that path is unchanged";
    if (error == ENOSPC || error == EDQUOT)
      fail("writing it", error,
           "free space on the disk (or raise the quota): " + size +
               ", while the file it replaces stays until it is written" + kept);
    if (error == EFBIG)
      fail("writing it", error,
           "raise the file size limit (ulimit -f) or write to another file system: " + size + kept);
    fail("writing it", error, "check the disk" + kept);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    error = errno;
    ::unlink(temp.c_str());
    fail("renaming it over the target", error,
         "check that the target is not a folder; a file already there is unchanged");
  }

  // The rename lives in the folder; until the folder is synced a crash can undo it.
  const std::filesystem::path folder = path.has_parent_path() ? path.parent_path() : ".";
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // EINVAL: the file system cannot sync folders, so there is nothing more to do.
  const bool synced = dir >= 0 && (::fsync(dir) == 0 || errno == EINVAL);
  error = errno;
  if (dir >= 0) ::close(dir);
  if (!synced)
    LOOM_FAIL(what, " '", path.string(), "' was written but syncing its folder '",
              folder.string(), "' failed: ", std::strerror(error),
              "; the file may not survive a power loss, check the file system");
}

}  // namespace loom::io
