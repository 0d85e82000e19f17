#include "data/token_file.h"


#include <cstring>

#include "data/mapped_file.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"

namespace memtune::data {
namespace {

int32_t read_i32(const char* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);  // the format is little-endian, like every host we build for
  return v;
}

}  // namespace

TokenFile::TokenFile(const std::filesystem::path& path)
    : file_(std::make_unique<MappedFile>(path)) {
  const std::string name = path.string();
  const size_t header_bytes = kTokenFileHeaderInts * sizeof(int32_t);
  MEMTUNE_CHECK(file_->size() >= header_bytes, name, ": not an llm.c token file: ", file_->size(),
                " bytes, shorter than the 1024-byte header");
  const int32_t magic = read_i32(file_->data());
  const int32_t version = read_i32(file_->data() + 4);
  const int32_t count = read_i32(file_->data() + 8);
  if (magic == kTokenFileMagic16) {
    width_ = 2;
    MEMTUNE_CHECK(version == kTokenFileVersion16, name, ": llm.c token file version ", version,
                  " with magic ", magic, "; expected version ", kTokenFileVersion16, " (uint16 tokens)");
  } else if (magic == kTokenFileMagic32) {
    width_ = 4;
    MEMTUNE_CHECK(version == kTokenFileVersion32, name, ": llm.c token file version ", version,
                  " with magic ", magic, "; expected version ", kTokenFileVersion32, " (uint32 tokens)");
  } else {
    fail(name, ": wrong magic ", magic, " in the token file header; expected ", kTokenFileMagic16,
         " (uint16 tokens) or ", kTokenFileMagic32,
         " (uint32 tokens), llm.c's format; write one with `memtune tokenize --config ... --out FILE`");
  }
  MEMTUNE_CHECK(count >= 0, name, ": negative token count ", count, " in the header");
  count_ = count;
  const size_t body = file_->size() - header_bytes;
  const size_t want = static_cast<size_t>(count_) * width_;
  MEMTUNE_CHECK(body >= want, name, ": truncated: the header says ", count_, " tokens (", want,
                " bytes) but only ", body, " bytes follow the header");
  MEMTUNE_CHECK(body == want, name, ": ", body - want, " bytes after the ", count_,
                " tokens the header announces; the file is not a single llm.c token file");
  tokens_ = reinterpret_cast<const unsigned char*>(file_->data() + header_bytes);
}

TokenFile::~TokenFile() = default;

void TokenFile::copy_to(std::vector<int32_t>& out) const {
  out.reserve(out.size() + count_);
  for (int64_t i = 0; i < count_; ++i) out.push_back(static_cast<int32_t>((*this)[i]));
}

void write_token_file(const std::filesystem::path& path, const std::vector<uint32_t>& tokens,
                      int64_t vocab_size) {
  MEMTUNE_CHECK(vocab_size > 0, "write_token_file: vocab_size ", vocab_size, " must be positive");
  MEMTUNE_CHECK(tokens.size() < (1ULL << 31), "write_token_file: ", tokens.size(),
                " tokens; llm.c's header holds at most 2^31-1");
  const bool narrow = vocab_size <= 65536;
  for (size_t i = 0; i < tokens.size(); ++i)
    MEMTUNE_CHECK(tokens[i] < static_cast<uint64_t>(vocab_size), "write_token_file: token ", i,
                  " is ", tokens[i], ", not below vocab_size ", vocab_size);
  int32_t header[kTokenFileHeaderInts] = {};
  header[0] = narrow ? kTokenFileMagic16 : kTokenFileMagic32;
  header[1] = narrow ? kTokenFileVersion16 : kTokenFileVersion32;
  header[2] = static_cast<int32_t>(tokens.size());

  AtomicFile out(path);  // a failure or a kill leaves no partial file and no temporary behind
  out.write(header, sizeof header);
  if (narrow) {
    std::vector<uint16_t> body(tokens.begin(), tokens.end());
    out.write(body.data(), body.size() * sizeof(uint16_t));
  } else {
    out.write(tokens.data(), tokens.size() * sizeof(uint32_t));
  }
  out.commit();
}

}  // namespace memtune::data
