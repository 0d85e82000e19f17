#include "models/module_regex.h"

#include <algorithm>
#include <cctype>

#include "runtime/error.h"

namespace memtune::models {

std::string python_regex_problem(const std::string& pattern) {
  bool in_class = false, after_repeat = false, lazy = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;  // an escape is one item
      after_repeat = false;
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      continue;
    }
    size_t end = i;  // a {m}, {m,}, {,n} or {m,n} repeat ends at `end`; other braces are literals
    if (c == '{') {
      size_t j = i + 1;
      while (j < pattern.size() && (std::isdigit(static_cast<unsigned char>(pattern[j])) || pattern[j] == ',')) ++j;
      if (j < pattern.size() && pattern[j] == '}' && j > i + 1 &&
          std::count(pattern.begin() + static_cast<std::ptrdiff_t>(i), pattern.begin() + static_cast<std::ptrdiff_t>(j), ',') <= 1)
        end = j;
    }
    const bool repeat = c == '*' || c == '+' || c == '?' || end > i;
    if (!repeat) {
      after_repeat = false;
      if (c == '[') {
        in_class = true;
        const size_t start = i;
        if (i + 1 < pattern.size() && pattern[i + 1] == '^') ++i;
        if (i + 1 < pattern.size() && pattern[i + 1] == ']')  // Python: a literal; std::regex: the class's end
          return str_cat("a ']' first in the character class at position ", start,
                         ", which Python reads as a literal and std::regex as the end of an empty class; "
                         "write \\] for the same pattern in both");
      }
      continue;
    }
    if (after_repeat && !lazy && c == '?') {
      lazy = true;
      continue;
    }
    if (after_repeat && !lazy && c == '+')
      return str_cat("a possessive repeat ('+' after a repeat) at position ", i,
                     ", which std::regex does not have (Python before 3.11 refuses it as a multiple repeat)");
    if (after_repeat) return str_cat("multiple repeat at position ", i, ", as Python's re refuses it");
    after_repeat = true;
    lazy = false;
    i = end;
  }
  return "";
}

std::regex module_regex(const std::string& source) {
#ifdef __GLIBCXX__
  return std::regex(source, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
  return std::regex(source);
#endif
}

std::string compile_module_regex(const std::string& pattern, std::regex& out, const std::string& prefix,
                                 const std::string& suffix) {
  std::string problem = python_regex_problem(pattern);
  if (!problem.empty()) return problem;
  try {
    out = module_regex(prefix + pattern + suffix);
  } catch (const std::regex_error& e) {
    problem = e.what();
  }
  return problem;
}

}  // namespace memtune::models
