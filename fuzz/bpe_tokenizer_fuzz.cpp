// tokenizer.json (BPE, byte-level or with byte fallback), parsed, then used: a fixed text
// and the input's own tail encoded, the ids decoded, every id named.
#include <string>

#include "data/bpe_tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string text = fuzz::as_string(data, size);
  fuzz::expect_clean([&] { fuzz::exercise_tokenizer(data::BpeTokenizer(text, "tokenizer.json"), text); });
  return 0;
}
