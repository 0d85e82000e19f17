#pragma once
// Shared by the fuzz targets: the one rule of what a finding is. A parser may accept an
// input or refuse it with memtune::UserError; any other exception escaping, a crash or a
// sanitizer report is a finding (the target aborts, so libFuzzer saves the input).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace memtune::data {
class Tokenizer;
}

namespace memtune::fuzz {

// Runs `parse`; returns normally when it returns or throws UserError, aborts with the
// exception's type and text on anything else.
void expect_clean(const std::function<void()>& parse);

// A directory private to this process (created on first use, removed at exit) where
// targets that read files write their input.
const std::filesystem::path& scratch_dir();

// Writes `size` bytes to scratch_dir()/name and returns the path.
std::filesystem::path write_file(const std::string& name, const uint8_t* data, size_t size);

// Uses a tokenizer the way training and generation do: a fixed text plus `tail` (the
// input's last bytes) encoded with and without special tokens, every id inside the
// vocabulary (else abort), the ids decoded, the first 512 ids named and looked up again.
void exercise_tokenizer(const data::Tokenizer& tok, const std::string& tail);

// examples/tiny-tokenizer, loaded once per process (targets whose input is not a tokenizer).
const data::Tokenizer& tiny_tokenizer();

inline std::string as_string(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace memtune::fuzz
