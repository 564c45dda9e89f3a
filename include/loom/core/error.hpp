// loom::Error and the check macros. Library code never exits: every failure
// becomes an Error whose message says what went wrong, where, and what to do.
#pragma once

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A resumed fit with a setting other than the run that wrote the
// checkpoint: `setting` names it as FitOptions or the optimizer's options
// do ("batch_size", "momentum"), so that a program can name its own flag.
class ResumeMismatch : public Error {
 public:
  ResumeMismatch(const std::string& what, std::string setting_, std::string was_,
                 std::string now_)
      : Error(what), setting(std::move(setting_)), was(std::move(was_)), now(std::move(now_)) {}
  std::string setting, was, now;
};

namespace detail {

// A message being built: its stream is made, and the Error thrown, out of
// line, so that each raise<Parts...> below holds only its parts' `<<`s (a
// program has hundreds of them).
class Message {
 public:
  [[gnu::noinline]] Message() { out_ << "loom: "; }
  [[gnu::noinline]] ~Message() = default;
  std::ostream& stream() { return out_; }
  [[noreturn, gnu::noinline]] void raise(const char* file, int line) {
    out_ << " [" << file << ':' << line << ']';
    throw Error(out_.str());
  }

 private:
  std::ostringstream out_;
};

template <class... Parts>
[[noreturn]] void raise(const char* file, int line, const Parts&... parts) {
  Message message;
  (message.stream() << ... << parts);
  message.raise(file, line);
}

}  // namespace detail

// A loss value for a message: "nan" for any NaN (its sign bit says nothing,
// and a GPU may set it), else the number as streamed.
inline std::string loss_text(double loss) {
  if (std::isnan(loss)) return "nan";
  std::ostringstream text;
  text << loss;
  return text.str();
}

}  // namespace loom

// Throws loom::Error with the streamed message parts when `condition` is false.
#define LOOM_CHECK(condition, ...)                                            \
  do {                                                                        \
    if (!(condition)) ::loom::detail::raise(__FILE__, __LINE__, __VA_ARGS__); \
  } while (false)

#define LOOM_FAIL(...) ::loom::detail::raise(__FILE__, __LINE__, __VA_ARGS__)
