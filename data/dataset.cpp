#include "data/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/chat_template.h"
#include "data/mapped_file.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "runtime/json_input.h"
#include "runtime/log.h"

namespace memtune::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const char* kInstructionShape =
    "the instruction format expects {\"instruction\": string, \"input\": string (optional), \"output\": string}";
const char* kChatShape = "the chat format expects {\"messages\": [{\"role\": string, \"content\": string}, ...]}";

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// Calls f(line_number, line) for each line of `text` (1-based; '\r' of CRLF removed).
template <class F> void for_each_line(std::string_view text, F&& f) {
  int64_t number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!f(++number, line)) return;
    pos = end + 1;
  }
}

std::string excerpt(std::string_view line, size_t at) {
  const size_t from = at > 30 ? at - 30 : 0;
  std::string s(line.substr(from, 60));
  return (from > 0 ? "..." : "") + s + (from + 60 < line.size() ? "..." : "");
}

const char* json_type(const json& j) { return j.type_name(); }

// A record that cannot be used: its message (without file:line).
struct Invalid {
  std::string message;
};

std::string string_field(const json& j, const char* field, const char* shape, bool optional = false) {
  const auto it = j.find(field);
  if (it == j.end() || (optional && it->is_null())) {
    if (optional) return {};
    throw Invalid{str_cat("field '", field, "' is missing; ", shape)};
  }
  if (!it->is_string()) throw Invalid{str_cat("field '", field, "' is a ", json_type(*it), ", not a string; ", shape)};
  return it->get<std::string>();
}

std::vector<Message> chat_messages(const json& j) {
  const auto it = j.find("messages");
  if (it == j.end()) throw Invalid{str_cat("field 'messages' is missing; ", kChatShape)};
  if (!it->is_array() || it->empty())
    throw Invalid{str_cat("field 'messages' is ", it->is_array() ? "empty" : str_cat("a ", json_type(*it)),
                          "; ", kChatShape)};
  std::vector<Message> out;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    if (!m.is_object()) throw Invalid{str_cat("messages[", i, "] is a ", json_type(m), ", not an object; ", kChatShape)};
    for (const char* key : {"role", "content"}) {
      const auto f = m.find(key);
      if (f == m.end()) throw Invalid{str_cat("messages[", i, "] has no field '", key, "'; ", kChatShape)};
      if (!f->is_string())
        throw Invalid{str_cat("messages[", i, "].", key, " is a ", json_type(*f), ", not a string; ", kChatShape)};
    }
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

// Encodes pieces (adjacent text pieces of equal `trained` merged first) without special
// tokens; special ids are inserted as they are.
void encode_pieces(const std::vector<TemplatePiece>& pieces, const Tokenizer& tok, std::vector<int32_t>& ids,
                   std::vector<uint8_t>& mask) {
  ids.clear();
  mask.clear();
  std::string text;
  bool text_trained = false;
  auto flush = [&] {
    if (text.empty()) return;
    for (int32_t id : tok.encode(text, false)) {
      ids.push_back(id);
      mask.push_back(text_trained);
    }
    text.clear();
  };
  for (const auto& p : pieces) {
    if (p.special) {
      flush();
      ids.push_back(*p.special);
      mask.push_back(p.trained);
    } else {
      if (!text.empty() && p.trained != text_trained) flush();
      text_trained = p.trained;
      text += p.text;
    }
  }
  flush();
}

void encode_text(std::string_view text, const Tokenizer& tok, std::vector<int32_t>& ids, std::vector<uint8_t>& mask) {
  ids = tok.encode(text, true);
  mask.assign(ids.size(), 1);
}

std::vector<fs::path> plain_files(const fs::path& path) {
  std::vector<fs::path> files;
  if (!fs::is_directory(path)) return {path};
  for (const auto& e : fs::directory_iterator(path))
    if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  MEMTUNE_CHECK(!files.empty(), "dataset ", path.string(), ": the directory holds no .txt files",
                "; the plain format reads a .txt file or a directory of .txt files");
  return files;
}

// The documents that train no token without having been cut: a prompt alone, or a role
// other than 'assistant' (with train_on_prompt false, chat and instruction formats only).
bool untrained_by_role(const DatasetStats& st, const DatasetOptions& o, const std::string& format) {
  return st.no_target_documents > st.no_target_cut && !o.train_on_prompt &&
         (format == "chat" || format == "instruction");
}

}  // namespace

std::string detect_format(const fs::path& path, const std::string& text_field) {
  std::error_code ec;
  MEMTUNE_CHECK(fs::exists(path, ec), "dataset file ", path.string(), " does not exist; check data.train_file");
  if (fs::is_directory(path, ec) || path.extension() == ".txt") return "plain";
  if (path.extension() == ".bin") return "tokens";
  MappedFile file(path);
  std::string found;
  for_each_line(file.view(), [&](int64_t, std::string_view line) {
    if (is_blank(line)) return true;
    check_json_depth(line, str_cat("dataset ", path.string(), ", first record"));
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return true;
    if (j.contains("messages")) found = "chat";
    else if (j.contains("instruction") || j.contains("output")) found = "instruction";
    else if (j.contains(text_field)) found = "text";
    else {
      std::string keys;
      for (const auto& kv : j.items()) keys += (keys.empty() ? "" : ", ") + kv.key();
      fail("dataset ", path.string(), ": cannot tell the format from the first record's keys (", keys,
           "); expected 'messages' (chat), 'instruction'/'output' (instruction) or '", text_field,
           "' (text); set data.format or data.text_field");
    }
    return false;
  });
  MEMTUNE_CHECK(!found.empty(), "dataset ", path.string(), " holds no valid JSON object line",
                " (empty dataset); expected JSONL, a .bin token file, or .txt");
  return found;
}

uint64_t tokenizer_fingerprint(const Tokenizer& tok) {
  uint64_t h = kFnv1aOffset;
  auto mix = [&h](int64_t v) { h = fnv1a64(std::string_view(reinterpret_cast<const char*>(&v), sizeof v), h); };
  mix(tok.vocab_size());
  mix(tok.bos_id.value_or(-1));
  mix(tok.eos_id.value_or(-1));
  mix(tok.pad_id.value_or(-1));
  for (int64_t i = 0; i < tok.vocab_size(); ++i) {
    try {
      h = fnv1a64(tok.id_to_token(static_cast<int32_t>(i)), h);
    } catch (const std::exception&) {
      mix(-2);  // a hole in the vocabulary
    }
    mix(-3);
  }
  for (int32_t id : tok.encode("Hello, World! 123 naïve 東京 \n\t  <|x|> ok", true)) mix(id);
  return h;
}

Dataset::Dataset(const fs::path& path, const Tokenizer* tokenizer, DatasetOptions options)
    : options_(std::move(options)) {
  const auto& o = options_;
  static const char* kFormats[] = {"auto", "text", "instruction", "chat", "tokens", "plain"};
  MEMTUNE_CHECK(std::find(std::begin(kFormats), std::end(kFormats), o.format) != std::end(kFormats),
                "data.format: unknown format '", o.format, "'; expected auto, text, instruction, chat, tokens or plain");
  MEMTUNE_CHECK(o.truncation == "right" || o.truncation == "drop", "data.truncation: '", o.truncation,
                "'; expected right or drop");
  MEMTUNE_CHECK(o.max_seq_length > 0, "data.max_seq_length: ", o.max_seq_length, " must be positive");
  format_ = o.format == "auto" ? detect_format(path, o.text_field) : o.format;
  MEMTUNE_CHECK(tokenizer || format_ == "tokens", "dataset ", path.string(), ": the ", format_,
                " format needs a tokenizer");
  load(path, tokenizer);
  hold_out(path.string());
  stats_.documents = static_cast<int64_t>(kept_.size());
  for (int64_t d : kept_) stats_.tokens += docs_.length(d);
  stats_.skipped_invalid = docs_.skipped_invalid;
  MEMTUNE_CHECK(stats_.documents > 0, "dataset ", path.string(), " is empty: no documents",
                docs_.skipped_invalid ? str_cat(" (", docs_.skipped_invalid, " invalid records skipped)") : "",
                "; check data.train_file and data.format (", format_, ")");

  if (format_ != "tokens" && o.add_eos_token) {
    if (tokenizer->eos_id) eos_target_ = tokenizer->eos_id;
    else log_once("dataset-no-eos", "data.add_eos_token: the tokenizer has no eos token; documents end without one");
  }
  build_rows();
  MEMTUNE_CHECK(size() > 0 || !flat_stream_, "dataset ", path.string(), " holds ", stats_.tokens,
                " token: a token trains only as the target of the one before it. Hint: write at least two tokens");
  MEMTUNE_CHECK(size() > 0, "dataset ", path.string(), ": all ", stats_.dropped,
                " documents are longer than data.max_seq_length (", o.max_seq_length,
                ") and were dropped; raise max_seq_length or set data.truncation: right");

  spdlog::info("dataset {}{}: {} format, {} documents, {} tokens -> {} samples, {} target tokens{}", path.string(),
               o.hold_out.split <= 0     ? ""
               : o.hold_out.held_out ? str_cat(" (held out by data.eval_split ", o.hold_out.split, ")")
                                     : str_cat(" (without what data.eval_split ", o.hold_out.split, " holds out)"),
               format_, stats_.documents, stats_.tokens, stats_.samples, stats_.target_tokens,
               from_cache_ ? " (tokenized cache)" : "");
  if (stats_.truncated || stats_.dropped)
    spdlog::warn("dataset {}: {} documents longer than max_seq_length {} {}", path.string(),
                 stats_.truncated + stats_.dropped, o.max_seq_length,
                 o.truncation == "right" ? "were truncated (data.truncation: right)"
                                         : "were dropped (data.truncation: drop)");
  if (stats_.skipped_invalid)
    spdlog::warn("dataset {}: {} invalid records skipped (data.skip_invalid)", path.string(), stats_.skipped_invalid);
  if (stats_.no_target_documents)
    spdlog::warn("dataset {}: {} of its {} documents train no token{}: each takes a place in a step and changes "
                 "nothing. Hint: {}",
                 path.string(), stats_.no_target_documents, stats_.documents, no_target_reason(), no_target_hint());
}

void Dataset::load(const fs::path& path, const Tokenizer* tokenizer) {
  const auto& o = options_;
  if (format_ == "tokens") {
    // Tokens stay in the mapped file: documents are ranges of it.
    token_file_ = std::make_shared<TokenFile>(path);
    const TokenFile& f = *token_file_;
    const int64_t n = f.size();
    const std::optional<int32_t> sep = tokenizer ? tokenizer->eos_id : std::nullopt;
    bool has_sep = false;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t v = f[i];
      if (tokenizer)
        MEMTUNE_CHECK(v < static_cast<uint64_t>(tokenizer->vocab_size()), path.string(), ": token ", i, " is ", v,
                      ", outside the tokenizer's vocabulary of ", tokenizer->vocab_size(),
                      "; was the file written with another tokenizer?");
      if (o.vocab_size > 0)
        MEMTUNE_CHECK(v < static_cast<uint64_t>(o.vocab_size), path.string(), ": token ", i, " is ", v,
                      ", outside the model's vocabulary (vocab_size ", o.vocab_size,
                      "); was the file written for another model's tokenizer?");
      has_sep |= sep && v == static_cast<uint32_t>(*sep);
    }
    flat_stream_ = !has_sep;
    if (flat_stream_) {
      if (n > 0) docs_.offsets.push_back(n);
      return;
    }
    // Documents end with (and include) the separator. llm.c writes one before each
    // document: a separator opening the file belongs to no document.
    separator_ = sep;
    docs_.offsets[0] = f[0] == static_cast<uint32_t>(*sep) ? 1 : 0;
    for (int64_t i = docs_.offsets[0]; i < n; ++i)
      if (f[i] == static_cast<uint32_t>(*sep) || i + 1 == n) docs_.offsets.push_back(i + 1);
    return;
  }

  // JSONL and plain text: map, hash, look in the cache, else tokenize.
  const std::vector<fs::path> files = format_ == "plain" ? plain_files(path) : std::vector<fs::path>{path};
  std::vector<std::unique_ptr<MappedFile>> maps;
  uint64_t content = kFnv1aOffset;
  for (const auto& f : files) {
    maps.push_back(std::make_unique<MappedFile>(f));
    content = fnv1a64(f.filename().string(), content);
    content = fnv1a64(maps.back()->view(), content);
  }
  std::string key = str_cat("memtune tokenized documents v1\nformat=", format_, "\nfile=", hex64(content),
                            "\ntokenizer=", hex64(tokenizer_fingerprint(*tokenizer)),
                            "\ntrain_on_prompt=", o.train_on_prompt, "\nskip_invalid=", o.skip_invalid, "\n");
  if (format_ == "text") key += "text_field=" + o.text_field + "\n";
  if (format_ == "instruction" || format_ == "chat")
    key += o.chat_template.empty() ? "template=" + o.template_name + "\n" : "chat_template=" + o.chat_template + "\n";
  fs::path cache_path;
  if (!o.cache_dir.empty()) {
    cache_path = fs::path(o.cache_dir) / (path.filename().string() + "." + hex64(fnv1a64(key)) + ".docs");
    if (read_document_cache(cache_path, key, docs_)) {
      from_cache_ = true;
      return;
    }
    std::error_code ec;
    if (fs::exists(cache_path, ec))
      spdlog::warn("dataset cache {} is damaged or stale; tokenizing again", cache_path.string());
  }

  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  if (format_ == "plain") {
    for (size_t f = 0; f < files.size(); ++f) {
      std::string_view text = maps[f]->view();
      if (files.size() > 1) {  // one document per file
        while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
        if (text.empty()) continue;
        encode_text(text, *tokenizer, ids, mask);
        if (!ids.empty()) docs_.add(ids, mask);
        continue;
      }
      std::string block;  // one document per blank-line block: its lines joined by '\n'
      auto flush = [&] {
        if (!block.empty()) {
          encode_text(block, *tokenizer, ids, mask);
          if (!ids.empty()) docs_.add(ids, mask);
        }
        block.clear();
      };
      for_each_line(text, [&](int64_t, std::string_view line) {
        if (is_blank(line)) flush();
        else block += (block.empty() ? "" : "\n") + std::string(line);
        return true;
      });
      flush();
    }
  } else {
    const ChatTemplate tmpl = ChatTemplate::of(o.template_name, o.chat_template);
    const std::string name = path.string();
    for_each_line(maps[0]->view(), [&](int64_t line_no, std::string_view line) {
      if (is_blank(line)) return true;
      try {
        json j;
        try {
          check_json_depth(line, "the record");
        } catch (const UserError& e) {
          throw Invalid{e.what()};
        }
        try {
          j = json::parse(line);
        } catch (const json::parse_error& e) {
          throw Invalid{str_cat("malformed JSON (", e.what(), ") near: ", excerpt(line, e.byte ? e.byte - 1 : 0),
                                format_ == "text" ? " (data.format text reads JSON lines, {\"text\": ...}; a file of plain "
                                                    "text is data.format plain, or auto)"
                                                  : "")};
        }
        if (!j.is_object()) throw Invalid{str_cat("a JSON ", json_type(j), ", not an object, near: ", excerpt(line, 0))};
        if (format_ == "text") {
          encode_text(string_field(j, o.text_field.c_str(),
                                   ("the text format expects {\"" + o.text_field + "\": string}").c_str()),
                      *tokenizer, ids, mask);
        } else if (format_ == "instruction") {
          const std::string instruction = string_field(j, "instruction", kInstructionShape);
          const std::string input = string_field(j, "input", kInstructionShape, true);
          const std::string output = string_field(j, "output", kInstructionShape);
          encode_pieces(tmpl.render_instruction(instruction, input, output, tokenizer->bos_id, tokenizer->eos_id,
                                                o.train_on_prompt),
                        *tokenizer, ids, mask);
        } else {
          const std::vector<Message> messages = chat_messages(j);
          std::vector<TemplatePiece> pieces;
          try {
            pieces = tmpl.render(messages, tokenizer->bos_id, tokenizer->eos_id, o.train_on_prompt);
          } catch (const UserError& e) {  // a conversation the template refuses: this line's fault
            throw Invalid{e.what()};
          }
          encode_pieces(pieces, *tokenizer, ids, mask);
        }
      } catch (const Invalid& bad) {
        MEMTUNE_CHECK(o.skip_invalid, name, ":", line_no, ": ", bad.message,
                      "; fix the line, or set data.skip_invalid: true to skip and count such lines");
        if (docs_.skipped_invalid++ < 5) spdlog::warn("{}:{}: skipped: {}", name, line_no, bad.message);
        return true;
      }
      if (!ids.empty()) docs_.add(ids, mask);
      return true;
    });
  }
  if (!cache_path.empty() && docs_.size() > 0) write_document_cache(cache_path, key, docs_);
}

std::vector<int64_t> held_out_documents(int64_t n, const HoldOut& h, const std::string& what) {
  MEMTUNE_CHECK(std::isfinite(h.split) && h.split > 0 && (h.split < 1 || h.split == std::floor(h.split)),
                "data.eval_split: ", h.split, "; expected a share in (0, 1) or a whole number of documents");
  // train_test_split's count: ceil of the product, in doubles (0.07 of 100 documents is 8).
  const double wanted = h.split < 1 ? std::ceil(h.split * static_cast<double>(n)) : h.split;
  MEMTUNE_CHECK(wanted < static_cast<double>(n), "data.eval_split ", h.split, " holds out ", wanted, " of the ", n,
                " documents of ", what,
                ", leaving none to train on. Hint: hold out fewer, or name a separate file in data.eval_file");
  const auto count = static_cast<int64_t>(wanted);
  std::vector<int64_t> held;
  if (h.shuffle) {
    const std::vector<int64_t> order = Sampler::permutation(n, h.seed, -1);
    held.assign(order.begin(), order.begin() + count);
    std::sort(held.begin(), held.end());
  } else {
    held.resize(count);
    std::iota(held.begin(), held.end(), n - count);
  }
  return held;
}

bool Dataset::is_document(int64_t d) const {
  const int64_t len = docs_.length(d);
  return len > 0 && !(len == 1 && separator_ && token(docs_.offsets[d]) == *separator_);
}

void Dataset::hold_out(const std::string& what) {
  const HoldOut& h = options_.hold_out;
  kept_.clear();
  if (h.split <= 0) {
    kept_.resize(docs_.size());
    std::iota(kept_.begin(), kept_.end(), 0);
    return;
  }
  MEMTUNE_CHECK(!flat_stream_ || docs_.size() == 0, "data.eval_split holds out documents, and ", what,
                " is one stream of tokens without document separators (the tokenizer's eos id, which the file "
                "does not hold, or there is no tokenizer). Hint: write the held-out tokens to a file of their own "
                "and name it in data.eval_file");
  std::vector<int64_t> docs;  // the file's documents, by index into docs_
  for (int64_t d = 0; d < docs_.size(); ++d)
    if (is_document(d)) docs.push_back(d);
  if (docs.empty()) return;  // an empty dataset, refused as such
  const std::vector<int64_t> held = held_out_documents(static_cast<int64_t>(docs.size()), h, what);
  std::vector<uint8_t> is_held(docs.size(), 0);
  for (int64_t i : held) is_held[i] = 1;
  for (size_t i = 0; i < docs.size(); ++i)
    if (is_held[i] == static_cast<uint8_t>(h.held_out)) kept_.push_back(docs[i]);
  if (token_file_) return;  // the tokens stay in the mapped file
  // Tokens in memory: keep only this side's.
  Documents mine;
  mine.skipped_invalid = docs_.skipped_invalid;
  for (int64_t d : kept_) {
    const auto first = docs_.offsets[d], last = docs_.offsets[d + 1];
    mine.tokens.insert(mine.tokens.end(), docs_.tokens.begin() + first, docs_.tokens.begin() + last);
    if (!docs_.trained.empty())
      mine.trained.insert(mine.trained.end(), docs_.trained.begin() + first, docs_.trained.begin() + last);
    mine.offsets.push_back(static_cast<int64_t>(mine.tokens.size()));
  }
  docs_ = std::move(mine);
  std::iota(kept_.begin(), kept_.end(), 0);
}

void Dataset::build_rows() {
  const int64_t T = options_.max_seq_length;
  if (flat_stream_) {  // one stream: windows of T whose targets run on into the next window
    // A window starting at the stream's last token would have no target (that token is
    // already the one before's last target): a file of k T + 1 tokens, as llm.c writes its
    // batches, is k windows, not k and a window that trains nothing.
    const int64_t n = docs_.size() > 0 ? docs_.length(0) : 0;
    for (int64_t b = 0; b + 1 < n; b += T) {
      spans_.push_back({0, b, std::min(T, n - b)});
      row_begin_.push_back(static_cast<int64_t>(spans_.size()));
    }
  } else {
    int64_t row_len = 0;
    for (int64_t d : kept_) {
      if (!is_document(d)) continue;  // empty, or a lone separator (two in a row in a token file)
      int64_t len = docs_.length(d);
      if (len > T) {
        if (options_.truncation == "drop") {
          ++stats_.dropped;
          continue;
        }
        ++stats_.truncated;
        len = T;
      }
      if (row_len > 0 && (!options_.pack_sequences || row_len + len > T)) {
        row_begin_.push_back(static_cast<int64_t>(spans_.size()));
        row_len = 0;
      }
      spans_.push_back({d, 0, len});
      row_len += len;
    }
    if (row_len > 0) row_begin_.push_back(static_cast<int64_t>(spans_.size()));
  }
  stats_.samples = size();
  for (int64_t i = 0; i < size(); ++i) {
    int64_t length = 0, targets = 0;
    for (int64_t r = row_begin_[i]; r < row_begin_[i + 1]; ++r) {
      const Span& s = spans_[r];  // a document, or a stream's window (which always trains)
      const int64_t trained = span_targets(s);
      length += s.length;
      targets += trained;
      if (trained > 0) continue;
      ++stats_.no_target_documents;
      const int64_t whole = docs_.length(s.doc);
      if (s.length < whole && span_targets({s.doc, 0, whole}) > 0) ++stats_.no_target_cut;
    }
    stats_.target_tokens += targets;
    stats_.longest_sample = std::max(stats_.longest_sample, length);
    stats_.most_sample_targets = std::max(stats_.most_sample_targets, targets);
  }
}

std::string Dataset::no_target_reason() const {
  std::string why;
  if (stats_.no_target_cut)
    why = str_cat(stats_.no_target_cut, " of them had their trained tokens past data.max_seq_length (",
                  options_.max_seq_length, ")");
  if (untrained_by_role(stats_, options_, format_))
    why += std::string(why.empty() ? "" : "; ") +
           (format_ == "chat" ? "data.train_on_prompt is false, so only messages whose role is 'assistant' train; "
                                "ShareGPT's 'gpt' is not one"
                              : "data.train_on_prompt is false, so only a record's output trains");
  return why.empty() ? why : " (" + why + ")";
}

std::string Dataset::no_target_hint() const {
  std::string hint = stats_.no_target_cut ? "raise data.max_seq_length" : "";
  if (untrained_by_role(stats_, options_, format_))
    hint += std::string(hint.empty() ? "" : ", ") +
            (format_ == "chat" ? "name the replying role 'assistant' (ShareGPT's 'human' and 'gpt' are 'user' and "
                                 "'assistant')"
                               : "give each record an output") +
            ", or set data.train_on_prompt: true to train every token";
  return hint.empty() ? "a document's tokens from its second on are its targets; check data.format" : hint;
}

int64_t Dataset::span_targets(const Span& s) const {
  const int64_t base = docs_.offsets[s.doc], n = docs_.length(s.doc);
  int64_t count = 0;
  for (int64_t k = s.begin; k < s.begin + s.length; ++k)
    count += k + 1 < n ? docs_.is_trained(base + k + 1) : (eos_target_ && docs_.is_trained(base + k));
  return count;
}

Sample Dataset::sample(int64_t i) const {
  MEMTUNE_INTERNAL_ASSERT(i >= 0 && i < size(), "Dataset::sample: index ", i, " outside [0, ", size(), ")");
  Sample out;
  const int64_t length = sample_length(i);
  out.input_ids.reserve(length);
  out.targets.reserve(length);
  out.position_ids.reserve(length);
  out.segment_ids.reserve(length);
  for (int64_t r = row_begin_[i]; r < row_begin_[i + 1]; ++r) {
    const Span& s = spans_[r];
    const int64_t base = docs_.offsets[s.doc], n = docs_.length(s.doc);
    for (int64_t k = s.begin; k < s.begin + s.length; ++k) {
      out.input_ids.push_back(token(base + k));
      int32_t target = kIgnoreIndex;
      if (k + 1 < n) {
        if (docs_.is_trained(base + k + 1)) target = token(base + k + 1);
      } else if (eos_target_ && docs_.is_trained(base + k)) {
        target = *eos_target_;
      }
      out.targets.push_back(target);
      out.position_ids.push_back(static_cast<int32_t>(k - s.begin));
      out.segment_ids.push_back(static_cast<int32_t>(r - row_begin_[i]));
    }
  }
  return out;
}

int64_t Dataset::sample_length(int64_t i) const {
  int64_t length = 0;
  for (int64_t r = row_begin_[i]; r < row_begin_[i + 1]; ++r) length += spans_[r].length;
  return length;
}

std::vector<uint32_t> Dataset::token_stream(std::optional<int32_t> separator) const {
  std::vector<uint32_t> out;
  out.reserve(stats_.tokens + (separator ? static_cast<int64_t>(kept_.size()) : 0));
  for (int64_t d : kept_) {
    for (int64_t i = docs_.offsets[d]; i < docs_.offsets[d + 1]; ++i) out.push_back(token(i));
    if (separator) out.push_back(*separator);
  }
  return out;
}

}  // namespace memtune::data
