#pragma once
// Two kinds of failure, kept apart as PyTorch keeps TORCH_CHECK and TORCH_INTERNAL_ASSERT:
// - UserError (MEMTUNE_CHECK): the caller's input is wrong. The message says what, where,
//   the value seen and a hint; the command exits 2 ("bad input").
// - InternalError (MEMTUNE_INTERNAL_ASSERT): memtune broke its own invariant, whatever the
//   input. It names the source line and the condition; the command exits 70 (sysexits'
//   EX_SOFTWARE) and asks for a bug report.
// Only tools/ turns them into exit codes (docs/CONTRIBUTING.md, "Errors").
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace memtune {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
};

class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, T&& first, Rest&&... rest) {
  os << std::forward<T>(first);
  append(os, std::forward<Rest>(rest)...);
}
}  // namespace detail

// Concatenates its arguments with operator<< (like TORCH_CHECK's message).
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  detail::append(os, std::forward<Args>(args)...);
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  throw UserError(str_cat(std::forward<Args>(args)...));
}

}  // namespace memtune

// Checks an invariant of memtune's own code: false means a bug here, not bad input.
#define MEMTUNE_INTERNAL_ASSERT(cond, ...)                                                            \
  do {                                                                                                \
    if (!(cond))                                                                                      \
      throw ::memtune::InternalError(                                                                 \
          ::memtune::str_cat(__FILE__, ":", __LINE__, ": ", #cond, " does not hold: ", __VA_ARGS__)); \
  } while (0)

// Checks a user-facing condition; the message says what, where, the value and a hint.
#define MEMTUNE_CHECK(cond, ...)            \
  do {                                      \
    if (!(cond)) ::memtune::fail(__VA_ARGS__); \
  } while (0)
