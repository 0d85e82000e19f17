// safetensors reading and writing against an independent Python implementation
// (tests/reference/safetensors_ref.py, numpy only), and every malformed-file error.
#include "models/io/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "runtime/cpu_budget_allocator.h"
#include "runtime/error.h"
#include "runtime/host_memory.h"
#include "test_util.h"

namespace fs = std::filesystem;
namespace mt = memtune::testing;
using memtune::UserError;
using memtune::models::CheckpointReader;
using memtune::models::CheckpointWriter;
using memtune::models::CheckpointWriterOptions;
using memtune::models::SafetensorsFile;
using memtune::models::SafetensorsWriter;
using nlohmann::json;

namespace {

std::string reference_script() {
  return (mt::source_dir() / "tests" / "reference" / "safetensors_ref.py").string();
}

bool python_numpy_available() {
  static int cached = -1;
  if (cached < 0) cached = mt::run(mt::python() + " -c 'import numpy'", 120).exit_code == 0;
  return cached == 1;
}

#define SKIP_WITHOUT_NUMPY() \
  if (!python_numpy_available()) GTEST_SKIP() << mt::python() << " has no numpy"

// Runs the reference; returns its stdout parsed (or the fixtures' expected.json).
json reference(const std::string& command, const fs::path& arg) {
  auto r = mt::run(mt::python() + " " + reference_script() + " " + command + " '" +
                       arg.string() + "' 2>/dev/null",
                   300);
  EXPECT_EQ(r.exit_code, 0) << command << " " << arg << ":\n" << r.output;
  if (command == "fixtures") return json::parse(mt::read_file(arg / "expected.json"));
  return json::parse(r.output);
}

double json_number(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "nan") return std::nan("");
    return s == "inf" ? INFINITY : -INFINITY;
  }
  return v.get<double>();
}

std::string hex_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  for (int64_t i = 0; i < static_cast<int64_t>(c.nbytes()); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

// A tensor's values equal the reference's (bytes exactly; values as doubles, NaN = NaN).
void expect_matches(const at::Tensor& t, const json& want, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(memtune::models::safetensors_dtype_name(t.scalar_type()), want["dtype"]);
  EXPECT_EQ(t.sizes().vec(), want["shape"].get<std::vector<int64_t>>());
  EXPECT_EQ(hex_of(t), want["hex"].get<std::string>());
  at::Tensor d = t.to(at::kDouble).contiguous().reshape({-1});
  const auto& values = want["values"];
  ASSERT_EQ(d.numel(), static_cast<int64_t>(values.size()));
  for (int64_t i = 0; i < d.numel(); ++i) {
    const double got = d[i].item<double>(), expected = json_number(values[i]);
    if (std::isnan(expected))
      EXPECT_TRUE(std::isnan(got)) << i;
    else
      EXPECT_EQ(got, expected) << i;
  }
}

// Raw file: 8-byte length (header.size() unless given), header, data.
void write_raw(const fs::path& path, const std::string& header, const std::string& data,
               int64_t length = -1) {
  std::string bytes(8, '\0');
  const uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  mt::write_file(path, bytes + header + data);
}

// Opening `path` throws a UserError naming the file and containing every fragment.
template <class Open>
void expect_error(Open&& open, const fs::path& named, std::vector<std::string> fragments) {
  try {
    open();
    ADD_FAILURE() << "no error for " << named;
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(named.filename().string()), std::string::npos) << what;
    for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << f << " in: " << what;
  }
}

void expect_file_error(const fs::path& path, std::vector<std::string> fragments) {
  expect_error([&] { SafetensorsFile f(path); }, path, std::move(fragments));
}

}  // namespace

// ---- files written by the reference, read by memtune ----

TEST(SafetensorsRead, ReferenceFileAllDtypes) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  const json expected = reference("fixtures", dir)["mixed.safetensors"];
  SafetensorsFile file(dir / "mixed.safetensors");

  // names() follow the data, not the (sorted) header.
  EXPECT_EQ(file.names(), expected["data_order"].get<std::vector<std::string>>());
  EXPECT_EQ(file.metadata(), (expected["metadata"].get<std::map<std::string, std::string>>()));
  for (const auto& [name, want] : expected["tensors"].items()) {
    expect_matches(file.load(name), want, name);
    expect_matches(file.view(name), want, name + " (view)");
  }
  EXPECT_EQ(file.info("scalar").shape.size(), 0u);
  EXPECT_EQ(file.load("scalar").dim(), 0);
  EXPECT_EQ(file.info("empty").nbytes(), 0u);
  EXPECT_EQ(file.info("bf16.specials").dtype, at::kBFloat16);
  EXPECT_EQ(file.info("ключ.вес").dtype, at::kHalf);
}

TEST(SafetensorsRead, ViewIsZeroCopyAndOutlivesTheFile) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  const json expected = reference("fixtures", dir)["mixed.safetensors"];
  at::Tensor view;
  {
    SafetensorsFile file(dir / "mixed.safetensors");
    view = file.view("model.embed.weight");
    at::Tensor again = file.view("model.embed.weight");
    EXPECT_EQ(view.data_ptr(), again.data_ptr());  // both point into the one mapping
    EXPECT_NE(view.data_ptr(), file.load("model.embed.weight").data_ptr());
  }
  expect_matches(view, expected["tensors"]["model.embed.weight"], "after close");
}

TEST(SafetensorsRead, UnalignedDataIsCopiedByView) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  const json expected = reference("fixtures", dir)["unaligned.safetensors"];
  SafetensorsFile file(dir / "unaligned.safetensors");
  EXPECT_NE(file.info("w").file_offset % 4, 0u);
  expect_matches(file.view("w"), expected["tensors"]["w"], "w");
  expect_matches(file.view("bytes"), expected["tensors"]["bytes"], "bytes");
}

TEST(SafetensorsRead, FileWithoutTensors) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  reference("fixtures", dir);
  SafetensorsFile file(dir / "empty_file.safetensors");
  EXPECT_TRUE(file.names().empty());
  EXPECT_EQ(file.data_bytes(), 0u);
}

TEST(SafetensorsRead, ReferenceShardedCheckpoint) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  const json expected = reference("fixtures", dir)["sharded"];
  CheckpointReader ckpt(dir / "sharded");
  EXPECT_TRUE(ckpt.sharded());
  EXPECT_EQ(ckpt.names().size(), expected["tensors"].size());
  EXPECT_EQ(ckpt.total_bytes(), expected["total_size"].get<uint64_t>());
  for (const auto& [name, want] : expected["tensors"].items()) {
    expect_matches(ckpt.load(name), want, name);
    expect_matches(ckpt.view(name), want, name);
    EXPECT_EQ(ckpt.file_of(name).filename(), want["file"].get<std::string>());
  }
  // Grouped by shard in file-name order.
  EXPECT_EQ(ckpt.names().front(), "model.layers.0.w");
  EXPECT_EQ(ckpt.names().back(), "model.norm.weight");
  EXPECT_EQ(ckpt.metadata().at("format"), "pt");
  // Also from the index file's path.
  EXPECT_EQ(CheckpointReader(dir / "sharded" / "model.safetensors.index.json").names(), ckpt.names());
}

// ---- files written by memtune, read by the reference ----

namespace {
std::vector<std::pair<std::string, at::Tensor>> sample_tensors() {
  at::manual_seed(7);
  at::Tensor base = at::randn({3, 5});
  return {
      {"w.f32", base},
      {"w.transposed", base.t()},  // non-contiguous input
      {"w.f64", at::randn({2, 2}, at::kDouble)},
      {"w.f16", (base * 3).to(at::kHalf)},
      {"w.bf16", at::tensor({0.1f, -1e30f, 3.0f, INFINITY, NAN}).to(at::kBFloat16)},
      {"i64", at::tensor({int64_t(-9), int64_t(1) << 62})},
      {"i32", at::tensor({-5, 7}, at::kInt)},
      {"i16", at::tensor({-300, 300}, at::kShort)},
      {"i8", at::tensor({-100, 100}, at::kChar)},
      {"u8", at::tensor({0, 255}, at::kByte)},
      {"mask", at::tensor({1, 0, 1}, at::kByte).to(at::kBool)},
      {"scalar", at::scalar_tensor(-4.5)},
      {"empty", at::empty({0, 4})},
      {"名前.ä", at::ones({2})},
  };
}
}  // namespace

TEST(SafetensorsWrite, ReferenceReadsWhatMemtuneWrites) {
  SKIP_WITHOUT_NUMPY();
  const fs::path path = mt::temp_dir() / "out.safetensors";
  const auto tensors = sample_tensors();
  memtune::models::save_safetensors(path, tensors, {{"format", "pt"}, {"ü", "✓"}});
  const json got = reference("read", path);

  EXPECT_EQ((got["header_len"].get<uint64_t>() + 8) % 8, 0u);
  EXPECT_EQ(got["metadata"], json({{"format", "pt"}, {"ü", "✓"}}));
  std::vector<std::string> order;
  for (const auto& [name, t] : tensors) order.push_back(name);
  EXPECT_EQ(got["header_order"].get<std::vector<std::string>>(), order);
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const json& want = got["tensors"][name];
    expect_matches(t, want, name);  // the reference decoded exactly our values
    EXPECT_EQ(want["data_offsets"][0].get<uint64_t>(), offset) << name;  // in the given order
    offset = want["data_offsets"][1].get<uint64_t>();
  }
  // The header is padded with spaces.
  const std::string bytes = mt::read_file(path);
  const uint64_t n = got["header_len"].get<uint64_t>();
  EXPECT_EQ(bytes[8], '{');
  EXPECT_TRUE(bytes[8 + n - 1] == '}' || bytes[8 + n - 1] == ' ');
}

TEST(SafetensorsWrite, RoundTripThroughMemtune) {
  const fs::path path = mt::temp_dir() / "rt.safetensors";
  const auto tensors = sample_tensors();
  memtune::models::save_safetensors(path, tensors);
  SafetensorsFile file(path);
  ASSERT_EQ(file.names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    EXPECT_EQ(file.names()[i], name);
    EXPECT_EQ(hex_of(file.load(name)), hex_of(t)) << name;
    EXPECT_EQ(file.load(name).sizes(), t.sizes()) << name;
    EXPECT_EQ(file.view(name).data_ptr() != nullptr || t.numel() == 0, true) << name;
  }
  EXPECT_TRUE(file.metadata().empty());
}

TEST(SafetensorsWrite, StreamingWriterChecksOrderDtypeAndShape) {
  const fs::path dir = mt::temp_dir();
  const fs::path path = dir / "s.safetensors";
  using Spec = memtune::models::SafetensorsTensorSpec;
  {
    SafetensorsWriter w(path, {Spec{"a", at::kFloat, {2}}, Spec{"b", at::kHalf, {1, 3}}});
    EXPECT_THROW(w.write("b", at::zeros({1, 3}, at::kHalf)), UserError);  // out of order
    EXPECT_THROW(w.write("a", at::zeros({2}, at::kDouble)), UserError);   // dtype
    EXPECT_THROW(w.write("a", at::zeros({3}, at::kFloat)), UserError);    // shape
    w.write("a", at::ones({2}));
    EXPECT_THROW(w.finish(), UserError);  // "b" missing
    EXPECT_FALSE(fs::exists(path));
  }
  // Abandoned: nothing under the final name and no temporary left.
  EXPECT_TRUE(fs::is_empty(dir)) << fs::directory_iterator(dir)->path();

  SafetensorsWriter w(path, {Spec{"a", at::kFloat, {2}}, Spec{"b", at::kHalf, {1, 3}}});
  w.write("a", at::ones({2}));
  EXPECT_EQ(w.next_name(), "b");
  w.write("b", at::full({1, 3}, 2.0, at::kHalf));
  w.finish();
  SafetensorsFile f(path);
  EXPECT_TRUE(at::equal(f.load("b"), at::full({1, 3}, 2.0, at::kHalf)));
}

TEST(SafetensorsWrite, ShardedCheckpointReadByReference) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  at::manual_seed(3);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.a", at::randn({10})},           // 40 bytes
      {"model.b", at::randn({4}, at::kDouble)},  // 32 -> 72 > 64: new shard
      {"model.c", at::randn({30})},           // 120 > 64 on its own: its own shard
      {"model.d", at::randn({2}).to(at::kBFloat16)},  // 4: a new shard after an oversized one
      {"model.e", at::randn({2})},                    // 4 + 8 <= 64: with d
  };
  CheckpointWriterOptions options;
  options.max_shard_bytes = 64;
  memtune::models::save_checkpoint(dir, tensors, options);
  const json got = reference("read-checkpoint", dir);

  const json& map = got["index"]["weight_map"];
  EXPECT_EQ(map["model.a"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(map["model.b"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(map["model.c"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(map["model.d"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(map["model.e"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(got["index"]["metadata"]["total_size"].get<uint64_t>(), 40u + 32u + 120u + 4u + 8u);
  for (const auto& [name, t] : tensors) {
    const json& file = got["files"][map[name].get<std::string>()];
    expect_matches(t, file["tensors"][name], name);
    EXPECT_EQ(file["metadata"]["format"], "pt");
  }
  CheckpointReader back(dir);
  EXPECT_EQ(back.names(),
            (std::vector<std::string>{"model.a", "model.b", "model.c", "model.d", "model.e"}));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(back.load(name), t)) << name;
}

TEST(SafetensorsWrite, SingleShardHasNoIndex) {
  SKIP_WITHOUT_NUMPY();
  const fs::path dir = mt::temp_dir();
  memtune::models::save_checkpoint(dir, {{"x", at::ones({3})}});
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  const json got = reference("read-checkpoint", dir);
  expect_matches(at::ones({3}), got["files"]["model.safetensors"]["tensors"]["x"], "x");
  EXPECT_FALSE(CheckpointReader(dir).sharded());
}

TEST(SafetensorsWrite, RefusesWhatTheFormatCannotHold) {
  const fs::path dir = mt::temp_dir();
  EXPECT_THROW(memtune::models::save_safetensors(dir / "c.safetensors",
                                                 {{"c", at::ones({2}, at::kComplexFloat)}}),
               UserError);
  EXPECT_THROW(memtune::models::save_safetensors(
                   dir / "d.safetensors", {{"a", at::ones({1})}, {"a", at::ones({1})}}),
               UserError);
  EXPECT_THROW(memtune::models::save_safetensors(dir / "m.safetensors",
                                                 {{"__metadata__", at::ones({1})}}),
               UserError);
  EXPECT_TRUE(fs::is_empty(dir));
}

// ---- resident memory while reading (the building block of low_cpu_mem_usage loads) ----

TEST(SafetensorsMemory, LoadCostsOneCopyAndEvictReleasesViewPages) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under AddressSanitizer freed memory stays resident in its quarantine: RSS measures nothing here";
#endif
  constexpr int64_t kMiB = 1 << 20, n = 16 * kMiB;  // 64 MiB of F32
  const fs::path path = mt::temp_dir() / "big.safetensors";
  memtune::models::save_safetensors(path, {{"big", at::arange(n, at::kFloat)}});
  SafetensorsFile file(path);
  const at::Tensor sample_index = at::arange(0, n, 4099, at::kDouble);
  // The budget allocator (installed when the whole binary runs) keeps freed large blocks
  // for reuse; measure from an empty cache, and release what the load freed before the
  // check that it was freed.
  memtune::release_cpu_cached_blocks();
  const int64_t base = memtune::current_rss_bytes();
  const bool peak_resets = memtune::reset_peak_rss();
  {
    at::Tensor t = file.load("big");
    const int64_t after = memtune::current_rss_bytes();
    EXPECT_GE(after - base, 60 * kMiB);
    if (peak_resets) {
      EXPECT_LE(memtune::peak_rss_bytes() - base, 64 * kMiB + 16 * kMiB);  // one copy, not two
    }
    EXPECT_TRUE(at::equal(t.slice(0, 0, n, 4099).to(at::kDouble), sample_index));
  }
  memtune::release_cpu_cached_blocks();
  EXPECT_LE(memtune::current_rss_bytes() - base, 16 * kMiB);

  at::Tensor v = file.view("big");
  EXPECT_EQ(v.sum().item<float>() > 0, true);  // touches every page of the mapping
  EXPECT_GE(memtune::current_rss_bytes() - base, 60 * kMiB);
  file.evict("big");
  EXPECT_LE(memtune::current_rss_bytes() - base, 16 * kMiB);
  // The view still reads the file's bytes.
  EXPECT_TRUE(at::equal(v.slice(0, 0, n, 4099).to(at::kDouble), sample_index));
}

// ---- malformed files: one test each, the message names the file, tensor and values ----

class SafetensorsMalformed : public ::testing::Test {
 protected:
  void SetUp() override { path_ = mt::temp_dir() / "bad.safetensors"; }
  fs::path path_;
};

TEST_F(SafetensorsMalformed, TruncatedBelowHeaderLength) {
  mt::write_file(path_, std::string("\x10\x00\x00", 3));
  expect_file_error(path_, {"3 bytes", "shorter than the 8-byte header length"});
}

TEST_F(SafetensorsMalformed, TruncatedData) {
  // A valid file with its last 4 data bytes cut off.
  write_raw(path_, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, 'x'));
  expect_file_error(path_, {"tensor 'a'", "[0, 8)", "past the end of the data section (4 bytes)"});
}

TEST_F(SafetensorsMalformed, HeaderLengthPastEnd) {
  write_raw(path_, "{}", "", 1000);
  expect_file_error(path_, {"header length 1000", "past the end of the file (10 bytes"});
}

TEST_F(SafetensorsMalformed, HeaderLengthOverCap) {
  write_raw(path_, "{}", "", int64_t(1) << 40);
  expect_file_error(path_, {"header length 1099511627776", "exceeds the limit of 100000000"});
}

TEST_F(SafetensorsMalformed, BadJson) {
  write_raw(path_, R"({"a": {"dtype": "F32", )", "");
  expect_file_error(path_, {"not valid JSON", "parse error"});
}

TEST_F(SafetensorsMalformed, DeeplyNestedHeaderIsRefusedBeforeItRecurses) {
  // 100k nested arrays in 200 KB (under the header cap) overflowed the stack while the
  // error message was built; 129 levels are already refused, 128 parse.
  write_raw(path_, "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}", "");
  expect_file_error(path_, {"the header", "nested more than 128 levels"});
  write_raw(path_, "{\"a\":" + std::string(128, '[') + std::string(128, ']') + "}", "");  // 129 levels
  expect_file_error(path_, {"nested more than 128 levels"});
  write_raw(path_, "{\"a\":" + std::string(127, '[') + std::string(127, ']') + "}", "");  // 128 levels
  expect_file_error(path_, {"tensor 'a'"});  // past the depth check: refused as a tensor entry
}

TEST_F(SafetensorsMalformed, HeaderNotAnObject) {
  write_raw(path_, "[1, 2]  ", "");
  expect_file_error(path_, {"does not start with '{'", "91"});
}

TEST_F(SafetensorsMalformed, UnknownDtype) {
  write_raw(path_, R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "abcd");
  expect_file_error(path_, {"tensor 'w'", "unknown dtype \"F33\""});
}

TEST_F(SafetensorsMalformed, FormatDtypeUnsupportedHere) {
  write_raw(path_, R"({"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "a");
  expect_file_error(path_, {"tensor 'w'", "\"F8_E4M3\"", "not supported"});
}

TEST_F(SafetensorsMalformed, ShapeSizeMismatch) {
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
            std::string(20, '\0'));
  expect_file_error(path_, {"tensor 'w'", "shape [2, 3] x F32 (4 bytes) = 24 bytes",
                            "[0, 20) hold 20 bytes"});
}

TEST_F(SafetensorsMalformed, OverlappingRanges) {
  write_raw(path_,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            std::string(12, '\0'));
  expect_file_error(path_, {"tensor 'b' at [4, 12) overlaps tensor 'a' at [0, 8)"});
}

TEST_F(SafetensorsMalformed, HoleBetweenTensors) {
  write_raw(path_,
            R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            std::string(12, '\0'));
  expect_file_error(path_, {"hole in the data section", "bytes [4, 8)", "before tensor 'b'"});
}

TEST_F(SafetensorsMalformed, HoleAtEnd) {
  write_raw(path_, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
            std::string(8, '\0'));
  expect_file_error(path_, {"hole in the data section", "bytes [4, 8) at its end", "after tensor 'a'"});
}

TEST_F(SafetensorsMalformed, HoleAtStart) {
  write_raw(path_, R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", "abcd");
  expect_file_error(path_, {"bytes [0, 2)", "before tensor 'a'"});
}

TEST_F(SafetensorsMalformed, RangePastEnd) {
  write_raw(path_, R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
            std::string(8, '\0'));
  expect_file_error(path_, {"tensor 'a'", "[0, 16)", "past the end of the data section (8 bytes)"});
}

TEST_F(SafetensorsMalformed, ReversedOffsets) {
  write_raw(path_, R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", "abcd");
  expect_file_error(path_, {"tensor 'a'", "[4, 0) end before they begin"});
}

TEST_F(SafetensorsMalformed, NegativeDimension) {
  write_raw(path_, R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", "");
  expect_file_error(path_, {"tensor 'a'", "shape [-1] must hold non-negative integers"});
}

TEST_F(SafetensorsMalformed, MissingField) {
  write_raw(path_, R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "x");
  expect_file_error(path_, {"tensor 'a'", "missing field \"dtype\""});
}

TEST_F(SafetensorsMalformed, UnexpectedField) {
  write_raw(path_, R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"offsets":[0,1]}})", "x");
  expect_file_error(path_, {"tensor 'a'", "unexpected field \"offsets\""});
}

TEST_F(SafetensorsMalformed, DuplicateTensorName) {
  write_raw(path_,
            R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
            R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
            "xy");
  expect_file_error(path_, {"tensor 'a' appears twice"});
}

TEST_F(SafetensorsMalformed, MetadataNotStrings) {
  write_raw(path_, R"({"__metadata__":{"format":"pt","step":3}})", "");
  expect_file_error(path_, {"__metadata__ key 'step' must be a string", "3"});
}

TEST_F(SafetensorsMalformed, UnknownTensorRequested) {
  write_raw(path_, R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x");
  SafetensorsFile file(path_);
  expect_error([&] { file.load("zzz"); }, path_, {"no tensor 'zzz'", "holds 1 tensors"});
}

TEST_F(SafetensorsMalformed, MissingFile) {
  expect_file_error(path_.parent_path() / "nope.safetensors", {"cannot open", "No such file"});
}

// ---- malformed sharded checkpoints ----

class CheckpointMalformed : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = mt::temp_dir();
    write_raw(dir_ / "model-00001-of-00002.safetensors",
              R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x");
    write_raw(dir_ / "model-00002-of-00002.safetensors",
              R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "y");
  }
  void index(const std::string& weight_map) {
    mt::write_file(dir_ / "model.safetensors.index.json",
                   R"({"metadata":{"total_size":2},"weight_map":)" + weight_map + "}");
  }
  fs::path index_path() const { return dir_ / "model.safetensors.index.json"; }
  fs::path dir_;
};

TEST_F(CheckpointMalformed, ValidIndexReads) {
  index(R"({"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"})");
  CheckpointReader ckpt(dir_);
  EXPECT_EQ(ckpt.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(ckpt.load("b").item<uint8_t>(), 'y');
  expect_error([&] { ckpt.info("c"); }, index_path(), {"no tensor 'c'"});
}

TEST_F(CheckpointMalformed, MissingShard) {
  index(R"({"a":"model-00001-of-00002.safetensors","b":"model-00003-of-00002.safetensors"})");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(),
               {"model-00003-of-00002.safetensors", "tensor 'b'", "does not exist"});
}

TEST_F(CheckpointMalformed, IndexNamesTensorMissingFromShard) {
  index(R"({"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors",)"
        R"("c":"model-00002-of-00002.safetensors"})");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(),
               {"tensor 'c'", "model-00002-of-00002.safetensors", "has no such tensor"});
}

TEST_F(CheckpointMalformed, ShardHoldsUnlistedTensor) {
  index(R"({"a":"model-00001-of-00002.safetensors"})");
  write_raw(dir_ / "model-00001-of-00002.safetensors",
            R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
            R"("z":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
            "xz");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(), {"tensor 'z'", "does not list"});
}

TEST_F(CheckpointMalformed, ShardOutsideTheDirectory) {
  index(R"({"a":"../model-00001-of-00002.safetensors"})");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(), {"must be a file name"});
}

TEST_F(CheckpointMalformed, IndexWithoutWeightMap) {
  mt::write_file(index_path(), R"({"metadata":{}})");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(), {"weight_map"});
}

// Found by fuzz_safetensors_index: a shard name past the system's limit made the lookup
// throw filesystem_error, not an error naming the index.
TEST_F(CheckpointMalformed, ShardNameTooLongForTheSystem) {
  index(R"({"a":")" + std::string(300, 'y') + R"(.safetensors"})");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(), {"cannot be looked up", "too long"});
}

// Found by fuzz_safetensors_index: an empty map left the reader with no shard, and
// metadata() read the first of none.
TEST_F(CheckpointMalformed, EmptyWeightMap) {
  index("{}");
  expect_error([&] { CheckpointReader c(dir_); }, index_path(), {"weight_map is empty"});
}

TEST_F(CheckpointMalformed, MalformedShardNamesTheShard) {
  index(R"({"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"})");
  write_raw(dir_ / "model-00002-of-00002.safetensors", "{", "");
  expect_error([&] { CheckpointReader c(dir_); }, dir_ / "model-00002-of-00002.safetensors",
               {"not valid JSON"});
}

TEST_F(CheckpointMalformed, EmptyDirectory) {
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty);
  expect_error([&] { CheckpointReader c(empty); }, empty,
               {"no checkpoint", "model.safetensors", "model.safetensors.index.json"});
}
