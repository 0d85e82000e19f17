#pragma once
// SentencePiece .model files (a protobuf ModelProto), read by memtune's own wire-format
// parser: Debian's libsentencepiece links protobuf-lite, which clashes with LibTorch's
// protobuf. BPE-type models are encoded as sentencepiece does (highest-score merge first,
// leftmost among equals) and unigram models by Viterbi over piece scores, with byte fallback.
// Control and user-defined pieces found in the text are kept whole, as transformers does.
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace memtune::data {

class SentencePieceTokenizer : public Tokenizer {
 public:
  // `bytes`: the .model file's content; `origin` names it in errors.
  SentencePieceTokenizer(const std::string& bytes, const std::string& origin);
  ~SentencePieceTokenizer() override;

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
