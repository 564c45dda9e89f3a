// An advisory lock on a file a run writes again and again (a checkpoint):
// flock on "<path>.lock", held while the FileLock lives. A second run that
// would write the same file is refused at its start, with the holder's
// process id, instead of the last writer silently replacing the other's
// saves. Advisory: it binds the programs that take it (every loom
// Checkpoint), not other writers; flock is the kernel's, so a holder that
// dies (even by SIGKILL) frees it at once. (Over NFS, flock is as reliable
// as the server's locking.)
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <loom/core/error.hpp>
#include <string>
#include <utility>

namespace loom::io {

class FileLock {
 public:
  FileLock() = default;
  FileLock(FileLock&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)), lock_path_(std::move(other.lock_path_)) {}
  FileLock& operator=(FileLock&& other) noexcept {
    if (this != &other) {
      release();
      fd_ = std::exchange(other.fd_, -1);
      lock_path_ = std::move(other.lock_path_);
    }
    return *this;
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() { release(); }

  bool held() const { return fd_ >= 0; }
  const std::filesystem::path& lock_path() const { return lock_path_; }

  // Locks `target` for this process, or raises a loom::Error from `who`
  // naming the process that holds it.
  static FileLock acquire(const std::filesystem::path& target, const char* who) {
    const std::filesystem::path lock = target.string() + ".lock";
    for (;;) {
      const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      LOOM_CHECK(fd >= 0, who, ": cannot create the lock file '", lock.string(), "' (",
                 std::strerror(errno), "); the checkpoint's folder must be writable");
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int error = errno;
        const std::string holder = read_holder(fd);
        ::close(fd);
        LOOM_CHECK(error != EWOULDBLOCK, who, ": '", target.string(), "' is being written by ",
                   holder.empty() ? std::string("another process")
                                  : "process " + holder +
                                        (holder == std::to_string(::getpid()) ? " (this one)" : ""),
                   ", which holds '", lock.string(),
                   "'; two runs saving to one file would "
                   "replace each other's checkpoints: give this run another path, or end that "
                   "run first");
        LOOM_FAIL(who, ": flock('", lock.string(), "') failed: ", std::strerror(error));
      }
      // The holder may have removed the file (its release) between our
      // open and our lock: then we hold a lock on a name nobody sees.
      struct stat opened {
      }, named{};
      if (::fstat(fd, &opened) != 0 || ::stat(lock.c_str(), &named) != 0 ||
          opened.st_ino != named.st_ino || opened.st_dev != named.st_dev) {
        ::close(fd);
        continue;
      }
      FileLock held;
      held.fd_ = fd;
      held.lock_path_ = lock;
      // The holder's id, for the message a second run reads (best effort:
      // the lock holds without it).
      const std::string pid = std::to_string(::getpid()) + "\n";
      [[maybe_unused]] const bool recorded =
          ::ftruncate(fd, 0) == 0 &&
          ::write(fd, pid.data(), pid.size()) == static_cast<ssize_t>(pid.size());
      return held;
    }
  }

 private:
  static std::string read_holder(int fd) {
    char text[32] = {};
    const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
    std::string holder(text, n > 0 ? static_cast<std::size_t>(n) : 0);
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    for (const char c : holder)
      if (c < '0' || c > '9') return {};
    return holder;
  }

  // Removed while still locked, so that a process that opened this file
  // and waits for its lock sees that it is gone and makes a new one.
  void release() {
    if (fd_ < 0) return;
    ::unlink(lock_path_.c_str());
    ::close(fd_);
    fd_ = -1;
  }

  int fd_ = -1;
  std::filesystem::path lock_path_;
};

}  // namespace loom::io
