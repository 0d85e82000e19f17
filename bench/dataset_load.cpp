// Dataset loading: a cold load (parse, render, tokenize, write the cache) against a
// second load from the tokenized cache, on a generated instruction JSONL file.
// A byte tokenizer keeps tokenization cheap, so the cold figure is mostly JSON parsing
// and rendering; with a real BPE tokenizer the cold load is slower and the cache's gain larger.
//   bench_dataset_load [MB]   (default 50)
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "runtime/atomic_file.h"

namespace {
class ByteTokenizer : public memtune::data::Tokenizer {
 public:
  ByteTokenizer() { eos_id = 257; bos_id = 256; }
  std::vector<int32_t> encode(std::string_view text, bool special) const override {
    std::vector<int32_t> ids;
    if (special) ids.push_back(256);
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int32_t>&, bool) const override { return {}; }
  int64_t vocab_size() const override { return 258; }
  std::optional<int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  std::string id_to_token(int32_t id) const override { return std::to_string(id); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const double mb = argc > 1 ? std::stod(argv[1]) : 50;
  const fs::path dir = fs::temp_directory_path() / ("memtune_bench_dataset_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path file = dir / "train.jsonl";
  {
    std::ofstream out(file);
    for (int64_t i = 0; out.tellp() < mb * 1e6; ++i)
      out << "{\"instruction\": \"Summarize the following note number " << i
          << ".\", \"input\": \"The quick brown fox jumps over the lazy dog; \\\"quoted\\\" text and numbers "
          << i * 7919 << ".\", \"output\": \"A fox jumps over a dog (" << i << ").\"}\n";
  }
  ByteTokenizer tok;
  memtune::data::DatasetOptions o;
  o.format = "instruction";
  o.max_seq_length = 1024;
  o.cache_dir = (dir / "cache").string();
  const double bytes = static_cast<double>(fs::file_size(file));

  auto t0 = std::chrono::steady_clock::now();
  memtune::data::Dataset cold(file, &tok, o);
  const double cold_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  memtune::data::Dataset warm(file, &tok, o);
  const double warm_s = seconds_since(t0);

  std::printf("file %.1f MB, %lld documents, %lld tokens, %lld packed samples\n", bytes / 1e6,
              static_cast<long long>(cold.stats().documents), static_cast<long long>(cold.stats().tokens),
              static_cast<long long>(cold.stats().samples));
  std::printf("cold load (tokenize + write cache): %.3f s  (%.1f MB/s)\n", cold_s, bytes / 1e6 / cold_s);
  std::printf("cached load:                        %.3f s  (%.1f MB/s)  from_cache=%d\n", warm_s,
              bytes / 1e6 / warm_s, warm.from_cache());
  memtune::remove_tree(dir);
}
