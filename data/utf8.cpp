#include "data/utf8.h"

namespace memtune::data::utf8 {

namespace {
// Number of bytes of s[i..] that form a prefix of a valid sequence, and the full length
// the lead byte asks for.
void scan(std::string_view s, size_t i, int& consumed, int& need) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 < 0x80) { consumed = need = 1; return; }
  if (b0 >= 0xC2 && b0 <= 0xDF) need = 2;
  else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else { consumed = 1; need = 0; return; }
  consumed = 1;
  for (int k = 1; k < need; ++k) {
    if (i + k >= s.size()) return;
    const auto b = static_cast<uint8_t>(s[i + k]);
    if (b < lo || b > hi) return;
    lo = 0x80; hi = 0xBF;
    ++consumed;
  }
}
}  // namespace

int valid_length(std::string_view s, size_t i) {
  int consumed, need;
  scan(s, i, consumed, need);
  return consumed == need ? need : 0;
}

uint32_t next(std::string_view s, size_t& i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) { ++i; return b0; }
  int n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  uint32_t cp = b0 & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
    const int n = valid_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string lossy(std::string_view s) {
  if (is_valid(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    int consumed, need;
    scan(s, i, consumed, need);
    if (consumed == need) out.append(s.substr(i, need));
    else out += "\xEF\xBF\xBD";
    i += consumed;
  }
  return out;
}

}  // namespace memtune::data::utf8
