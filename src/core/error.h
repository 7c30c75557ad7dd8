// Errors at API edges: an oomless::Error whose message starts with "[module]" and says what to do.
// The library never calls exit(); asserts are kept for internal invariants only.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace oomless {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

}  // namespace oomless

// OOM_CHECK(cond, "[op] ", details...) throws oomless::Error built from the streamed arguments.
#define OOM_CHECK(cond, ...)                      \
  do {                                            \
    if (!(cond)) ::oomless::fail(__VA_ARGS__);    \
  } while (0)
