// loom::Error and the check macros. Library code never exits: every failure
// becomes an Error whose message says what went wrong, where, and what to do.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Parts>
[[noreturn]] void raise(const char* file, int line, const Parts&... parts) {
  std::ostringstream message;
  message << "loom: ";
  (message << ... << parts);
  message << " [" << file << ':' << line << ']';
  throw Error(message.str());
}

}  // namespace detail
}  // namespace loom

// Throws loom::Error with the streamed message parts when `condition` is false.
#define LOOM_CHECK(condition, ...)                                            \
  do {                                                                        \
    if (!(condition)) ::loom::detail::raise(__FILE__, __LINE__, __VA_ARGS__); \
  } while (false)

#define LOOM_FAIL(...) ::loom::detail::raise(__FILE__, __LINE__, __VA_ARGS__)
