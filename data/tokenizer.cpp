#include "data/tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/bpe_tokenizer.h"
#include "data/sentencepiece_tokenizer.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::data {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MEMTUNE_CHECK(in, path.string(), ": cannot open the tokenizer file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A special token in tokenizer_config.json: a string, an AddedToken object, or null.
std::optional<std::string> token_string(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

void apply_config(Tokenizer& tok, const fs::path& path) {
  const json cfg = parse_json(read_all(path), path.string());
  MEMTUNE_CHECK(cfg.is_object(), path.string(), ": expected a JSON object");
  auto resolve = [&](const char* key) -> std::optional<int32_t> {
    auto s = token_string(cfg, key);
    if (!s) return std::nullopt;
    auto id = tok.token_to_id(*s);
    MEMTUNE_CHECK(id.has_value(), path.string(), ": ", key, " \"", *s, "\" is not a token of the tokenizer");
    return id;
  };
  if (auto id = resolve("bos_token")) tok.bos_id = id;
  if (auto id = resolve("eos_token")) tok.eos_id = id;
  if (auto id = resolve("pad_token")) tok.pad_id = id;
  if (cfg.contains("chat_template")) {
    const json& t = cfg["chat_template"];
    if (t.is_string()) {
      tok.chat_template = t.get<std::string>();
    } else if (t.is_array()) {  // [{name, template}, ...]: the "default" one, else the first
      for (const auto& e : t) {
        if (tok.chat_template.empty() || e.value("name", "") == "default")
          tok.chat_template = e.value("template", "");
      }
    }
  }
  // add_bos_token / add_eos_token, when given, decide the special tokens of encode(), as
  // transformers' Llama tokenizers rebuild their post-processor from them.
  if (cfg.contains("add_bos_token") || cfg.contains("add_eos_token")) {
    const bool add_bos = cfg.value("add_bos_token", false) && tok.bos_id;
    const bool add_eos = cfg.value("add_eos_token", false) && tok.eos_id;
    std::vector<int32_t> prefix, suffix;
    if (add_bos) prefix.push_back(*tok.bos_id);
    if (add_eos) suffix.push_back(*tok.eos_id);
    tok.set_special_affixes(prefix, suffix);
  }
}

}  // namespace

void Tokenizer::set_special_affixes(std::vector<int32_t>, std::vector<int32_t>) {
  fail("this tokenizer cannot change the special tokens it adds (tokenizer_config.json's add_bos_token / "
       "add_eos_token); remove those keys or use a tokenizer.json / SentencePiece .model tokenizer");
}

std::unique_ptr<Tokenizer> Tokenizer::load(const fs::path& path) {
  MEMTUNE_CHECK(fs::exists(path), path.string(), ": no such tokenizer file or directory",
                "; give a tokenizer.json, a SentencePiece .model, or a directory holding one");
  fs::path file = path;
  if (fs::is_directory(path)) {
    if (fs::exists(path / "tokenizer.json")) {
      file = path / "tokenizer.json";
    } else if (fs::exists(path / "tokenizer.model")) {
      file = path / "tokenizer.model";
    } else {
      fail(path.string(), ": directory holds neither tokenizer.json nor tokenizer.model");
    }
  }
  std::unique_ptr<Tokenizer> tok;
  if (file.extension() == ".model") {
    tok = std::make_unique<SentencePieceTokenizer>(read_all(file), file.string());
  } else {
    tok = std::make_unique<BpeTokenizer>(read_all(file), file.string());
  }
  const fs::path cfg = file.parent_path() / "tokenizer_config.json";
  if (fs::exists(cfg)) apply_config(*tok, cfg);
  return tok;
}

}  // namespace memtune::data
