#pragma once
// The library side of `memtune tokenize`: reads an input file, tokenizes it and writes
// ids to a stream, so the command-line tool is a thin wrapper.
#include <cstdint>
#include <filesystem>
#include <ostream>
#include <string>

namespace memtune::cli {

struct TokenizeOptions {
  std::filesystem::path tokenizer;  // tokenizer.json, .model, or a directory holding one
  std::filesystem::path input;      // the file to tokenize
  // jsonl: each input line is a JSON string; each output line the JSON array of its ids.
  // ids:   each input line is plain text; each output line its ids, space-separated.
  // text:  the whole file is one document; one output line of space-separated ids.
  std::string format = "jsonl";
  bool add_special_tokens = false;  // bos/eos as the tokenizer's post-processor adds them
  bool stats = false;               // write a summary line to the stats stream
};

struct TokenizeStats {
  int64_t documents = 0;  // lines (jsonl, ids) or 1 (text)
  int64_t tokens = 0;
  int64_t bytes = 0;      // UTF-8 bytes of the texts tokenized
  double bytes_per_token() const { return tokens ? static_cast<double>(bytes) / tokens : 0.0; }
};

// Tokenizes options.input to `out`. With options.stats, a line "documents N, tokens T,
// bytes B, bytes/token X" goes to `stats_out`. Throws UserError for a bad format, an
// unreadable file, or a malformed JSONL line (file:line and the text near it).
TokenizeStats tokenize_file(const TokenizeOptions& options, std::ostream& out, std::ostream& stats_out);

}  // namespace memtune::cli
