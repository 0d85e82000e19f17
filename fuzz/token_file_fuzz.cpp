// llm.c token files (.bin: 256 int32 of header, then uint16 or uint32 tokens), read as a
// TokenFile and as a training set of format tokens (with and without the tokenizer's eos).
#include <memory>
#include <vector>

#include "data/dataset.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const auto path = fuzz::write_file("train.bin", data, size);
  fuzz::expect_clean([&] {
    data::TokenFile file(path);
    std::vector<int32_t> tokens;
    file.copy_to(tokens);
    if (static_cast<int64_t>(tokens.size()) != file.size()) std::abort();
  });
  for (const data::Tokenizer* tok : {static_cast<const data::Tokenizer*>(nullptr), &fuzz::tiny_tokenizer()}) {
    fuzz::expect_clean([&] {
      data::DatasetOptions o;
      o.format = "tokens";
      o.max_seq_length = 16;
      data::Dataset ds(path, tok, o);
      for (int64_t i = 0; i < ds.size() && i < 4096; ++i) (void)ds.sample(i);
    });
  }
  return 0;
}
