#pragma once
// safetensors files (https://github.com/huggingface/safetensors, "Format"): 8-byte
// little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
// [begin, end]}, "__metadata__": {str: str}}, then the data section, which the tensors'
// byte ranges cover exactly (no overlaps, no holes). Tensors are row-major, little-endian.
//
// Reading maps the file (read-only) and validates the whole header on open; every error
// names the file, the tensor and the values seen. Writing goes through a temporary file
// and a rename (runtime/atomic_file.h), so a crash never leaves a partial file under the
// final name. Sharded checkpoints follow Hugging Face's `model.safetensors.index.json`.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace memtune {
class AtomicFile;
}

namespace memtune::models {

// The header is refused above this size (safetensors' own reader uses the same cap).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// "F32", "BF16", ... <-> at::ScalarType. Supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8
// BOOL. Throws UserError for other dtypes, naming `where`.
at::ScalarType safetensors_dtype(const std::string& name, const std::string& where = "");
std::string safetensors_dtype_name(at::ScalarType dtype);

struct SafetensorsTensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range [begin, end) in the data section
  uint64_t end = 0;
  uint64_t file_offset = 0;  // of `begin` from the start of the file
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
};

// One safetensors file, memory-mapped read-only for the object's lifetime (and for as
// long as any view() tensor lives).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;

  const std::filesystem::path& path() const { return path_; }
  // In data order (the order their bytes lie in the file), so a pass reads front to back.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  // Throws UserError naming the file when `name` is absent.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t header_bytes() const { return header_bytes_; }  // N
  uint64_t data_bytes() const { return data_bytes_; }

  // A contiguous CPU copy, read with pread(): the file's pages are not mapped into this
  // process, so resident memory grows by the copy only.
  at::Tensor load(const std::string& name) const;
  // Zero-copy CPU tensor over the mapping; the mapping stays alive while the tensor does.
  // Read-only: writing into it faults. A tensor whose bytes are not aligned to its
  // element size (possible in files from other writers) is returned as a copy. Pages a
  // view touches count in this process's resident memory until evict().
  at::Tensor view(const std::string& name) const;
  // Unmaps the resident pages of `name`'s bytes (and of any tensor sharing its first or
  // last page); views stay valid and read the file again when touched. For streaming
  // loads: view, convert, evict, next.
  void evict(const std::string& name) const;

 private:
  struct Mapping;
  std::filesystem::path path_;
  std::shared_ptr<const Mapping> mapping_;
  uint64_t header_bytes_ = 0;
  uint64_t data_bytes_ = 0;
  std::vector<std::string> names_;
  std::vector<SafetensorsTensorInfo> infos_;  // parallel to names_
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsTensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

// Streams a safetensors file: the list of tensors first (the header is written at once),
// then each tensor's bytes in that order, so a model is never held whole. finish() makes
// the file appear under its name; destroying an unfinished writer leaves nothing there.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::filesystem::path& path, std::vector<SafetensorsTensorSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor in spec order; its dtype and shape must match the spec. Moved to CPU
  // and made contiguous as needed.
  void write(const std::string& name, const at::Tensor& tensor);
  // Raw little-endian bytes of the next tensor; size must match the spec.
  void write_bytes(const std::string& name, const void* data, uint64_t size);
  void finish();

  // Name of the tensor write() expects next ("" when all are written).
  std::string next_name() const;

 private:
  std::filesystem::path path_;
  std::vector<SafetensorsTensorSpec> specs_;
  std::vector<uint64_t> sizes_;
  size_t next_ = 0;
  std::unique_ptr<AtomicFile> file_;
};

// Writes `tensors` in the given order with an 8-byte aligned header.
void save_safetensors(const std::filesystem::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A checkpoint directory holding `<base>.safetensors`, or shards listed by
// `<base>.safetensors.index.json` ({"metadata": {...}, "weight_map": {name: shard}}).
// The constructor opens and validates every shard and checks the index against them.
class CheckpointReader {
 public:
  // `path`: a directory (base "model"), or a .safetensors / .index.json file.
  explicit CheckpointReader(const std::filesystem::path& path, const std::string& base = "model");

  // Grouped by shard (shards in file-name order), each in data order.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return shard_of_.count(name) > 0; }
  const SafetensorsTensorInfo& info(const std::string& name) const;
  at::Tensor load(const std::string& name) const;
  at::Tensor view(const std::string& name) const;
  void evict(const std::string& name) const;  // see SafetensorsFile::evict
  // The shard file holding `name`.
  const std::filesystem::path& file_of(const std::string& name) const;
  bool sharded() const { return sharded_; }
  // Sum of tensor bytes (the index's total_size when sharded).
  uint64_t total_bytes() const { return total_bytes_; }
  // The first shard's `__metadata__` (HF writes the same in every shard).
  const std::map<std::string, std::string>& metadata() const;

 private:
  const SafetensorsFile& shard(const std::string& name) const;
  std::filesystem::path where_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> shards_;
  std::unordered_map<std::string, size_t> shard_of_;
  std::vector<std::string> names_;
  uint64_t total_bytes_ = 0;
};

struct CheckpointWriterOptions {
  uint64_t max_shard_bytes = 5'000'000'000;  // HF's default "5GB"; a larger tensor gets its own shard
  std::string base = "model";                 // file names: model.safetensors, model-00001-of-00003.safetensors
  // `__metadata__` of every shard; transformers refuses files whose metadata lacks "format".
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
};

// Writes a checkpoint into `dir` (typically an AtomicDirectory's path), streamed: the
// specs plan the shards (greedy in the given order, as HF does), then tensors arrive one
// at a time. One shard is written as `<base>.safetensors` without an index; several as
// `<base>-0000i-of-0000n.safetensors` plus `<base>.safetensors.index.json`.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::filesystem::path& dir, std::vector<SafetensorsTensorSpec> specs,
                   CheckpointWriterOptions options = {});
  ~CheckpointWriter();
  void write(const std::string& name, const at::Tensor& tensor);
  void finish();
  // Shard file names in order.
  const std::vector<std::string>& shard_files() const { return files_; }

 private:
  std::filesystem::path dir_;
  CheckpointWriterOptions options_;
  std::vector<std::vector<SafetensorsTensorSpec>> plan_;
  std::vector<std::string> files_;
  std::vector<std::pair<std::string, std::string>> weight_map_;
  uint64_t total_bytes_ = 0;
  size_t shard_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
};

void save_checkpoint(const std::filesystem::path& dir,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     CheckpointWriterOptions options = {});

}  // namespace memtune::models
