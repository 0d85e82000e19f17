#include "data/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "data/utf8.h"

namespace memtune::data {

namespace {
#include "data/unicode_nfc_tables.inc"

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

int ccc(uint32_t cp) {
  if (cp < 0x300) return 0;
  auto it = std::lower_bound(std::begin(kCcc), std::end(kCcc), cp,
                             [](const uint32_t* row, uint32_t v) { return row[0] < v; });
  return it != std::end(kCcc) && (*it)[0] == cp ? static_cast<int>((*it)[1]) : 0;
}

const uint32_t* find_decomp(uint32_t cp) {
  auto it = std::lower_bound(std::begin(kDecomp), std::end(kDecomp), cp,
                             [](const uint32_t* row, uint32_t v) { return row[0] < v; });
  return it != std::end(kDecomp) && (*it)[0] == cp ? *it : nullptr;
}

bool is_second(uint32_t cp) {
  static const std::vector<uint32_t> seconds = [] {
    std::vector<uint32_t> v;
    for (const auto& row : kCompose) v.push_back(row[1]);
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }();
  return std::binary_search(seconds.begin(), seconds.end(), cp);
}

// True when cp can change under NFC, or change its neighbours (quick check not "Yes").
bool interesting(uint32_t cp) {
  if (cp < 0x300) return false;
  if (cp >= kSBase && cp < kSBase + kSCount) return false;
  if ((cp >= kVBase && cp < kVBase + kVCount) || (cp > kTBase && cp < kTBase + kTCount)) return true;
  return ccc(cp) != 0 || find_decomp(cp) != nullptr || is_second(cp);
}

uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  auto it = std::lower_bound(std::begin(kCompose), std::end(kCompose), std::make_pair(a, b),
                             [](const uint32_t* row, const std::pair<uint32_t, uint32_t>& v) {
                               return row[0] != v.first ? row[0] < v.first : row[1] < v.second;
                             });
  if (it != std::end(kCompose) && (*it)[0] == a && (*it)[1] == b) return (*it)[2];
  return 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const uint32_t* row = find_decomp(cp)) {
    out.insert(out.end(), kDecompData + row[1], kDecompData + row[1] + row[2]);
  } else {
    out.push_back(cp);
  }
}
}  // namespace

std::string nfc(std::string_view text) {
  bool quick = true;
  for (size_t i = 0; i < text.size() && quick;) {
    if (static_cast<uint8_t>(text[i]) < 0xCC) {  // below U+0300
      i += static_cast<uint8_t>(text[i]) < 0x80 ? 1 : 2;
      continue;
    }
    quick = !interesting(utf8::next(text, i));
  }
  if (quick) return std::string(text);

  std::vector<uint32_t> cps;
  for (size_t i = 0; i < text.size();) decompose(utf8::next(text, i), cps);
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (ccc(cps[i]) == 0) { ++i; continue; }
    size_t j = i;
    while (j < cps.size() && ccc(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](uint32_t a, uint32_t b) { return ccc(a) < ccc(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<uint32_t> out;
  out.reserve(cps.size());
  long starter = -1;
  int last_ccc = 0;
  for (uint32_t cp : cps) {
    const int c = ccc(cp);
    if (starter >= 0) {
      const bool blocked = out.size() - 1 != static_cast<size_t>(starter) && (last_ccc == 0 || last_ccc >= c);
      if (!blocked) {
        if (uint32_t comp = compose_pair(out[starter], cp)) {
          out[starter] = comp;
          continue;
        }
      }
    }
    if (c == 0) {
      starter = static_cast<long>(out.size());
      last_ccc = 0;
    } else {
      last_ccc = c;
    }
    out.push_back(cp);
  }
  std::string s;
  s.reserve(text.size());
  for (uint32_t cp : out) utf8::append(s, cp);
  return s;
}

}  // namespace memtune::data
