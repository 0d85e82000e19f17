// tokenizer.json (BPE, byte-level or with byte fallback), parsed, then used: a fixed text
// and the input's own tail encoded, the ids decoded, every id named.
#include <string>
#include <vector>

#include "data/bpe_tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::string text = fuzz::as_string(data, size);
  fuzz::expect_clean([&] {
    data::BpeTokenizer tok(text, "tokenizer.json");
    const std::string sample = "Hello, world! 123 h\xC3\xA9llo\n\t<s> " + text.substr(text.size() - std::min<size_t>(text.size(), 64));
    for (bool special : {false, true}) {
      std::vector<int32_t> ids = tok.encode(sample, special);
      for (int32_t id : ids)
        if (id < 0 || id >= tok.vocab_size()) std::abort();
      (void)tok.decode(ids, special);
    }
    const int64_t n = std::min<int64_t>(tok.vocab_size(), 512);
    std::vector<int32_t> all;
    for (int32_t id = 0; id < n; ++id) {
      (void)tok.token_to_id(tok.id_to_token(id));
      all.push_back(id);
    }
    (void)tok.decode(all, false);
    (void)tok.decode(all, true);
  });
  return 0;
}
