#pragma once
// User-facing errors. Library code throws these with what was wrong, where, the value
// seen and a hint; only tools/ turns them into exit codes (STYLE.md rule 7).
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace memtune {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message) {}
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

// Checks a user-facing condition; the message says what, where, the value and a hint.
#define MEMTUNE_CHECK(cond, ...)            \
  do {                                      \
    if (!(cond)) ::memtune::fail(__VA_ARGS__); \
  } while (0)
