// Module-name regexes as Python's re reads them: what it refuses is refused (the verdicts
// below are CPython 3.11.2's re.compile on each pattern), and matching takes polynomial time
// where Python's own backtracking would not.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "models/lora.h"
#include "models/module_regex.h"
#include "runtime/error.h"

namespace memtune::models {
namespace {

TEST(ModuleRegex, RefusesWhatPythonRefuses) {
  struct Case {
    const char* pattern;
    const char* python;  // CPython 3.11.2's re.error, or "" where it compiles
  };
  const std::vector<Case> cases = {
      {".**", "multiple repeat at position 2"},   {"a+{2}", "multiple repeat at position 2"},
      {"a*?*", "multiple repeat at position 3"},  {"a{2}*", "multiple repeat at position 4"},
      {"a**", "multiple repeat at position 2"},
      {"a??", ""},  {"a*?", ""},  {"a{2}?", ""},  {"x{,3}", ""},     {"a{x}*", ""},  {"a{}*", ""},
      {"[*+]+", ""}, {"\\*+", ""}, {"\\**", ""},  {"(a*)*", ""},     {"a{1,2,3}*", ""},
      {"(?:a)*", ""}, {".*\\.(q|k)_proj", ""},    {"q_proj", ""},
  };
  for (const Case& c : cases) {
    const std::string problem = python_regex_problem(c.pattern);
    if (*c.python == '\0')
      EXPECT_EQ(problem, "") << c.pattern;
    else
      EXPECT_NE(problem.find(c.python), std::string::npos) << c.pattern << ": " << problem;
  }
  // Python 3.11 reads a{2,}+ as possessive; std::regex would nest the repeats. Refused by name.
  EXPECT_NE(python_regex_problem("a{2,}+").find("possessive"), std::string::npos);
  EXPECT_NE(python_regex_problem("q_proj*+").find("possessive"), std::string::npos);
  // A ] first in a class: a literal in Python ([]*]* compiles there, [^]*]+* is a multiple repeat),
  // the end of an empty class in ECMAScript. Refused by name.
  for (const char* p : {"[]*]*", "[^]*]+*", "[]a]", "[]a**]"})
    EXPECT_NE(python_regex_problem(p).find("first in the character class"), std::string::npos) << p;
  EXPECT_EQ(python_regex_problem("[a\\]]"), "");
  // Nothing to repeat: Python refuses, and so does std::regex.
  for (const char* p : {"*a", "a|*", "(*)"}) EXPECT_THROW(module_regex(p), std::regex_error) << p;
}

// Found by fuzz/adapter_config_fuzz.cpp (fuzz/regressions/adapter_config-eab4d652276c): a
// target_modules of ".**\\.z(q|k)_proj" held the reader for over 10 s in std::regex's
// backtracking. Refused now, with Python's words; and (.*)*, which Python compiles, matches
// at once instead of in 2^n steps (Python's re takes 19 s over a 28-character name).
TEST(ModuleRegex, NestedRepeatsMatchInPolynomialTime) {
  try {
    (void)target_regex(".**\\.z(q|k)_proj", "adapter_config.json");
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("multiple repeat at position 2"), std::string::npos) << e.what();
  }
  const std::regex nested = target_regex("(.*)*\\.z(q|k)_proj", "test");
  const std::string name = "model.layers.12.self_attn.q_proj" + std::string(60, 'x');
  EXPECT_FALSE(std::regex_match(name, nested));
  EXPECT_TRUE(std::regex_match("model.layers.0.self_attn.zq_proj", nested));
  const std::regex pattern = lora_pattern_regex("(.+)+_proj", "test");
  EXPECT_FALSE(std::regex_match("model.layers.0.mlp.gate" + std::string(60, 'y'), pattern));
  EXPECT_TRUE(std::regex_match("model.layers.0.mlp.gate_proj", pattern));
}

}  // namespace
}  // namespace memtune::models
