// loom::Error and the check macros. Library code never exits: every failure
// becomes an Error whose message says what went wrong, where, and what to do.
#pragma once

#include <cmath>
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
