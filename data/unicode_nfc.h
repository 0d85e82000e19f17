#pragma once
// Unicode NFC normalization (canonical decomposition, reordering, composition), for the
// NFC normalizer of tokenizer.json (Qwen). Tables from scripts/make_unicode_tables.py.
#include <string>
#include <string_view>

namespace memtune::data {

// `text` (valid UTF-8) in Normalization Form C.
std::string nfc(std::string_view text);

}  // namespace memtune::data
