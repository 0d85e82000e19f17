#include "data/sentencepiece_tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <queue>
#include <string>
#include <unordered_map>

#include "data/utf8.h"
#include "runtime/error.h"

namespace memtune::data {

namespace {

// The byte a BYTE piece stands for: its text is "<0xHH>" (sentencepiece writes upper-case
// hex); -1 for any other text.
int byte_piece_value(const std::string& t) {
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>' || hex(t[3]) < 0 || hex(t[4]) < 0) return -1;
  return hex(t[3]) * 16 + hex(t[4]);
}

const std::string kSpace = "\xE2\x96\x81";  // ▁, sentencepiece's whitespace symbol

// Protobuf wire format: just enough to walk ModelProto's fields.
class WireReader {
 public:
  WireReader(std::string_view data, const std::string& origin) : d_(data), origin_(origin) {}
  bool done() const { return pos_ >= d_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      MEMTUNE_CHECK(pos_ < d_.size(), origin_, ": truncated protobuf (varint at byte ", pos_,
                    "); not a SentencePiece .model file?");
      const auto b = static_cast<uint8_t>(d_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(origin_, ": malformed protobuf varint at byte ", pos_, "; not a SentencePiece .model file?");
  }
  std::string_view bytes(size_t n) {
    MEMTUNE_CHECK(n <= d_.size() - pos_, origin_, ": truncated protobuf (", n, " bytes wanted at byte ", pos_,
                  ", file has ", d_.size(), "); not a SentencePiece .model file?");
    auto s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  // Reads a field key; returns (field number, wire type).
  std::pair<uint32_t, uint32_t> key() {
    const uint64_t k = varint();
    return {static_cast<uint32_t>(k >> 3), static_cast<uint32_t>(k & 7)};
  }
  // The payload of a length-delimited field.
  std::string_view delimited() { return bytes(varint()); }
  float fixed32_float() {
    auto b = bytes(4);
    uint32_t u = 0;
    for (int i = 3; i >= 0; --i) u = (u << 8) | static_cast<uint8_t>(b[i]);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  void skip(uint32_t wire) {
    switch (wire) {
      case 0: varint(); break;
      case 1: bytes(8); break;
      case 2: delimited(); break;
      case 5: bytes(4); break;
      default: fail(origin_, ": protobuf wire type ", wire, " at byte ", pos_, " is not valid; not a SentencePiece .model file?");
    }
  }

 private:
  std::string_view d_;
  const std::string& origin_;
  size_t pos_ = 0;
};

enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

struct Piece {
  std::string text;
  float score = 0;
  int type = kNormal;
};

}  // namespace

struct SentencePieceTokenizer::Impl {
  std::string origin;
  std::vector<Piece> pieces;
  std::unordered_map<std::string, int32_t> ids;
  int model_type = 1;  // 1 unigram, 2 BPE, 3 word, 4 char
  bool byte_fallback = false, add_dummy_prefix = true, remove_extra_whitespaces = true;
  std::string charsmap;
  int32_t unk_id = 0;
  std::array<int32_t, 256> byte_ids{};
  std::vector<int32_t> prefix, suffix;
  std::vector<const Piece*> specials;  // control, unknown and user-defined pieces
  std::array<bool, 256> special_first{};  // first bytes of the specials

  void parse(std::string_view data);
  std::string normalize(std::string_view s) const;
  size_t max_piece_bytes = 0;
  float min_score = std::numeric_limits<float>::max();  // over normal pieces

  void encode_bpe(const std::string& s, std::vector<int32_t>& out) const;
  void encode_unigram(const std::string& s, std::vector<int32_t>& out) const;
  // Pieces that Viterbi / merges may produce.
  bool usable(int32_t id) const { return pieces[id].type == kNormal || pieces[id].type == kUserDefined; }
};

void SentencePieceTokenizer::Impl::parse(std::string_view data) {
  WireReader r(data, origin);
  while (!r.done()) {
    auto [field, wire] = r.key();
    if (field == 1 && wire == 2) {  // SentencePiece
      WireReader p(r.delimited(), origin);
      Piece piece;
      while (!p.done()) {
        auto [f, w] = p.key();
        if (f == 1 && w == 2) piece.text = std::string(p.delimited());
        else if (f == 2 && w == 5) piece.score = p.fixed32_float();
        else if (f == 3 && w == 0) piece.type = static_cast<int>(p.varint());
        else p.skip(w);
      }
      pieces.push_back(std::move(piece));
    } else if (field == 2 && wire == 2) {  // TrainerSpec
      WireReader t(r.delimited(), origin);
      while (!t.done()) {
        auto [f, w] = t.key();
        if (f == 3 && w == 0) model_type = static_cast<int>(t.varint());
        else if (f == 35 && w == 0) byte_fallback = t.varint() != 0;
        else t.skip(w);
      }
    } else if (field == 3 && wire == 2) {  // NormalizerSpec
      WireReader n(r.delimited(), origin);
      while (!n.done()) {
        auto [f, w] = n.key();
        if (f == 2 && w == 2) charsmap = std::string(n.delimited());
        else if (f == 3 && w == 0) add_dummy_prefix = n.varint() != 0;
        else if (f == 4 && w == 0) remove_extra_whitespaces = n.varint() != 0;
        else n.skip(w);
      }
    } else {
      r.skip(wire);
    }
  }
  MEMTUNE_CHECK(!pieces.empty(), origin, ": no pieces; not a SentencePiece .model file?");
  MEMTUNE_CHECK(model_type == 1 || model_type == 2, origin, ": SentencePiece model type ",
                model_type == 3 ? "word" : model_type == 4 ? "char" : std::to_string(model_type),
                " is not supported; memtune reads BPE and unigram .model files. Use the model's "
                "tokenizer.json if it has one");
  MEMTUNE_CHECK(charsmap.empty(), origin, ": a precompiled normalization charsmap is not supported; use the "
                "model's tokenizer.json if it has one");
  byte_ids.fill(-1);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    ids.emplace(p.text, static_cast<int32_t>(i));
    if (p.type == kUnknown) unk_id = static_cast<int32_t>(i);
    if (p.type == kNormal) {
      min_score = std::min(min_score, p.score);
      max_piece_bytes = std::max(max_piece_bytes, p.text.size());
    }
    if ((p.type == kControl || p.type == kUnknown || p.type == kUserDefined) && !p.text.empty()) {
      specials.push_back(&p);
      special_first[static_cast<uint8_t>(p.text[0])] = true;
    }
    if (p.type == kByte) {
      const int b = byte_piece_value(p.text);
      MEMTUNE_CHECK(b >= 0, origin, ": piece ", i, " is of type BYTE but its text '", p.text.substr(0, 32),
                    "' is not <0xHH>; the file is damaged");
      byte_ids[b] = static_cast<int32_t>(i);
    }
  }
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b)
      MEMTUNE_CHECK(byte_ids[b] >= 0, origin, ": byte_fallback is set but the byte piece for ", b, " is missing");
  }
}

std::string SentencePieceTokenizer::Impl::normalize(std::string_view in) const {
  std::string s(in);
  if (remove_extra_whitespaces) {
    std::string t;
    for (char c : s) {
      if (c == ' ' && (t.empty() || t.back() == ' ')) continue;
      t += c;
    }
    while (!t.empty() && t.back() == ' ') t.pop_back();
    s.swap(t);
  }
  if (s.empty()) return s;
  std::string out = add_dummy_prefix ? kSpace : "";
  for (char c : s) {
    if (c == ' ') out += kSpace;
    else out += c;
  }
  return out;
}

// sentencepiece's BPE: merge the adjacent pair whose concatenation is the highest-scored
// piece, leftmost among equal scores; then pieces left unknown become bytes or <unk>.
void SentencePieceTokenizer::Impl::encode_bpe(const std::string& s, std::vector<int32_t>& out) const {
  struct Sym { size_t start, len; int prev, next; };
  std::vector<Sym> syms;
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::max(1, utf8::valid_length(s, i));
    const int k = static_cast<int>(syms.size());
    syms.push_back({i, n, k - 1, -1});
    if (k > 0) syms[k - 1].next = k;
    i += n;
  }
  struct Pair { float score; int left, right; size_t len; };
  auto lower = [](const Pair& a, const Pair& b) { return a.score != b.score ? a.score < b.score : a.left > b.left; };
  std::priority_queue<Pair, std::vector<Pair>, decltype(lower)> agenda(lower);
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t len = syms[left].len + syms[right].len;
    auto it = ids.find(s.substr(syms[left].start, len));
    if (it == ids.end() || pieces[it->second].type == kUnused) return;
    agenda.push({pieces[it->second].score, left, right, len});
  };
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) consider(i, i + 1);
  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Sym& l = syms[top.left];
    Sym& r = syms[top.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.len || l.next != top.right) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = top.left;
    consider(l.prev, top.left);
    consider(top.left, l.next);
  }
  bool last_unk = false;
  for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) {
    const std::string piece = s.substr(syms[i].start, syms[i].len);
    auto it = ids.find(piece);
    if (it != ids.end() && pieces[it->second].type != kUnused) {
      out.push_back(it->second);
      last_unk = false;
    } else if (byte_fallback) {
      for (char c : piece) out.push_back(byte_ids[static_cast<uint8_t>(c)]);
      last_unk = false;
    } else {
      if (!last_unk) out.push_back(unk_id);
      last_unk = true;
    }
  }
}

// sentencepiece's unigram: the segmentation with the highest total score (Viterbi); a
// character no piece covers is <unk> with score min_score - 10, consecutive ones fused,
// or its bytes with byte fallback.
void SentencePieceTokenizer::Impl::encode_unigram(const std::string& s, std::vector<int32_t>& out) const {
  constexpr float kUnkPenalty = 10.0f;
  const size_t n = s.size();
  std::vector<double> best(n + 1, -1e300);
  std::vector<size_t> from(n + 1, 0);
  std::vector<int32_t> via(n + 1, -1);  // piece id, or -1 for <unk>
  best[0] = 0;
  for (size_t i = 0; i < n;) {
    const size_t clen = std::max(1, utf8::valid_length(s, i));
    if (best[i] > -1e300) {
      bool single = false;
      for (size_t len = 1; len <= max_piece_bytes && i + len <= n; ++len) {
        if (i + len < n && (static_cast<uint8_t>(s[i + len]) & 0xC0) == 0x80) continue;  // mid-character
        auto it = ids.find(s.substr(i, len));
        if (it == ids.end() || !usable(it->second)) continue;
        if (len == clen) single = true;
        const double sc = best[i] + pieces[it->second].score;
        if (sc > best[i + len]) { best[i + len] = sc; from[i + len] = i; via[i + len] = it->second; }
      }
      if (!single) {
        const double sc = best[i] + (min_score - kUnkPenalty);
        if (sc > best[i + clen]) { best[i + clen] = sc; from[i + clen] = i; via[i + clen] = -1; }
      }
    }
    i += clen;
  }
  std::vector<std::pair<size_t, int32_t>> path;  // (start, id or -1)
  for (size_t e = n; e > 0; e = from[e]) path.emplace_back(from[e], via[e]);
  std::reverse(path.begin(), path.end());
  bool last_unk = false;
  for (size_t k = 0; k < path.size(); ++k) {
    auto [start, id] = path[k];
    if (id >= 0) { out.push_back(id); last_unk = false; continue; }
    const size_t end = k + 1 < path.size() ? path[k + 1].first : n;
    if (byte_fallback) {
      for (size_t b = start; b < end; ++b) out.push_back(byte_ids[static_cast<uint8_t>(s[b])]);
    } else if (!last_unk) {
      out.push_back(unk_id);
    }
    last_unk = !byte_fallback;
  }
}

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& bytes, const std::string& origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->origin = origin;
  impl_->parse(bytes);
  for (size_t i = 0; i < impl_->pieces.size(); ++i) {
    const auto& p = impl_->pieces[i];
    if (p.type != kControl) continue;
    if (p.text == "<s>") bos_id = static_cast<int32_t>(i);
    if (p.text == "</s>") eos_id = static_cast<int32_t>(i);
    if (p.text == "<pad>") pad_id = static_cast<int32_t>(i);
  }
  if (bos_id) impl_->prefix = {*bos_id};  // sentencepiece / LlamaTokenizer add bos only
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const std::string t = utf8::lossy(text);
  std::vector<int32_t> out;
  if (add_special_tokens) out = impl_->prefix;
  // Control, unknown and user-defined pieces in the text: leftmost-longest, kept whole.
  size_t emitted = 0;
  auto flush_text = [&](size_t end) {
    if (end <= emitted) return;
    const std::string norm = impl_->normalize(std::string_view(t).substr(emitted, end - emitted));
    if (impl_->model_type == 1) impl_->encode_unigram(norm, out);
    else impl_->encode_bpe(norm, out);
  };
  for (size_t i = 0; i < t.size();) {
    if (!impl_->special_first[static_cast<uint8_t>(t[i])]) { ++i; continue; }
    const Piece* best = nullptr;
    for (const Piece* p : impl_->specials) {
      if ((!best || p->text.size() > best->text.size()) && t.compare(i, p->text.size(), p->text) == 0)
        best = p;
    }
    if (!best) { ++i; continue; }
    flush_text(i);
    out.push_back(impl_->ids.at(best->text));
    i += best->text.size();
    emitted = i;
  }
  flush_text(t.size());
  if (add_special_tokens) out.insert(out.end(), impl_->suffix.begin(), impl_->suffix.end());
  return out;
}

// As transformers' converted Llama tokenizers decode: ▁ -> space, runs of byte pieces ->
// UTF-8 (one U+FFFD per byte when invalid), concatenate, drop one leading space.
std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string out, pending;
  size_t n_pending = 0;
  auto flush = [&] {
    if (!n_pending) return;
    if (utf8::is_valid(pending)) out += pending;
    else for (size_t k = 0; k < n_pending; ++k) out += "\xEF\xBF\xBD";
    pending.clear();
    n_pending = 0;
  };
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(impl_->pieces.size())) continue;
    const Piece& p = impl_->pieces[id];
    if (skip_special_tokens && (p.type == kControl || p.type == kUnknown)) continue;
    if (p.type == kByte) {
      pending += static_cast<char>(byte_piece_value(p.text));  // checked <0xHH> on load
      ++n_pending;
      continue;
    }
    flush();
    std::string t = p.text;
    for (size_t pos = 0; (pos = t.find(kSpace, pos)) != std::string::npos;) t.replace(pos, kSpace.size(), " ");
    out += t;
  }
  flush();
  if (!out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

int64_t SentencePieceTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->pieces.size()); }

std::optional<int32_t> SentencePieceTokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->ids.find(std::string(token));
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

std::string SentencePieceTokenizer::id_to_token(int32_t id) const {
  MEMTUNE_CHECK(id >= 0 && id < static_cast<int32_t>(impl_->pieces.size()), impl_->origin, ": token id ", id,
                " is not in the vocabulary (size ", impl_->pieces.size(), ")");
  return impl_->pieces[id].text;
}

void SentencePieceTokenizer::set_special_affixes(std::vector<int32_t> prefix, std::vector<int32_t> suffix) {
  impl_->prefix = std::move(prefix);
  impl_->suffix = std::move(suffix);
}

}  // namespace memtune::data
