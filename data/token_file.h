#pragma once
// Pre-tokenized token files in llm.c's format (dev/data/data_common.py): a header of 256
// int32 (magic, version, token count, zeros), then the tokens little-endian.
//   magic 20240520, version 1: uint16 tokens (llm.c "gpt-2"; vocabularies up to 65536)
//   magic 20240801, version 7: uint32 tokens (llm.c "llama-3"; larger vocabularies)
// Both are read; write_token_file picks the first whenever the vocabulary allows.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

namespace memtune::data {

class MappedFile;

constexpr int32_t kTokenFileMagic16 = 20240520;
constexpr int32_t kTokenFileVersion16 = 1;
constexpr int32_t kTokenFileMagic32 = 20240801;
constexpr int32_t kTokenFileVersion32 = 7;
constexpr int64_t kTokenFileHeaderInts = 256;

// A memory-mapped token file. Throws UserError for a wrong magic or version, a header
// whose token count disagrees with the file size (truncated or trailing bytes).
class TokenFile {
 public:
  explicit TokenFile(const std::filesystem::path& path);
  ~TokenFile();

  int64_t size() const { return count_; }              // tokens
  int bytes_per_token() const { return width_; }       // 2 or 4
  uint32_t operator[](int64_t i) const {
    const unsigned char* p = tokens_ + i * width_;
    return width_ == 2 ? uint32_t(p[0]) | uint32_t(p[1]) << 8
                       : uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  }
  void copy_to(std::vector<int32_t>& out) const;       // appends all tokens

 private:
  std::unique_ptr<MappedFile> file_;
  const unsigned char* tokens_ = nullptr;
  int64_t count_ = 0;
  int width_ = 2;
};

// Writes `tokens` atomically (temporary file, then rename): uint16 when vocab_size <= 65536,
// else uint32. Every token must be < vocab_size.
void write_token_file(const std::filesystem::path& path, const std::vector<uint32_t>& tokens,
                      int64_t vocab_size);

}  // namespace memtune::data
