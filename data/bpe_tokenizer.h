#pragma once
// Hugging Face tokenizer.json with a BPE model: byte-level (GPT-2, Llama 3, Qwen) or with
// byte fallback and Metaspace/Replace/Prepend normalizers (Llama 2, Mistral). The pipeline
// follows the tokenizers library: added tokens split out first and never split further,
// normalizer, pre-tokenizer (PCRE2 regexes with Unicode properties), BPE merges by rank,
// post-processor (TemplateProcessing) when special tokens are asked for; decode runs the
// decoder chain.
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace memtune::data {

class BpeTokenizer : public Tokenizer {
 public:
  // Parses tokenizer.json text; `origin` (the file) names it in errors. Throws UserError
  // naming the file, the key and what is wrong.
  BpeTokenizer(const std::string& json_text, const std::string& origin);
  ~BpeTokenizer() override;

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const override;
  int64_t vocab_size() const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int32_t id) const override;
  void set_special_affixes(std::vector<int32_t> prefix, std::vector<int32_t> suffix) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune::data
