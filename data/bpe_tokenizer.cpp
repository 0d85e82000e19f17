#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "data/unicode_nfc.h"
#include "data/utf8.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::data {

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------
// Unicode White_Space, which \s means in Oniguruma (the library's engine). PCRE2's \s also
// takes U+180E (Perl's old horizontal space), so patterns get this class spelled out.
const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// \s -> [White_Space] and \S -> [^White_Space] outside classes; \s inside a class -> its
// members. (\S inside a class is left to PCRE2.)
std::string spell_out_whitespace(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      else if (e == 'S' && !in_class) out += "[^" + std::string(kWhiteSpace) + "]";
      else { out += c; out += e; }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a literal ] first
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Regex: PCRE2 with UTF and UCP, so \p{L}, \p{N} and \s are Unicode-aware as in the
// Oniguruma engine the tokenizers library uses.
class Regex {
 public:
  Regex(const std::string& original, const std::string& where) {
    const std::string pattern = spell_out_whitespace(original);
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      fail(where, ": regex does not compile at offset ", offset, ": ",
           reinterpret_cast<const char*>(msg.data()), " (pattern ", json(original).dump(), ")");
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-empty matches of the pattern in s, left to right, as [begin, end) byte offsets.
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create(32, nullptr), &pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t start = 0;
    while (start <= s.size()) {
      const int rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {  // e.g. a resource limit: never drop text silently
        std::array<PCRE2_UCHAR, 256> msg{};
        pcre2_get_error_message(rc, msg.data(), msg.size());
        fail("tokenizer regex failed at byte ", start, " of a ", s.size(), "-byte piece: ",
             reinterpret_cast<const char*>(msg.data()));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      if (ov[1] > ov[0]) {
        out.emplace_back(ov[0], ov[1]);
        start = ov[1];
      } else {  // empty match: step over one character
        start = ov[0] + 1;
        while (start < s.size() && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) ++start;
      }
    }
  }

 private:
  pcre2_code* code_ = nullptr;
};

const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 on.
struct ByteMap {
  std::array<std::string, 256> byte_to_str;
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = keep ? b : 256 + n++;
      utf8::append(byte_to_str[b], cp);
      cp_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

bool is_whitespace(uint32_t cp) {  // Rust's char::is_whitespace (White_Space property)
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s.swap(out);
}

std::string pattern_string(const json& pattern, const std::string& where) {
  if (pattern.is_object() && pattern.contains("String")) return pattern["String"].get<std::string>();
  fail(where, ": only {\"String\": ...} patterns are supported here, got ", pattern.dump());
}

// ---------------------------------------------------------------------------------------
// Normalizers, applied in order to each piece of text between added tokens.
struct Normalizer {
  enum Kind { kNfc, kPrepend, kReplace, kReplaceRegex, kLowercase, kStrip } kind;
  explicit Normalizer(Kind k, std::string a_ = {}) : kind(k), a(std::move(a_)) {}
  std::string a, b;  // Prepend: a; Replace: a -> b
  std::shared_ptr<Regex> regex;
  bool strip_left = false, strip_right = false;

  void apply(std::string& s) const {
    switch (kind) {
      case kNfc: s = nfc(s); break;
      case kPrepend: if (!s.empty()) s.insert(0, a); break;
      case kReplace: replace_all(s, a, b); break;
      case kReplaceRegex: {
        std::vector<std::pair<size_t, size_t>> m;
        regex->find_all(s, m);
        if (m.empty()) break;
        std::string out;
        size_t pos = 0;
        for (auto [x, y] : m) { out.append(s, pos, x - pos); out += b; pos = y; }
        out.append(s, pos, std::string::npos);
        s.swap(out);
        break;
      }
      case kLowercase:
        for (char& c : s) if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
        break;
      case kStrip: {
        size_t x = 0, y = s.size();
        if (strip_left) while (x < y) { size_t i = x; if (!is_whitespace(utf8::next(s, i))) break; x = i; }
        if (strip_right) while (y > x) {
          size_t k = y - 1;
          while (k > x && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
          size_t i = k;
          if (!is_whitespace(utf8::next(s, i))) break;
          y = k;
        }
        s = s.substr(x, y - x);
        break;
      }
    }
  }
};

void parse_normalizer(const json& j, const std::string& where, std::vector<Normalizer>& out) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& n : j.at("normalizers")) parse_normalizer(n, where, out);
  } else if (type == "NFC") {
    out.emplace_back(Normalizer::kNfc);
  } else if (type == "Prepend") {
    out.emplace_back(Normalizer::kPrepend, j.at("prepend").get<std::string>());
  } else if (type == "Replace") {
    const auto& p = j.at("pattern");
    Normalizer n(Normalizer::kReplace);
    n.b = j.at("content").get<std::string>();
    if (p.contains("Regex")) {
      n.kind = Normalizer::kReplaceRegex;
      n.regex = std::make_shared<Regex>(p["Regex"].get<std::string>(), where + ": normalizer Replace");
    } else {
      n.a = pattern_string(p, where + ": normalizer Replace");
    }
    out.push_back(std::move(n));
  } else if (type == "Lowercase") {
    out.emplace_back(Normalizer::kLowercase);
  } else if (type == "Strip") {
    Normalizer n(Normalizer::kStrip);
    n.strip_left = j.value("strip_left", false);
    n.strip_right = j.value("strip_right", false);
    out.push_back(std::move(n));
  } else {
    fail(where, ": normalizer type \"", type, "\" is not supported (supported: NFC, Prepend, ",
         "Replace, Lowercase, Strip, Sequence)");
  }
}

// ---------------------------------------------------------------------------------------
// Pre-tokenizers: split a normalized piece into words. The byte-level mapping itself is
// done by the model on raw bytes (equivalent, one mapped character per byte).
struct PreTokenizer {
  enum Kind { kSplit, kByteLevel, kMetaspace, kDigits } kind;
  explicit PreTokenizer(Kind k) : kind(k) {}
  std::shared_ptr<Regex> regex;
  std::string literal;  // Split with a String pattern
  enum Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous } behavior =
      kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  enum Prepend { kAlways, kNever, kFirst } prepend = kAlways;
  bool split = true;

  // Splits one word by the matches of the pattern according to `behavior`.
  void split_by(const std::string& w, std::vector<std::string>& out) const {
    std::vector<std::pair<size_t, size_t>> m;
    if (regex) {
      regex->find_all(w, m);
    } else if (!literal.empty()) {
      for (size_t p = 0; (p = w.find(literal, p)) != std::string::npos; p += literal.size())
        m.emplace_back(p, p + literal.size());
    }
    // (begin, end, is_match) runs covering w.
    std::vector<std::tuple<size_t, size_t, bool>> runs;
    size_t pos = 0;
    for (auto [x, y] : m) {
      if (x > pos) runs.emplace_back(pos, x, invert);
      runs.emplace_back(x, y, !invert);
      pos = y;
    }
    if (pos < w.size()) runs.emplace_back(pos, w.size(), invert);
    std::vector<std::pair<size_t, size_t>> pieces;
    for (size_t i = 0; i < runs.size(); ++i) {
      auto [x, y, is_match] = runs[i];
      switch (behavior) {
        case kIsolated: pieces.emplace_back(x, y); break;
        case kRemoved: if (!is_match) pieces.emplace_back(x, y); break;
        case kMergedWithPrevious:  // a match joins the non-match before it
          if (is_match && i > 0 && !std::get<2>(runs[i - 1])) pieces.back().second = y;
          else pieces.emplace_back(x, y);
          break;
        case kMergedWithNext:  // a non-match joins the match before it
          if (!is_match && i > 0 && std::get<2>(runs[i - 1])) pieces.back().second = y;
          else pieces.emplace_back(x, y);
          break;
        case kContiguous:
          if (i > 0 && std::get<2>(runs[i - 1]) == is_match) pieces.back().second = y;
          else pieces.emplace_back(x, y);
          break;
      }
    }
    for (auto [x, y] : pieces) out.push_back(w.substr(x, y - x));
  }

  // `first`: the piece starts the whole input (Metaspace prepend_scheme "first").
  void apply(std::vector<std::string>& words, bool first) const {
    std::vector<std::string> out;
    out.reserve(words.size());
    for (size_t i = 0; i < words.size(); ++i) {
      std::string w = std::move(words[i]);
      switch (kind) {
        case kSplit: split_by(w, out); break;
        case kByteLevel:
          if (add_prefix_space && (w.empty() || w[0] != ' ')) w.insert(0, " ");
          if (regex) split_by(w, out);
          else out.push_back(std::move(w));
          break;
        case kMetaspace: {
          replace_all(w, " ", replacement);
          if ((prepend == kAlways || (prepend == kFirst && first && i == 0)) &&
              w.compare(0, replacement.size(), replacement) != 0)
            w.insert(0, replacement);
          if (split) split_by(w, out);
          else out.push_back(std::move(w));
          break;
        }
        case kDigits: split_by(w, out); break;
      }
    }
    words.swap(out);
  }
};

PreTokenizer::Behavior parse_behavior(const json& j, const std::string& where) {
  const std::string b = j.value("behavior", "Isolated");
  if (b == "Isolated") return PreTokenizer::kIsolated;
  if (b == "Removed") return PreTokenizer::kRemoved;
  if (b == "MergedWithPrevious") return PreTokenizer::kMergedWithPrevious;
  if (b == "MergedWithNext") return PreTokenizer::kMergedWithNext;
  if (b == "Contiguous") return PreTokenizer::kContiguous;
  fail(where, ": Split behavior \"", b, "\" is unknown");
}

void parse_pre_tokenizer(const json& j, const std::string& where, std::vector<PreTokenizer>& out,
                         bool& byte_level) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : j.at("pretokenizers")) parse_pre_tokenizer(p, where, out, byte_level);
  } else if (type == "Split") {
    PreTokenizer p(PreTokenizer::kSplit);
    const auto& pat = j.at("pattern");
    if (pat.contains("Regex")) p.regex = std::make_shared<Regex>(pat["Regex"].get<std::string>(), where + ": pre_tokenizer Split");
    else p.literal = pattern_string(pat, where + ": pre_tokenizer Split");
    p.behavior = parse_behavior(j, where);
    p.invert = j.value("invert", false);
    out.push_back(std::move(p));
  } else if (type == "ByteLevel") {
    PreTokenizer p(PreTokenizer::kByteLevel);
    p.add_prefix_space = j.value("add_prefix_space", false);
    if (j.value("use_regex", true)) p.regex = std::make_shared<Regex>(kGpt2Pattern, where);
    byte_level = true;
    out.push_back(std::move(p));
  } else if (type == "Metaspace") {
    PreTokenizer p(PreTokenizer::kMetaspace);
    p.replacement = j.value("replacement", "\xE2\x96\x81");
    p.literal = p.replacement;
    p.behavior = PreTokenizer::kMergedWithNext;
    const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    p.prepend = scheme == "first" ? PreTokenizer::kFirst : scheme == "never" ? PreTokenizer::kNever : PreTokenizer::kAlways;
    p.split = j.value("split", true);
    out.push_back(std::move(p));
  } else if (type == "Digits") {
    PreTokenizer p(PreTokenizer::kDigits);
    p.regex = std::make_shared<Regex>(j.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+", where);
    out.push_back(std::move(p));
  } else {
    fail(where, ": pre_tokenizer type \"", type, "\" is not supported (supported: ByteLevel, ",
         "Split, Metaspace, Digits, Sequence)");
  }
}

// ---------------------------------------------------------------------------------------
// Decoders work on the token strings, as decode_chain does in the library.
struct Decoder {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  explicit Decoder(Kind k, std::string a_ = {}, std::string b_ = {}) : kind(k), a(std::move(a_)), b(std::move(b_)) {}
  std::string a, b;  // Replace a -> b; Strip/Metaspace: a = content/replacement
  int start = 0, stop = 0;
  bool prepend = true;  // Metaspace: drop the replacement in the first token

  void apply(std::vector<std::string>& tokens) const {
    switch (kind) {
      case kByteLevel: {
        const auto& map = byte_map().cp_to_byte;
        std::string bytes;
        for (const auto& t : tokens) {
          std::string mapped;
          bool ok = true;
          for (size_t i = 0; i < t.size() && ok;) {
            auto it = map.find(utf8::next(t, i));
            if (it == map.end()) ok = false;
            else mapped += static_cast<char>(it->second);
          }
          bytes += ok ? mapped : t;
        }
        tokens.assign(1, utf8::lossy(bytes));
        break;
      }
      case kReplace:
        for (auto& t : tokens) replace_all(t, a, b);
        break;
      case kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        size_t n_pending = 0;
        auto flush = [&] {
          if (!n_pending) return;
          if (utf8::is_valid(pending)) out.push_back(pending);
          else for (size_t k = 0; k < n_pending; ++k) out.emplace_back("\xEF\xBF\xBD");
          pending.clear();
          n_pending = 0;
        };
        for (auto& t : tokens) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && isxdigit(t[3]) && isxdigit(t[4])) {
            pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++n_pending;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case kFuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        tokens.assign(1, all);
        break;
      }
      case kStrip: {
        const uint32_t c = [&] { size_t i = 0; return utf8::next(a, i); }();
        for (auto& t : tokens) {
          size_t x = 0;
          for (int k = 0; k < start && x < t.size(); ++k) {
            size_t i = x;
            if (utf8::next(t, i) != c) break;
            x = i;
          }
          size_t y = t.size();
          for (int k = 0; k < stop && y > x; ++k) {
            size_t p = y - 1;
            while (p > x && (static_cast<uint8_t>(t[p]) & 0xC0) == 0x80) --p;
            size_t i = p;
            if (utf8::next(t, i) != c) break;
            y = p;
          }
          t = t.substr(x, y - x);
        }
        break;
      }
      case kMetaspace:
        for (size_t k = 0; k < tokens.size(); ++k) {
          if (k == 0 && prepend) replace_all(tokens[k], a, "");
          else replace_all(tokens[k], a, " ");
        }
        break;
    }
  }
};

void parse_decoder(const json& j, const std::string& where, std::vector<Decoder>& out) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& d : j.at("decoders")) parse_decoder(d, where, out);
  } else if (type == "ByteLevel") {
    out.emplace_back(Decoder::kByteLevel);
  } else if (type == "Replace") {
    out.emplace_back(Decoder::kReplace, pattern_string(j.at("pattern"), where + ": decoder Replace"),
                     j.at("content").get<std::string>());
  } else if (type == "ByteFallback") {
    out.emplace_back(Decoder::kByteFallback);
  } else if (type == "Fuse") {
    out.emplace_back(Decoder::kFuse);
  } else if (type == "Strip") {
    Decoder d(Decoder::kStrip, j.at("content").get<std::string>());
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
    out.push_back(std::move(d));
  } else if (type == "Metaspace") {
    Decoder d(Decoder::kMetaspace, j.value("replacement", "\xE2\x96\x81"));
    const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    d.prepend = scheme != "never";
    out.push_back(std::move(d));
  } else {
    fail(where, ": decoder type \"", type, "\" is not supported (supported: ByteLevel, Replace, ",
         "ByteFallback, Fuse, Strip, Metaspace, Sequence)");
  }
}

// ---------------------------------------------------------------------------------------
// Added tokens, matched leftmost-longest in the text (as the library's Aho-Corasick does).
struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    if (t->content.empty()) return;
    int node = 0;
    for (char ch : t->content) {
      const auto c = static_cast<uint8_t>(ch);
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        nodes_.push_back({});
        it = nodes_[node].next.emplace(c, static_cast<int>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[node].token = t;
    first_[static_cast<uint8_t>(t->content[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }

  // Pieces of `s`: text (token == nullptr) and added tokens, in order.
  struct Piece {
    std::string_view text;
    const AddedToken* token;
  };
  void split(std::string_view s, std::vector<Piece>& out) const {
    size_t emitted = 0;  // text before this offset has been output
    size_t i = 0;
    while (i < s.size()) {
      if (!first_[static_cast<uint8_t>(s[i])]) { ++i; continue; }
      const AddedToken* best = nullptr;
      size_t best_end = 0;
      int node = 0;
      for (size_t k = i; k < s.size(); ++k) {
        auto it = nodes_[node].next.find(static_cast<uint8_t>(s[k]));
        if (it == nodes_[node].next.end()) break;
        node = it->second;
        if (nodes_[node].token) { best = nodes_[node].token; best_end = k + 1; }
      }
      if (!best || (best->single_word && !single_word_ok(s, i, best_end))) { ++i; continue; }
      size_t start = i, end = best_end;
      if (best->lstrip) while (start > emitted && is_space_before(s, start)) start = prev_char(s, start);
      if (best->rstrip) while (end < s.size()) {
        size_t k = end;
        if (!is_whitespace(utf8::next(s, k))) break;
        end = k;
      }
      if (start > emitted) out.push_back({s.substr(emitted, start - emitted), nullptr});
      out.push_back({s.substr(start, end - start), best});
      emitted = i = end;
    }
    if (emitted < s.size()) out.push_back({s.substr(emitted), nullptr});
  }

 private:
  static size_t prev_char(std::string_view s, size_t i) {
    do { --i; } while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80);
    return i;
  }
  static bool is_space_before(std::string_view s, size_t i) {
    size_t k = prev_char(s, i);
    return is_whitespace(utf8::next(s, k));
  }
  static bool is_word(uint32_t cp) {
    return cp == '_' || (cp < 0x80 ? std::isalnum(static_cast<int>(cp)) != 0 : !is_whitespace(cp));
  }
  static bool single_word_ok(std::string_view s, size_t start, size_t end) {
    if (start > 0) { size_t k = prev_char(s, start); if (is_word(utf8::next(s, k))) return false; }
    if (end < s.size()) { size_t k = end; if (is_word(utf8::next(s, k))) return false; }
    return true;
  }
  struct Node {
    std::unordered_map<uint8_t, int> next;
    const AddedToken* token = nullptr;
  };
  std::vector<Node> nodes_{1};
  std::array<bool, 256> first_{};
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

// =========================================================================================
struct BpeTokenizer::Impl {
  std::string origin;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_vocab;  // index = id; empty where unused
  struct Merge { int32_t rank, new_id; };
  std::unordered_map<uint64_t, Merge> merges;
  bool byte_level = false, byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::optional<int32_t> unk_id;
  std::array<int32_t, 256> byte_ids{};      // byte-level: id of each byte's mapped char
  std::array<int32_t, 256> fallback_ids{};  // byte fallback: id of <0xXX>, -1 if missing

  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<Decoder> decoders;
  std::vector<int32_t> prefix, suffix;  // post-processor's special tokens

  std::vector<std::unique_ptr<AddedToken>> added;
  std::unordered_map<std::string, const AddedToken*> added_by_content;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  AddedMatcher raw_matcher, normalized_matcher;
  int64_t size = 0;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;
  static constexpr size_t kCacheCapacity = 1 << 18;
  static constexpr size_t kCacheMaxWord = 256;

  void parse(const std::string& text);
  void parse_model(const json& m);
  void parse_post_processor(const json& j);
  void word_ids(const std::string& word, std::vector<int32_t>& out) const;
  void merge_word(const std::string& word, std::vector<int32_t>& out) const;
  void encode_text(std::string_view text, bool first, std::vector<int32_t>& out) const;
};

namespace {

// A token id read from the file: an integer in [0, kMaxTokenId]. Ids index tables sized by
// the largest one, so a negative or huge id must be refused before anything is written.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;  // 16.7M; the largest real vocabularies hold ~260k

int32_t token_id(const json& v, const std::string& origin, const std::string& where) {
  MEMTUNE_CHECK(v.is_number_integer(), origin, ": ", where, " is ", v.dump(), "; a token id must be an integer");
  const bool negative = v.is_number_unsigned() ? false : v.get<int64_t>() < 0;
  MEMTUNE_CHECK(!negative && v.get<uint64_t>() <= static_cast<uint64_t>(kMaxTokenId), origin, ": ", where,
                " is ", v.dump(), "; token ids lie in 0..", kMaxTokenId, " (is this file damaged?)");
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace

void BpeTokenizer::Impl::parse(const std::string& text) {
  check_json_depth(text, origin);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    fail(origin, ": not valid JSON (", e.what(), "); a Hugging Face tokenizer.json was expected");
  }
  MEMTUNE_CHECK(j.is_object() && j.contains("model"), origin,
                ": no \"model\" key; this is not a Hugging Face tokenizer.json");
  try {
    parse_model(j["model"]);
    parse_normalizer(j.value("normalizer", json()), origin, normalizers);
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), origin, pre_tokenizers, byte_level);
    parse_decoder(j.value("decoder", json()), origin, decoders);
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      for (const auto& a : j["added_tokens"]) {
        auto t = std::make_unique<AddedToken>(AddedToken{
            a.at("content").get<std::string>(), token_id(a.at("id"), origin, "added_tokens[].id"), a.value("special", false),
            a.value("lstrip", false), a.value("rstrip", false), a.value("single_word", false),
            a.value("normalized", !a.value("special", false))});
        added_by_content[t->content] = t.get();
        added_by_id[t->id] = t.get();
        size = std::max<int64_t>(size, t->id + 1);
        added.push_back(std::move(t));
      }
      for (const auto& t : added) (t->normalized && !normalizers.empty() ? normalized_matcher : raw_matcher).add(t.get());
    }
    parse_post_processor(j.value("post_processor", json()));
  } catch (const json::exception& e) {
    fail(origin, ": unexpected structure (", e.what(), ")");
  }
}

void BpeTokenizer::Impl::parse_model(const json& m) {
  const std::string type = m.value("type", "BPE");
  MEMTUNE_CHECK(type == "BPE", origin, ": model type \"", type,
                "\" is not supported; memtune reads BPE tokenizer.json files (GPT-2, Llama, Qwen, Mistral)");
  MEMTUNE_CHECK(m.contains("vocab") && m["vocab"].is_object(), origin, ": model.vocab is missing or not an object");
  MEMTUNE_CHECK(m.contains("merges") && m["merges"].is_array(), origin,
                ": model.merges is missing or not a list; a BPE model needs its merges");
  for (const std::string key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    MEMTUNE_CHECK(!m.contains(key) || m[key].is_null() || m[key].get<std::string>().empty(), origin,
                  ": model.", key, " is not supported (got ", m[key].dump(), ")");
  }
  MEMTUNE_CHECK(!m.contains("dropout") || m["dropout"].is_null() || m["dropout"].get<double>() == 0.0,
                origin, ": model.dropout is not supported (it makes encoding random)");
  byte_fallback = m.value("byte_fallback", false);
  fuse_unk = m.value("fuse_unk", false);
  ignore_merges = m.value("ignore_merges", false);
  vocab.reserve(m["vocab"].size());
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    const int32_t id = token_id(it.value(), origin, "model.vocab[" + json(it.key()).dump() + "]");
    vocab.emplace(it.key(), id);
    if (id >= static_cast<int32_t>(id_to_vocab.size())) id_to_vocab.resize(id + 1);
    id_to_vocab[id] = it.key();
  }
  size = static_cast<int64_t>(id_to_vocab.size());
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = vocab.find(m["unk_token"].get<std::string>());
    MEMTUNE_CHECK(it != vocab.end(), origin, ": model.unk_token ", m["unk_token"].dump(), " is not in the vocab");
    unk_id = it->second;
  }
  const auto& ms = m["merges"];
  merges.reserve(ms.size());
  int32_t rank = 0;
  for (const auto& e : ms) {
    std::string a, b;
    if (e.is_string()) {  // "a b"
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      MEMTUNE_CHECK(sp != std::string::npos, origin, ": merge ", rank, " ", e.dump(), " has no space between its two parts");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MEMTUNE_CHECK(e.is_array() && e.size() == 2, origin, ": merge ", rank, " ", e.dump(),
                    " is neither \"a b\" nor [a, b]");
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    MEMTUNE_CHECK(ia != vocab.end() && ib != vocab.end() && ic != vocab.end(), origin, ": merge ", rank,
                  " ", e.dump(), ": a part or the merged token is not in model.vocab");
    merges.emplace(pair_key(ia->second, ib->second), Merge{rank, ic->second});
    ++rank;
  }
  fallback_ids.fill(-1);
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = vocab.find(name);
      if (it != vocab.end()) fallback_ids[b] = it->second;
    }
  }
}

void BpeTokenizer::Impl::parse_post_processor(const json& j) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : j.at("processors")) parse_post_processor(p);
  } else if (type == "ByteLevel") {
    // Offsets only; ids unchanged.
  } else if (type == "TemplateProcessing") {
    bool seen_a = false;
    for (const auto& item : j.at("single")) {
      if (item.contains("Sequence")) { seen_a = true; continue; }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      const auto& st = j.at("special_tokens");
      MEMTUNE_CHECK(st.contains(name), origin, ": post_processor names special token \"", name,
                    "\" missing from its special_tokens");
      for (const auto& v : st[name].at("ids")) {
        const int32_t id = token_id(v, origin, "post_processor.special_tokens[" + json(name).dump() + "].ids[]");
        // The library would emit it as it is; an id no token has would index past the embedding.
        MEMTUNE_CHECK(id < size, origin, ": post_processor's special token ", json(name).dump(), " has id ", id,
                      ", which neither model.vocab nor added_tokens holds (they end at ", size - 1,
                      "); is the token missing from added_tokens?");
        (seen_a ? suffix : prefix).push_back(id);
      }
    }
  } else {
    fail(origin, ": post_processor type \"", type, "\" is not supported (supported: TemplateProcessing, ByteLevel, Sequence)");
  }
}

// BPE on one pre-tokenized word: initial symbols, then merges lowest rank first (leftmost
// among equals), as the library's Word::merge_all does.
void BpeTokenizer::Impl::merge_word(const std::string& word, std::vector<int32_t>& out) const {
  struct Sym { int32_t id; int prev, next; bool alive; };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  auto push = [&](int32_t id) {
    const int n = static_cast<int>(syms.size());
    syms.push_back({id, n - 1, -1, true});
    if (n > 0) syms[n - 1].next = n;
  };
  if (byte_level) {
    for (char c : word) push(byte_ids[static_cast<uint8_t>(c)]);
  } else {
    bool last_unk = false;
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::max(1, utf8::valid_length(word, i));
      auto it = vocab.find(word.substr(i, n));
      if (it != vocab.end()) {
        push(it->second);
        last_unk = false;
      } else {
        bool done = false;
        if (byte_fallback) {
          done = true;
          for (size_t k = i; k < i + n; ++k) done = done && fallback_ids[static_cast<uint8_t>(word[k])] >= 0;
          if (done) for (size_t k = i; k < i + n; ++k) push(fallback_ids[static_cast<uint8_t>(word[k])]);
        }
        if (done) {
          last_unk = false;
        } else if (unk_id) {
          if (!(fuse_unk && last_unk)) push(*unk_id);
          last_unk = true;
        }
      }
      i += n;
    }
  }
  struct Cand { int32_t rank; int pos; int32_t new_id; };
  auto later = [](const Cand& x, const Cand& y) { return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos; };
  std::priority_queue<Cand, std::vector<Cand>, decltype(later)> queue(later);
  auto consider = [&](int pos) {
    const int nx = syms[pos].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(syms[pos].id, syms[nx].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Cand top = queue.top();
    queue.pop();
    Sym& left = syms[top.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = syms[left.next];
    auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[right.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

void BpeTokenizer::Impl::word_ids(const std::string& word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    std::string mapped;
    const std::string* key = &word;
    if (byte_level) {
      for (char c : word) mapped += byte_map().byte_to_str[static_cast<uint8_t>(c)];
      key = &mapped;
    }
    auto it = vocab.find(*key);
    if (it != vocab.end()) { out.push_back(it->second); return; }
  }
  const bool cacheable = word.size() <= kCacheMaxWord;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(word);
    if (it != cache.end()) { out.insert(out.end(), it->second.begin(), it->second.end()); return; }
  }
  const size_t before = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() < kCacheCapacity) cache.emplace(word, std::vector<int32_t>(out.begin() + before, out.end()));
  }
}

// A piece of input between added tokens: normalize, split out normalized added tokens,
// pre-tokenize, BPE.
void BpeTokenizer::Impl::encode_text(std::string_view text, bool first, std::vector<int32_t>& out) const {
  std::string norm(text);
  for (const auto& n : normalizers) n.apply(norm);
  std::vector<AddedMatcher::Piece> pieces;
  if (normalized_matcher.empty()) pieces.push_back({norm, nullptr});
  else normalized_matcher.split(norm, pieces);
  std::vector<std::string> words;
  for (const auto& p : pieces) {
    if (p.token) { out.push_back(p.token->id); continue; }
    words.assign(1, std::string(p.text));
    for (const auto& pt : pre_tokenizers) pt.apply(words, first && p.text.data() == norm.data());
    for (const auto& w : words) word_ids(w, out);
  }
}

BpeTokenizer::BpeTokenizer(const std::string& json_text, const std::string& origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->origin = origin;
  impl_->parse(json_text);
  if (impl_->byte_level) {
    for (int b = 0; b < 256; ++b) {
      auto it = impl_->vocab.find(byte_map().byte_to_str[b]);
      MEMTUNE_CHECK(it != impl_->vocab.end(), origin, ": byte-level tokenizer but the vocab lacks the token for byte ",
                    b, " (", json(byte_map().byte_to_str[b]).dump(), ")");
      impl_->byte_ids[b] = it->second;
    }
  }
}

BpeTokenizer::~BpeTokenizer() = default;

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (!utf8::is_valid(text)) {
    repaired = utf8::lossy(text);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  if (add_special_tokens) out = impl_->prefix;
  std::vector<AddedMatcher::Piece> pieces;
  if (impl_->raw_matcher.empty()) pieces.push_back({text, nullptr});
  else impl_->raw_matcher.split(text, pieces);
  for (const auto& p : pieces) {
    if (p.token) out.push_back(p.token->id);
    else impl_->encode_text(p.text, p.text.data() == text.data(), out);
  }
  if (add_special_tokens) out.insert(out.end(), impl_->suffix.begin(), impl_->suffix.end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    auto it = impl_->added_by_id.find(id);
    if (it != impl_->added_by_id.end()) {
      if (!(skip_special_tokens && it->second->special)) tokens.push_back(it->second->content);
    } else if (id >= 0 && id < static_cast<int32_t>(impl_->id_to_vocab.size()) && !impl_->id_to_vocab[id].empty()) {
      tokens.push_back(impl_->id_to_vocab[id]);
    }  // unknown ids are dropped, as the library does
  }
  if (impl_->decoders.empty()) {
    std::string s;
    for (size_t i = 0; i < tokens.size(); ++i) s += (i ? " " : "") + tokens[i];
    return s;
  }
  for (const auto& d : impl_->decoders) d.apply(tokens);
  std::string s;
  for (const auto& t : tokens) s += t;
  return s;
}

int64_t BpeTokenizer::vocab_size() const { return impl_->size; }

std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end()) return it->second->id;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::string BpeTokenizer::id_to_token(int32_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) return it->second->content;
  MEMTUNE_CHECK(id >= 0 && id < static_cast<int32_t>(impl_->id_to_vocab.size()) && !impl_->id_to_vocab[id].empty(),
                impl_->origin, ": token id ", id, " is not in the vocabulary (size ", impl_->size, ")");
  return impl_->id_to_vocab[id];
}

void BpeTokenizer::set_special_affixes(std::vector<int32_t> prefix, std::vector<int32_t> suffix) {
  impl_->prefix = std::move(prefix);
  impl_->suffix = std::move(suffix);
}

}  // namespace memtune::data
