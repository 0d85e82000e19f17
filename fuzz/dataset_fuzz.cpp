// Training data files (data/dataset.h): the first byte picks the format (text,
// instruction, chat with each template, plain, auto) and the options, the rest is the
// file; every sample is then built, as the trainer does.
#include <memory>

#include "data/bpe_tokenizer.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  static const char* formats[] = {"text", "instruction", "chat", "chat", "chat", "auto", "plain", "auto"};
  static const char* templates[] = {"alpaca", "alpaca", "llama-3", "chatml", "alpaca", "gemma", "alpaca", "chatml"};
  data::DatasetOptions o;
  o.format = formats[mode & 7];
  o.template_name = templates[mode & 7];
  o.max_seq_length = (mode & 8) ? 16 : 64;
  o.pack_sequences = mode & 16;
  o.truncation = (mode & 32) ? "drop" : "right";
  o.train_on_prompt = mode & 64;
  o.skip_invalid = mode & 128;
  const auto path = fuzz::write_file(o.format == "plain" ? "train.txt" : "train.jsonl", data + 1, size - 1);
  fuzz::expect_clean([&] {
    data::Dataset ds(path, &fuzz::tiny_tokenizer(), o);
    for (int64_t i = 0; i < ds.size(); ++i) {
      data::Sample s = ds.sample(i);
      if (ds.sample_length(i) > o.max_seq_length) std::abort();
      (void)s;
    }
  });
  return 0;
}
