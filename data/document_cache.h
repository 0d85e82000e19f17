#pragma once
// Tokenized documents, and their on-disk cache: a binary file written atomically
// (temporary file, then rename) and validated on read (magic, key, sizes, checksum), so a
// corrupt or stale cache is rebuilt, never trusted.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace memtune::data {

// Documents stored back to back: document d is tokens[offsets[d], offsets[d+1]) (a
// token file's documents index the mapped file instead, and may start past 0).
struct Documents {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> trained;   // per token: 1 when it is a target; empty: all trained
  std::vector<int64_t> offsets{0};
  int64_t skipped_invalid = 0;    // malformed records skipped under skip_invalid

  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t length(int64_t d) const { return offsets[d + 1] - offsets[d]; }
  bool is_trained(int64_t i) const { return trained.empty() || trained[i] != 0; }
  void add(const std::vector<int32_t>& ids, const std::vector<uint8_t>& mask);
};

// False (and `out` untouched) when the file is absent, from another key, or damaged.
bool read_document_cache(const std::filesystem::path& path, const std::string& key, Documents& out);
// Throws UserError when the directory cannot be created or written.
void write_document_cache(const std::filesystem::path& path, const std::string& key, const Documents& docs);

}  // namespace memtune::data
