#pragma once
// Regular expressions over module names, as Python's re (PEFT's, transformers') reads them.
#include <regex>
#include <string>

namespace memtune::models {

// Where Python's re refuses `pattern` and std::regex would take it: a repeat on a repeat
// ("multiple repeat": `.**`, `a+{2}`; std::regex nests them, and matching `(x*)*`
// backtracks exponentially), or Python 3.11's possessive `*+`, which std::regex reads as
// such a nest; or a `]` first in a class (`[]a]`: a literal in Python, an empty class in
// ECMAScript). A `?` after a repeat makes it lazy, in both. "" where Python takes it.
std::string python_regex_problem(const std::string& pattern);

// `source` compiled so that matching takes polynomial time where the library offers it
// (libstdc++'s Thompson executor: module-name patterns have no back-references to need
// backtracking). A pattern Python accepts can otherwise backtrack exponentially (`(.*)*x`
// over a 30-character name: seconds, in Python's re too). Throws std::regex_error.
std::regex module_regex(const std::string& source);

// Why `pattern` is no regular expression to Python's re and std::regex alike (python_regex_problem's
// reason, or std::regex's), or "" with `out` holding prefix + pattern + suffix compiled by
// module_regex (the affixes: the matching a caller wraps the pattern in).
std::string compile_module_regex(const std::string& pattern, std::regex& out, const std::string& prefix = "",
                                 const std::string& suffix = "");

}  // namespace memtune::models
