// Tokenizer throughput: bytes per second on one core, memtune vs the Hugging Face
// tokenizers library (npm, native Rust build) on the same generated corpus, same run.
//   bench_tokenizer [MEGABYTES=50]
// Tokenizers: Llama 3, Qwen 3, Llama-2-style (from tests/reference/node_modules) and
// memtune's tiny tokenizer. The corpus: ~8 KB documents of English-like prose, code,
// numbers, Chinese, Russian and emoji, deterministic.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace fs = std::filesystem;

namespace {

std::vector<std::string> make_corpus(size_t target_bytes) {
  const std::vector<std::string> words = {
      "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
      "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were",
      "tokenizer", "memory", "training", "gradient", "checkpoint", "adapter", "quantized", "sequence",
      "Hello", "World", "model's", "don't", "we've", "1234", "3.14159", "2024-05-20", "42", "100000"};
  const std::vector<std::string> extras = {
      "\n\ndef f(x):\n    return x * 2  # double\n", "\tint main() { return 0; }\n",
      " 人工智能正在改变世界。", " Привет, как дела?", " 😀👍🏽👨‍👩‍👧", " naïve café ", "  \n  "};
  uint64_t s = 88172645463325252ull;
  auto rnd = [&] { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; };
  std::vector<std::string> docs;
  size_t total = 0;
  while (total < target_bytes) {
    std::string d;
    while (d.size() < 8192) {
      if (rnd() % 16 == 0) d += extras[rnd() % extras.size()];
      else { d += ' '; d += words[rnd() % words.size()]; }
      if (rnd() % 12 == 0) d += rnd() % 2 ? "." : ",";
    }
    total += d.size();
    docs.push_back(std::move(d));
  }
  return docs;
}

// The source tree, from the CMakeCache.txt of the build this binary belongs to.
fs::path source_dir() {
  const fs::path build = fs::read_symlink("/proc/self/exe").parent_path().parent_path();
  std::ifstream cache(build / "CMakeCache.txt");
  for (std::string line; std::getline(cache, line);) {
    const std::string key = "memtune_SOURCE_DIR:STATIC=";
    if (line.rfind(key, 0) == 0) return line.substr(key.size());
  }
  return fs::current_path();
}

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

}  // namespace

int main(int argc, char** argv) {
  const double mb = argc > 1 ? std::atof(argv[1]) : 50.0;
  const fs::path src = source_dir();
  const auto docs = make_corpus(static_cast<size_t>(mb * 1e6));
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const fs::path corpus = fs::temp_directory_path() / "memtune_tokenizer_bench.jsonl";
  {
    std::ofstream f(corpus, std::ios::binary);
    for (const auto& d : docs) f << nlohmann::json(d).dump() << "\n";
  }
  std::printf("corpus: %zu documents, %.1f MB\n", docs.size(), bytes / 1e6);
  std::printf("%-10s %14s %14s %12s %12s\n", "tokenizer", "memtune MB/s", "HF lib MB/s", "memtune tok", "HF tok");
  const fs::path lenml = src / "tests" / "reference" / "node_modules" / "@lenml";
  const std::vector<std::pair<std::string, fs::path>> toks = {
      {"llama3", lenml / "tokenizer-llama3" / "models"},
      {"qwen3", lenml / "tokenizer-qwen3" / "models"},
      {"llama2", lenml / "tokenizer-llama2" / "models"},
      {"tiny", src / "examples" / "tiny-tokenizer"}};
  for (const auto& [name, dir] : toks) {
    if (!fs::exists(dir / "tokenizer.json")) {
      std::printf("%-10s (missing %s: run scripts/setup_node.sh)\n", name.c_str(), dir.c_str());
      continue;
    }
    const auto tok = memtune::data::Tokenizer::load(dir);
    const double c0 = cpu_seconds();
    size_t n_tokens = 0;
    for (const auto& d : docs) n_tokens += tok->encode(d, false).size();
    const double ours = bytes / (cpu_seconds() - c0) / 1e6;
    double theirs = 0;
    long their_tokens = -1;
    const std::string cmd = "node '" + (src / "bench" / "tokenizer_bench.js").string() + "' '" +
                            (dir / "tokenizer.json").string() + "' '" + corpus.string() + "'";
    if (FILE* p = popen(cmd.c_str(), "r")) {
      char buf[4096];
      std::string outp;
      while (fgets(buf, sizeof buf, p)) outp += buf;
      if (pclose(p) == 0) {
        const auto j = nlohmann::json::parse(outp);
        theirs = j["bytes"].get<double>() / j["cpu_s"].get<double>() / 1e6;
        their_tokens = j["tokens"].get<long>();
      }
    }
    std::printf("%-10s %14.2f %14.2f %12zu %12ld\n", name.c_str(), ours, theirs, n_tokens, their_tokens);
    std::fflush(stdout);
  }
  fs::remove(corpus);
  return 0;
}
