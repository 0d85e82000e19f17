#pragma once
// UTF-8 helpers for the tokenizers: decoding one code point, encoding, and the lossy
// repair Rust's String::from_utf8_lossy does (each maximal invalid subpart -> U+FFFD).
#include <cstdint>
#include <string>
#include <string_view>

namespace memtune::data::utf8 {

// Length of the valid UTF-8 sequence at s[i], or 0 when the bytes there are not valid.
int valid_length(std::string_view s, size_t i);
// Decodes the code point at s[i] (which must be valid) and advances i.
uint32_t next(std::string_view s, size_t& i);
void append(std::string& out, uint32_t cp);
// True when the whole string is valid UTF-8.
bool is_valid(std::string_view s);
// Replaces every maximal invalid subpart with U+FFFD, as from_utf8_lossy does.
std::string lossy(std::string_view s);

}  // namespace memtune::data::utf8
