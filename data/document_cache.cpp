#include "data/document_cache.h"


#include <cstring>

#include "data/mapped_file.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"

namespace memtune::data {
namespace {

// Layout (little-endian): "MTDOCS01", u64 key length, key bytes, i64 documents, i64 tokens,
// i64 trained bytes, i64 skipped_invalid, offsets (i64 x documents+1), tokens (i32),
// trained (u8), then u64 FNV-1a of everything before it.
constexpr char kMagic[8] = {'M', 'T', 'D', 'O', 'C', 'S', '0', '1'};

struct Reader {
  std::string_view data;
  size_t pos = 0;
  bool take(void* dst, size_t n) {
    if (data.size() - pos < n) return false;
    std::memcpy(dst, data.data() + pos, n);
    pos += n;
    return true;
  }
  template <class T> bool take_vector(std::vector<T>& v, int64_t n) {
    if (n < 0 || static_cast<uint64_t>(n) > (data.size() - pos) / sizeof(T)) return false;
    v.resize(n);
    return take(v.data(), n * sizeof(T));
  }
};

}  // namespace

void Documents::add(const std::vector<int32_t>& ids, const std::vector<uint8_t>& mask) {
  tokens.insert(tokens.end(), ids.begin(), ids.end());
  trained.insert(trained.end(), mask.begin(), mask.end());
  offsets.push_back(static_cast<int64_t>(tokens.size()));
}

bool read_document_cache(const std::filesystem::path& path, const std::string& key, Documents& out) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  MappedFile file(path);
  const std::string_view all = file.view();
  if (all.size() < sizeof kMagic + 8) return false;
  uint64_t stored_sum;
  std::memcpy(&stored_sum, all.data() + all.size() - 8, 8);
  Reader r{all.substr(0, all.size() - 8)};
  if (fnv1a64(r.data) != stored_sum) return false;
  char magic[8];
  uint64_t key_len;
  if (!r.take(magic, 8) || std::memcmp(magic, kMagic, 8) != 0 || !r.take(&key_len, 8)) return false;
  if (key_len != key.size() || r.data.size() - r.pos < key_len || r.data.substr(r.pos, key_len) != key) return false;
  r.pos += key_len;
  int64_t n_docs, n_tokens, n_trained;
  Documents docs;
  if (!r.take(&n_docs, 8) || !r.take(&n_tokens, 8) || !r.take(&n_trained, 8) || !r.take(&docs.skipped_invalid, 8))
    return false;
  if (n_docs < 0 || (n_trained != 0 && n_trained != n_tokens)) return false;
  if (!r.take_vector(docs.offsets, n_docs + 1) || !r.take_vector(docs.tokens, n_tokens) ||
      !r.take_vector(docs.trained, n_trained) || r.pos != r.data.size())
    return false;
  if (docs.offsets.front() != 0 || docs.offsets.back() != n_tokens) return false;
  for (int64_t d = 0; d < n_docs; ++d)
    if (docs.offsets[d + 1] < docs.offsets[d]) return false;
  out = std::move(docs);
  return true;
}

void write_document_cache(const std::filesystem::path& path, const std::string& key, const Documents& docs) {
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  MEMTUNE_CHECK(!ec, "cannot create the dataset cache directory ", path.parent_path().string(), ": ",
                ec.message(), "; set data.cache_dir to a writable directory");
  AtomicFile out(path);  // a failure or a kill leaves no partial cache and no temporary behind
  uint64_t sum = kFnv1aOffset;  // streamed: the cache is never held twice in memory
  auto put = [&](const void* p, size_t n) {
    sum = fnv1a64(std::string_view(static_cast<const char*>(p), n), sum);
    out.write(p, n);
  };
  const uint64_t key_len = key.size();
  const int64_t n_docs = docs.size(), n_tokens = docs.tokens.size(), n_trained = docs.trained.size();
  put(kMagic, 8);
  put(&key_len, 8);
  put(key.data(), key.size());
  put(&n_docs, 8);
  put(&n_tokens, 8);
  put(&n_trained, 8);
  put(&docs.skipped_invalid, 8);
  put(docs.offsets.data(), docs.offsets.size() * 8);
  put(docs.tokens.data(), docs.tokens.size() * 4);
  put(docs.trained.data(), docs.trained.size());
  out.write(&sum, 8);
  out.commit();
}

}  // namespace memtune::data
