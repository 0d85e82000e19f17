#pragma once
// A read-only memory-mapped file (large datasets are paged in by the OS, never copied
// whole), and FNV-1a, the 64-bit hash that keys the tokenized cache.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>

namespace memtune::data {

class MappedFile {
 public:
  // Throws UserError naming the file when it cannot be opened or mapped.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const char* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view view() const { return {data_, size_}; }

 private:
  const char* data_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
};

constexpr uint64_t kFnv1aOffset = 14695981039346656037ULL;
// FNV-1a 64 of `bytes`, continuing from `hash` (chain calls to hash several buffers).
uint64_t fnv1a64(std::string_view bytes, uint64_t hash = kFnv1aOffset);

}  // namespace memtune::data
