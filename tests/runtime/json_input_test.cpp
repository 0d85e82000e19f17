#include <gtest/gtest.h>

#include <string>

#include "runtime/error.h"
#include "runtime/json_input.h"

namespace {

std::string nested(int levels) { return std::string(levels, '[') + std::string(levels, ']'); }

std::string depth_error(const std::string& text) {
  try {
    memtune::check_json_depth(text, "f.json");
  } catch (const memtune::UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(JsonInput, DepthIsBoundedAt128Levels) {
  EXPECT_EQ(depth_error(nested(128)), "");
  const std::string e = depth_error(nested(129));
  EXPECT_NE(e.find("f.json: JSON nested more than 128 levels deep (at byte 128)"), std::string::npos) << e;
  // Objects count as arrays do; depth is the maximum reached, not the total of brackets.
  EXPECT_EQ(depth_error(R"({"a": {"b": [1, {"c": []}]}, "d": [[[]]]})"), "");
  std::string wide;
  for (int i = 0; i < 1000; ++i) wide += nested(100);
  EXPECT_EQ(depth_error("[" + wide + "]"), "");
  EXPECT_NE(depth_error(std::string(100000, '{')), "");  // unbalanced: still refused, never recursed
}

TEST(JsonInput, BracketsInsideStringsDoNotCount) {
  const std::string s = "\"" + std::string(500, '[') + "\\\"" + std::string(500, '{') + "\"";
  EXPECT_EQ(depth_error("[" + s + "]"), "");
  // An escaped backslash ends the escape: the quote after it closes the string.
  EXPECT_NE(depth_error("[\"\\\\\"" + nested(200) + "]"), "");
}

TEST(JsonInput, ParseNamesTheOriginOfInvalidJson) {
  EXPECT_EQ(memtune::parse_json(R"({"a": [1, 2]})", "x.json")["a"][1], 2);
  try {
    memtune::parse_json("{\"a\": ", "x.json");
    FAIL() << "accepted truncated JSON";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("x.json: not valid JSON"), std::string::npos) << e.what();
  }
}

// Found by fuzz/train_state_fuzz.cpp (fuzz/regressions/train_state-*): a number past double's
// range is nlohmann's out_of_range, not a parse_error, and escaped parse_json (exit 1).
TEST(JsonInput, NumbersOutOfRangeAreInvalidJson) {
  try {
    memtune::parse_json(R"({"step": 3, "offset": 6E88888})", "state.json");
    FAIL() << "6E88888 accepted";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("state.json: not valid JSON"), std::string::npos) << e.what();
  }
}
