#pragma once
// Tokenizers whose ids equal Hugging Face's: tokenizer.json (BPE, byte-level or with
// byte fallback), and SentencePiece .model files.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace memtune::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // A tokenizer.json file, a SentencePiece .model file, or a directory holding one of them
  // (and tokenizer_config.json, read for bos/eos/pad, add_bos_token/add_eos_token and
  // chat_template). Throws UserError naming the file and what is wrong.
  static std::unique_ptr<Tokenizer> load(const std::filesystem::path& path);

  // Ids as Hugging Face's `tokenizer(text, add_special_tokens=...)` gives them.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const = 0;
  // Text as `tokenizer.decode(ids, skip_special_tokens=...)` gives it.
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const = 0;

  virtual int64_t vocab_size() const = 0;  // highest id + 1, added tokens included
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::string id_to_token(int32_t id) const = 0;
  // Replaces the special tokens encode(text, true) puts before and after the text
  // (tokenizer_config.json's add_bos_token / add_eos_token, as transformers' Llama
  // tokenizers rebuild their post-processor from them). A tokenizer that cannot refuses
  // with a UserError rather than ignore the setting.
  virtual void set_special_affixes(std::vector<int32_t> prefix, std::vector<int32_t> suffix);

  std::optional<int32_t> bos_id, eos_id, pad_id;
  std::string chat_template;  // from tokenizer_config.json, empty when absent
};

}  // namespace memtune::data
