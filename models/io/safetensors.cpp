#include "models/io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::models {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

namespace {

struct DtypeEntry {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeEntry kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};
// In the safetensors format but without an at::ScalarType on every LibTorch memtune
// builds against (1.13 has no unsigned 16/32/64-bit or 8-bit float types).
constexpr const char* kKnownUnsupported[] = {"U16",      "U32",      "U64",     "F8_E4M3",
                                             "F8_E5M2",  "F8_E8M0",  "F4",      "F6_E2M3",
                                             "F6_E3M2",  "C64"};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

std::string range_text(uint64_t begin, uint64_t end) {
  return str_cat("[", begin, ", ", end, ")");
}

// numel x element size, or false on overflow.
bool byte_size(const std::vector<int64_t>& shape, at::ScalarType dtype, uint64_t* out) {
  unsigned __int128 total = c10::elementSize(dtype);
  for (int64_t d : shape) {
    total *= static_cast<uint64_t>(d);
    if (total > std::numeric_limits<uint64_t>::max()) return false;
  }
  *out = static_cast<uint64_t>(total);
  return true;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string le64_bytes(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

std::string json_text(const ordered_json& j) {
  std::string s = j.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

}  // namespace

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

at::ScalarType safetensors_dtype(const std::string& name, const std::string& where) {
  for (const auto& e : kDtypes)
    if (name == e.name) return e.type;
  for (const char* known : kKnownUnsupported)
    MEMTUNE_CHECK(name != known, where, "dtype \"", name,
                  "\" is valid safetensors but not supported by memtune; supported: F64 F32 "
                  "F16 BF16 I64 I32 I16 I8 U8 BOOL");
  fail(where, "unknown dtype \"", name,
       "\"; safetensors dtypes memtune reads: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL");
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& e : kDtypes)
    if (dtype == e.type) return e.name;
  fail("safetensors cannot store dtype ", c10::toString(dtype),
       "; convert to one of float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool");
}

// ---- reading ----

struct SafetensorsFile::Mapping {
  int fd = -1;  // kept open for load()'s pread
  const uint8_t* data = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (data != nullptr) ::munmap(const_cast<uint8_t*>(data), size);
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string file = str_cat("safetensors file ", path, ": ");
  auto mapping = std::make_shared<Mapping>();
  mapping->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MEMTUNE_CHECK(mapping->fd >= 0, "cannot open safetensors file ", path, ": ",
                std::strerror(errno));
  struct stat st;
  MEMTUNE_CHECK(::fstat(mapping->fd, &st) == 0 && S_ISREG(st.st_mode), file,
                "not a regular file");
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    void* p = ::mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, mapping->fd, 0);
    MEMTUNE_CHECK(p != MAP_FAILED, file, "mmap of ", mapping->size, " bytes failed: ",
                  std::strerror(errno));
    mapping->data = static_cast<const uint8_t*>(p);
  }
  mapping_ = mapping;
  const uint64_t size = mapping->size;

  MEMTUNE_CHECK(size >= 8, file, "the file is ", size,
                " bytes, shorter than the 8-byte header length; it is truncated or not a "
                "safetensors file");
  const uint64_t n = read_le64(mapping->data);
  MEMTUNE_CHECK(n <= kSafetensorsMaxHeaderBytes, file, "header length ", n,
                " exceeds the limit of ", kSafetensorsMaxHeaderBytes,
                " bytes; the file is corrupt or not a safetensors file");
  MEMTUNE_CHECK(n <= size - 8, file, "header length ", n, " runs past the end of the file (",
                size, " bytes, so at most ", size - 8,
                " header bytes); the file is truncated");
  header_bytes_ = n;
  data_bytes_ = size - 8 - n;
  const char* text = reinterpret_cast<const char*>(mapping->data + 8);
  MEMTUNE_CHECK(n >= 1 && text[0] == '{', file, "the header does not start with '{' (first byte ",
                n ? static_cast<int>(static_cast<unsigned char>(text[0])) : -1,
                "); not a safetensors file");

  // Duplicate top-level keys are refused (a JSON parser would keep one silently).
  std::set<std::string> seen;
  std::string duplicate;
  ordered_json::parser_callback_t on_key = [&](int depth, nlohmann::json::parse_event_t event,
                                               ordered_json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !seen.insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  check_json_depth(std::string_view(text, n), file + "the header");
  ordered_json header;
  try {
    header = ordered_json::parse(text, text + n, on_key);
  } catch (const nlohmann::json::exception& e) {
    fail(file, "the ", n, "-byte header is not valid JSON: ", e.what());
  }
  MEMTUNE_CHECK(header.is_object(), file, "the header is JSON but not an object: ",
                json_text(header));
  MEMTUNE_CHECK(duplicate.empty(), file, "tensor '", duplicate,
                "' appears twice in the header");

  for (const auto& item : header.items()) {
    const std::string& name = item.key();
    const ordered_json& value = item.value();
    if (name == "__metadata__") {
      MEMTUNE_CHECK(value.is_object(), file, "__metadata__ must be an object of strings, got ",
                    json_text(value));
      for (const auto& kv : value.items()) {
        MEMTUNE_CHECK(kv.value().is_string(), file, "__metadata__ key '", kv.key(),
                      "' must be a string, got ", json_text(kv.value()));
        metadata_[kv.key()] = kv.value().get<std::string>();
      }
      continue;
    }
    const std::string where = str_cat(file, "tensor '", name, "': ");
    MEMTUNE_CHECK(value.is_object(), where, "expected {dtype, shape, data_offsets}, got ",
                  json_text(value));
    for (const auto& kv : value.items())
      MEMTUNE_CHECK(kv.key() == "dtype" || kv.key() == "shape" || kv.key() == "data_offsets",
                    where, "unexpected field \"", kv.key(),
                    "\"; a tensor entry has dtype, shape and data_offsets");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      MEMTUNE_CHECK(value.contains(field), where, "missing field \"", field, "\" in ",
                    json_text(value));

    SafetensorsTensorInfo info;
    info.name = name;
    const auto& dtype = value["dtype"];
    MEMTUNE_CHECK(dtype.is_string(), where, "dtype must be a string, got ", json_text(dtype));
    info.dtype = safetensors_dtype(dtype.get<std::string>(), where);

    const auto& shape = value["shape"];
    MEMTUNE_CHECK(shape.is_array(), where, "shape must be an array, got ", json_text(shape));
    for (const auto& d : shape) {
      MEMTUNE_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                    where, "shape ", json_text(shape),
                    " must hold non-negative integers");
      MEMTUNE_CHECK(d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()), where,
                    "dimension ", d.get<uint64_t>(), " is too large");
      info.shape.push_back(d.get<int64_t>());
    }

    const auto& offsets = value["data_offsets"];
    MEMTUNE_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                      offsets[1].is_number_unsigned(),
                  where, "data_offsets must be [begin, end] with non-negative integers, got ",
                  json_text(offsets));
    info.begin = offsets[0].get<uint64_t>();
    info.end = offsets[1].get<uint64_t>();
    MEMTUNE_CHECK(info.begin <= info.end, where, "data_offsets ", range_text(info.begin, info.end),
                  " end before they begin");
    MEMTUNE_CHECK(info.end <= data_bytes_, where, "data_offsets ",
                  range_text(info.begin, info.end), " run past the end of the data section (",
                  data_bytes_, " bytes); the file is truncated or the header is wrong");
    uint64_t expected = 0;
    MEMTUNE_CHECK(byte_size(info.shape, info.dtype, &expected), where, "shape ",
                  shape_text(info.shape), " overflows 64-bit byte counts");
    MEMTUNE_CHECK(expected == info.nbytes(), where, "shape ", shape_text(info.shape), " x ",
                  dtype.get<std::string>(), " (", c10::elementSize(info.dtype), " bytes) = ",
                  expected, " bytes, but data_offsets ", range_text(info.begin, info.end),
                  " hold ", info.nbytes(), " bytes");
    info.file_offset = 8 + n + info.begin;
    infos_.push_back(std::move(info));
  }

  // The ranges, in order, must tile the data section exactly.
  std::stable_sort(infos_.begin(), infos_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const SafetensorsTensorInfo* previous = nullptr;
  for (const auto& info : infos_) {
    MEMTUNE_CHECK(info.begin >= cursor, file, "tensor '", info.name, "' at ",
                  range_text(info.begin, info.end), " overlaps tensor '",
                  previous ? previous->name : "", "' at ",
                  previous ? range_text(previous->begin, previous->end) : "");
    MEMTUNE_CHECK(info.begin == cursor, file, "hole in the data section: bytes ",
                  range_text(cursor, info.begin), " belong to no tensor (before tensor '",
                  info.name, "'); the safetensors format forbids holes");
    cursor = info.end;
    previous = &info;
  }
  MEMTUNE_CHECK(cursor == data_bytes_, file, "hole in the data section: bytes ",
                range_text(cursor, data_bytes_), " at its end belong to no tensor",
                previous ? str_cat(" (after tensor '", previous->name, "')") : std::string(),
                "; the safetensors format forbids holes");

  for (size_t i = 0; i < infos_.size(); ++i) {
    names_.push_back(infos_[i].name);
    index_[infos_[i].name] = i;
  }
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  MEMTUNE_CHECK(it != index_.end(), "safetensors file ", path_, " has no tensor '", name,
                "' (it holds ", names_.size(), " tensors",
                names_.empty() ? std::string() : str_cat(", e.g. '", names_.front(), "'"), ")");
  return infos_[it->second];
}

at::Tensor SafetensorsFile::load(const std::string& name) const {
  const auto& i = info(name);
  at::Tensor out = at::empty(i.shape, at::TensorOptions().dtype(i.dtype));
  auto* dst = static_cast<char*>(out.data_ptr());
  uint64_t done = 0;
  while (done < i.nbytes()) {
    const ssize_t n = ::pread(mapping_->fd, dst + done, i.nbytes() - done,
                              static_cast<off_t>(i.file_offset + done));
    if (n < 0 && errno == EINTR) continue;
    MEMTUNE_CHECK(n > 0, "safetensors file ", path_, ": reading tensor '", name, "' failed at byte ",
                  i.file_offset + done, ": ", n == 0 ? "unexpected end of file (truncated since "
                                                       "it was opened?)" : std::strerror(errno));
    done += static_cast<uint64_t>(n);
  }
  return out;
}

void SafetensorsFile::evict(const std::string& name) const {
  const auto& i = info(name);
  if (i.nbytes() == 0) return;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t first = i.file_offset / page * page;
  const uint64_t end = i.file_offset + i.nbytes();  // <= the mapping's size
  // A clean private file mapping: dropped pages are read back from the file on access.
  ::madvise(const_cast<uint8_t*>(mapping_->data) + first, end - first, MADV_DONTNEED);
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const auto& i = info(name);
  const uint8_t* p = mapping_->data + i.file_offset;
  if (i.nbytes() == 0 || reinterpret_cast<uintptr_t>(p) % c10::elementSize(i.dtype) != 0)
    return load(name);
  std::shared_ptr<const Mapping> keep = mapping_;
  return at::from_blob(
      const_cast<uint8_t*>(p), i.shape, [keep](void*) {},
      at::TensorOptions().dtype(i.dtype).device(at::kCPU));
}

// ---- writing ----

SafetensorsWriter::SafetensorsWriter(const fs::path& path, std::vector<SafetensorsTensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), specs_(std::move(specs)) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& spec : specs_) {
    const std::string where = str_cat("writing ", path, ": tensor '", spec.name, "': ");
    MEMTUNE_CHECK(spec.name != "__metadata__", where, "the name is reserved for metadata");
    MEMTUNE_CHECK(names.insert(spec.name).second, where, "listed twice");
    for (int64_t d : spec.shape)
      MEMTUNE_CHECK(d >= 0, where, "negative dimension in shape ", shape_text(spec.shape));
    uint64_t bytes = 0;
    MEMTUNE_CHECK(byte_size(spec.shape, spec.dtype, &bytes), where, "shape ",
                  shape_text(spec.shape), " overflows");
    ordered_json entry = ordered_json::object();
    entry["dtype"] = safetensors_dtype_name(spec.dtype);
    entry["shape"] = spec.shape;
    entry["data_offsets"] = {offset, offset + bytes};
    header[spec.name] = std::move(entry);
    sizes_.push_back(bytes);
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("writing ", path, ": a tensor name or metadata entry is not valid UTF-8: ", e.what());
  }
  // 8-byte length + header is a multiple of 8, so the data section starts aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  file_ = std::make_unique<AtomicFile>(path);
  file_->write(le64_bytes(text.size()));
  file_->write(text);
}

SafetensorsWriter::~SafetensorsWriter() = default;

std::string SafetensorsWriter::next_name() const {
  return next_ < specs_.size() ? specs_[next_].name : std::string();
}

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  MEMTUNE_CHECK(next_ < specs_.size(), "writing ", path_, ": tensor '", name,
                "' comes after all ", specs_.size(), " listed tensors");
  const auto& spec = specs_[next_];
  const std::string where = str_cat("writing ", path_, ": tensor '", name, "': ");
  MEMTUNE_CHECK(tensor.defined(), where, "undefined tensor");
  MEMTUNE_CHECK(tensor.scalar_type() == spec.dtype, where, "dtype ", tensor.scalar_type(),
                " differs from the listed ", spec.dtype);
  MEMTUNE_CHECK(tensor.sizes().vec() == spec.shape, where, "shape ",
                shape_text(tensor.sizes().vec()), " differs from the listed ",
                shape_text(spec.shape));
  at::Tensor bytes = tensor.device().is_cpu() ? tensor : tensor.to(at::kCPU);
  bytes = bytes.contiguous();
  write_bytes(name, bytes.data_ptr(), static_cast<uint64_t>(bytes.nbytes()));
}

void SafetensorsWriter::write_bytes(const std::string& name, const void* data, uint64_t size) {
  MEMTUNE_CHECK(file_ != nullptr, "writing ", path_, ": already finished");
  MEMTUNE_CHECK(next_ < specs_.size(), "writing ", path_, ": tensor '", name,
                "' comes after all ", specs_.size(), " listed tensors");
  MEMTUNE_CHECK(name == specs_[next_].name, "writing ", path_, ": got tensor '", name,
                "' but the next listed one is '", specs_[next_].name,
                "'; write tensors in the listed order");
  MEMTUNE_CHECK(size == sizes_[next_], "writing ", path_, ": tensor '", name, "' has ", size,
                " bytes, the listed dtype and shape need ", sizes_[next_]);
  file_->write(data, size);
  ++next_;
}

void SafetensorsWriter::finish() {
  MEMTUNE_CHECK(file_ != nullptr, "writing ", path_, ": already finished");
  MEMTUNE_CHECK(next_ == specs_.size(), "writing ", path_, ": finished with ",
                specs_.size() - next_, " listed tensors unwritten, first '", next_name(), "'");
  file_->commit();
  file_.reset();
}

void save_safetensors(const fs::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    MEMTUNE_CHECK(t.defined(), "writing ", path, ": tensor '", name, "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.finish();
}

// ---- sharded checkpoints ----

namespace {
std::string shard_name(const std::string& base, size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%05zu-of-%05zu.safetensors", i + 1, n);
  return base + buf;
}

// Whether `p` exists; a path the system cannot look up (a name too long, a component that is
// a file) is a UserError naming it, not filesystem_error.
bool path_exists(const fs::path& p, const std::string& what) {
  std::error_code ec;
  const bool exists = fs::exists(p, ec);
  MEMTUNE_CHECK(!ec, what, p, " cannot be looked up: ", ec.message());
  return exists;
}
}  // namespace

CheckpointReader::CheckpointReader(const fs::path& path, const std::string& base) {
  fs::path index_file, single_file;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    index_file = path / (base + ".safetensors.index.json");
    single_file = path / (base + ".safetensors");
    if (!path_exists(index_file, "checkpoint index ")) {
      MEMTUNE_CHECK(path_exists(single_file, "checkpoint "), "no checkpoint in ", path, ": neither ",
                    single_file.filename(), " nor ", index_file.filename(), " exists");
      index_file.clear();
    }
  } else {
    MEMTUNE_CHECK(path_exists(path, "checkpoint "), "checkpoint ", path, " does not exist");
    const std::string name = path.filename().string();
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
      index_file = path;
    else
      single_file = path;
  }

  if (index_file.empty()) {
    where_ = single_file;
    shards_.emplace_back(single_file);
    names_ = shards_.front().names();
    for (const auto& n : names_) {
      shard_of_[n] = 0;
      total_bytes_ += shards_.front().info(n).nbytes();
    }
    return;
  }

  sharded_ = true;
  where_ = index_file;
  const std::string in = str_cat("checkpoint index ", index_file, ": ");
  std::ifstream stream(index_file, std::ios::binary);
  MEMTUNE_CHECK(stream.good(), "cannot read checkpoint index ", index_file);
  std::stringstream buffer;
  buffer << stream.rdbuf();
  const std::string index_text = buffer.str();
  check_json_depth(index_text, in);
  ordered_json index;
  try {
    index = ordered_json::parse(index_text);
  } catch (const nlohmann::json::exception& e) {
    fail(in, "not valid JSON: ", e.what());
  }
  MEMTUNE_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                in, "expected {\"metadata\": {...}, \"weight_map\": {tensor: shard file}}");

  // Shard files in name order; each tensor's shard.
  std::map<std::string, std::vector<std::string>> by_shard;
  std::unordered_map<std::string, std::string> wanted;
  for (const auto& kv : index["weight_map"].items()) {
    MEMTUNE_CHECK(kv.value().is_string(), in, "weight_map['", kv.key(),
                  "'] must be a shard file name, got ", json_text(kv.value()));
    const std::string file = kv.value().get<std::string>();
    MEMTUNE_CHECK(!file.empty() && file != "." && file != ".." &&
                      file.find('/') == std::string::npos,
                  in, "weight_map['", kv.key(), "'] = \"", file,
                  "\" must be a file name in the index's directory");
    by_shard[file].push_back(kv.key());
    wanted[kv.key()] = file;
  }
  MEMTUNE_CHECK(!by_shard.empty(), in,
                "weight_map is empty: the index lists no tensors, so no shard would be read "
                "(an interrupted save? write the index after its shards)");
  const fs::path dir = index_file.parent_path();
  for (const auto& [file, tensors] : by_shard) {
    const fs::path shard_path = dir / file;
    MEMTUNE_CHECK(path_exists(shard_path, in + "shard "), in, "shard ", shard_path, " (holding tensor '",
                  tensors.front(), "' and ", tensors.size() - 1,
                  " more) does not exist; the checkpoint is incomplete");
    shards_.emplace_back(shard_path);
    const SafetensorsFile& shard = shards_.back();
    for (const auto& t : tensors)
      MEMTUNE_CHECK(shard.contains(t), in, "tensor '", t, "' is mapped to shard ", file,
                    ", which has no such tensor (it holds ", shard.names().size(), ")");
    for (const auto& t : shard.names()) {
      auto it = wanted.find(t);
      MEMTUNE_CHECK(it != wanted.end(), in, "shard ", file, " holds tensor '", t,
                    "', which the weight_map does not list");
      if (it->second != file) continue;  // a copy in another shard; the index decides
      shard_of_[t] = shards_.size() - 1;
      names_.push_back(t);
      total_bytes_ += shard.info(t).nbytes();
    }
  }
}

const SafetensorsFile& CheckpointReader::shard(const std::string& name) const {
  auto it = shard_of_.find(name);
  MEMTUNE_CHECK(it != shard_of_.end(), "checkpoint ", where_, " has no tensor '", name, "' (",
                names_.size(), " tensors)");
  return shards_[it->second];
}

const SafetensorsTensorInfo& CheckpointReader::info(const std::string& name) const {
  return shard(name).info(name);
}
at::Tensor CheckpointReader::load(const std::string& name) const { return shard(name).load(name); }
at::Tensor CheckpointReader::view(const std::string& name) const { return shard(name).view(name); }
void CheckpointReader::evict(const std::string& name) const { shard(name).evict(name); }
const fs::path& CheckpointReader::file_of(const std::string& name) const {
  return shard(name).path();
}
const std::map<std::string, std::string>& CheckpointReader::metadata() const {
  return shards_.front().metadata();
}

CheckpointWriter::CheckpointWriter(const fs::path& dir, std::vector<SafetensorsTensorSpec> specs,
                                   CheckpointWriterOptions options)
    : dir_(dir), options_(std::move(options)) {
  MEMTUNE_CHECK(options_.max_shard_bytes > 0, "checkpoint ", dir, ": max_shard_bytes must be > 0");
  fs::create_directories(dir_);
  plan_.emplace_back();
  uint64_t current = 0;
  std::set<std::string> names;
  for (auto& spec : specs) {
    MEMTUNE_CHECK(names.insert(spec.name).second, "checkpoint ", dir, ": tensor '", spec.name,
                  "' listed twice");
    uint64_t bytes = 0;
    MEMTUNE_CHECK(byte_size(spec.shape, spec.dtype, &bytes), "checkpoint ", dir, ": tensor '",
                  spec.name, "' is too large");
    if (!plan_.back().empty() && current + bytes > options_.max_shard_bytes) {
      plan_.emplace_back();
      current = 0;
    }
    current += bytes;
    total_bytes_ += bytes;
    plan_.back().push_back(std::move(spec));
  }
  for (size_t i = 0; i < plan_.size(); ++i) {
    files_.push_back(plan_.size() == 1 ? options_.base + ".safetensors"
                                       : shard_name(options_.base, i, plan_.size()));
    for (const auto& spec : plan_[i]) weight_map_.emplace_back(spec.name, files_.back());
  }
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::write(const std::string& name, const at::Tensor& tensor) {
  MEMTUNE_CHECK(shard_ < plan_.size() && !plan_[shard_].empty(), "checkpoint ", dir_, ": tensor '", name,
                "' comes after all listed tensors");
  if (!writer_)
    writer_ = std::make_unique<SafetensorsWriter>(dir_ / files_[shard_], plan_[shard_],
                                                  options_.metadata);
  writer_->write(name, tensor);
  if (writer_->next_name().empty()) {
    writer_->finish();
    writer_.reset();
    ++shard_;
  }
}

void CheckpointWriter::finish() {
  MEMTUNE_CHECK(!writer_, "checkpoint ", dir_, ": finished with tensor '", writer_->next_name(),
                "' unwritten");
  if (shard_ == 0 && plan_.size() == 1 && plan_[0].empty()) {  // no tensors: an empty file
    SafetensorsWriter(dir_ / files_[0], {}, options_.metadata).finish();
    shard_ = 1;
  }
  MEMTUNE_CHECK(shard_ == plan_.size(), "checkpoint ", dir_, ": finished with shard ",
                files_[shard_], " unwritten");
  if (plan_.size() == 1) return;
  ordered_json index = ordered_json::object();
  index["metadata"] = {{"total_size", total_bytes_}};
  std::vector<std::pair<std::string, std::string>> sorted = weight_map_;
  std::sort(sorted.begin(), sorted.end());
  ordered_json map = ordered_json::object();
  for (const auto& [name, file] : sorted) map[name] = file;
  index["weight_map"] = std::move(map);
  write_file_atomic(dir_ / (options_.base + ".safetensors.index.json"), index.dump(2) + "\n");
}

void save_checkpoint(const fs::path& dir,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     CheckpointWriterOptions options) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    MEMTUNE_CHECK(t.defined(), "checkpoint ", dir, ": tensor '", name, "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  CheckpointWriter writer(dir, std::move(specs), std::move(options));
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.finish();
}

}  // namespace memtune::models
