// A SentencePiece .model (protobuf ModelProto; BPE or unigram), parsed, then used: a fixed text
// and the input's own tail encoded, the ids decoded, every id named.
#include <string>

#include "data/sentencepiece_tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string text = fuzz::as_string(data, size);
  fuzz::expect_clean([&] { fuzz::exercise_tokenizer(data::SentencePieceTokenizer(text, "tokenizer.model"), text); });
  return 0;
}
