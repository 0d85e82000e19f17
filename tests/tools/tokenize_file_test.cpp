// The library side of `memtune tokenize` on the tiny tokenizer, whose first 256 ids are
// the bytes (so "A" is 65 and "<|begin_of_text|>" is 1019, the first special).
#include <gtest/gtest.h>

#include <sstream>

#include "tools/tokenize_file.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

cli::TokenizeOptions options(const fs::path& input, const std::string& format) {
  cli::TokenizeOptions o;
  o.tokenizer = source_dir() / "examples" / "tiny-tokenizer";
  o.input = input;
  o.format = format;
  return o;
}

TEST(TokenizeCommand, JsonlLinesBecomeIdArrays) {
  const fs::path in = temp_dir() / "in.jsonl";
  write_file(in, "\"A\"\n\"\"\n\"A<|end_of_text|>\"\n");
  std::ostringstream out, stats;
  auto o = options(in, "jsonl");
  o.stats = true;
  const auto s = cli::tokenize_file(o, out, stats);
  EXPECT_EQ(out.str(), "[65]\n[]\n[65,1020]\n");
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.tokens, 3);
  EXPECT_EQ(s.bytes, 1 + 0 + 16);
  EXPECT_EQ(stats.str(), "documents 3, tokens 3, bytes 17, bytes/token 5.66667\n");

  std::ostringstream out2, none;
  o.add_special_tokens = true;
  o.stats = false;
  cli::tokenize_file(o, out2, none);
  EXPECT_EQ(out2.str(), "[1019,65]\n[1019]\n[1019,65,1020]\n");
  EXPECT_EQ(none.str(), "");
}

TEST(TokenizeCommand, IdsAndTextFormats) {
  const fs::path in = temp_dir() / "in.txt";
  write_file(in, "A\nA\n");
  std::ostringstream ids, text, stats;
  cli::tokenize_file(options(in, "ids"), ids, stats);
  EXPECT_EQ(ids.str(), "65\n65\n");
  cli::tokenize_file(options(in, "text"), text, stats);
  EXPECT_EQ(text.str(), "65 10 65 10\n");  // "\n" is byte 10; no merge of "A\n" in the tiny vocab
}

TEST(TokenizeCommand, BadLineNamesFileAndLine) {
  const fs::path in = temp_dir() / "bad.jsonl";
  write_file(in, "\"ok\"\n{not json\n");
  std::ostringstream out, stats;
  try {
    cli::tokenize_file(options(in, "jsonl"), out, stats);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("{not json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cli::tokenize_file(options(in, "csv"), out, stats), UserError);
}

}  // namespace
}  // namespace memtune::testing
