#pragma once
// A training set: a file loaded into tokenized documents (token ids and, per token, whether
// it is a target), then cut into samples: packed rows of max_seq_length, or one per document.
//
// Formats (DatasetOptions::format; "auto" picks from the extension, then the first valid
// JSONL record's keys):
//   text         JSONL {"<text_field>": str}; encoded with the tokenizer's special tokens
//   instruction  JSONL {"instruction": str, "input": str (optional), "output": str}
//   chat         JSONL {"messages": [{"role": str, "content": str}, ...]}
//                both rendered by a ChatTemplate (data/chat_template.h)
//   tokens       an llm.c token file (.bin, data/token_file.h), memory-mapped; documents end
//                at (and include) the tokenizer's eos id; without a tokenizer or an eos
//                id, the file is one stream cut into rows of max_seq_length
//   plain        a .txt file (one document per blank-line block) or a directory of .txt
//                files (one document per file, in name order)
//
// Targets (Sample::targets, pre-shifted): inside a document, the target of token t is
// token t+1 when that token is trained, else kIgnoreIndex; the last token of a document
// predicts eos when add_eos_token (and the tokenizer has one, and the last token is
// trained), else nothing; a target never crosses a document boundary. A document cut by
// truncation: right keeps its first max_seq_length tokens, and the last of them still
// predicts the next (cut) token. Token files already hold their separators: no eos added.
//
// Tokenized documents are cached under cache_dir (data/document_cache.h), keyed by the
// file's FNV-1a content hash, the tokenizer's fingerprint and the options that change
// tokenization; max_seq_length, packing, truncation and add_eos_token are not in the key.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/batch.h"
#include "data/document_cache.h"
#include "data/token_file.h"

namespace memtune::data {

class Tokenizer;

// Documents held out of a file for evaluation (data.eval_split), as datasets'
// train_test_split(test_size=split, seed) draws them: a split in (0, 1) holds out
// ceil(split x n) of the file's n documents (records), one >= 1 that many. They are the
// first of a permutation of the documents drawn from `seed` (Sampler::permutation at epoch
// -1, a stream no epoch's order uses), or the last documents of the file without
// `shuffle`, as train_test_split(shuffle=False). Each side keeps its documents in file
// order, and rows are made within it.
struct HoldOut {
  double split = 0;        // 0: the whole file
  uint64_t seed = 0;
  bool shuffle = true;
  bool held_out = false;   // this dataset: the held-out documents (true), or the others
};

// Of `n` documents, the ones that `h` holds out, ascending. Throws UserError when that
// leaves none, or all (`what` names the file in the message).
std::vector<int64_t> held_out_documents(int64_t n, const HoldOut& h, const std::string& what);

/// Mirrors trainer's DataConfig. Example:
///   DatasetOptions o; o.format = "instruction"; o.max_seq_length = 256;
///   Dataset ds("train.jsonl", tokenizer.get(), o);
struct DatasetOptions {
  std::string format = "auto";          // auto|text|instruction|chat|tokens|plain
  std::string template_name = "alpaca"; // llama-3|chatml|alpaca|gemma
  std::string chat_template;            // custom per-message pattern; overrides template_name
  std::string text_field = "text";      // the field read by the text format
  int64_t max_seq_length = 512;         // tokens per sample
  bool pack_sequences = true;           // concatenate documents into rows of max_seq_length
  std::string truncation = "right";     // right: cut at max_seq_length | drop: skip the document
  bool train_on_prompt = false;         // false: prompt tokens are not targets
  bool skip_invalid = false;            // skip and count malformed records instead of failing
  bool add_eos_token = true;            // a document's last token predicts eos
  std::string cache_dir;                // empty: no cache
  // The model's vocabulary: a token file's ids must lie below it (0: not checked). A
  // tokenizer, where given, bounds them too; text is bounded by the tokenizer alone.
  int64_t vocab_size = 0;
  HoldOut hold_out;                     // data.eval_split: this set is one side of it
};

struct DatasetStats {
  int64_t documents = 0;        // documents loaded (before truncation)
  int64_t tokens = 0;           // their tokens
  int64_t truncated = 0;        // documents cut at max_seq_length (truncation: right)
  int64_t dropped = 0;          // documents longer than max_seq_length skipped (truncation: drop)
  int64_t skipped_invalid = 0;  // malformed records skipped (skip_invalid)
  int64_t samples = 0;          // rows
  int64_t target_tokens = 0;    // targets != kIgnoreIndex over all samples
  int64_t no_target_documents = 0;  // documents kept whose kept tokens train nothing (a chat without an assistant reply)
  int64_t no_target_cut = 0;        // of those, documents whose trained tokens all lay past max_seq_length
  // The largest sample, and the most targets in one sample: what bounds a micro-batch's
  // activations (rows are padded to the batch's longest) and its loss (only trained rows
  // form logits). The memory estimate plans with them (trainer/estimator.h).
  int64_t longest_sample = 0;
  int64_t most_sample_targets = 0;
};

class Dataset {
 public:
  // `tokenizer` may be null only for token files. Throws UserError for unreadable files,
  // malformed or incomplete records (file:line), an empty dataset, a bad token file.
  Dataset(const std::filesystem::path& path, const Tokenizer* tokenizer, DatasetOptions options);

  int64_t size() const { return static_cast<int64_t>(row_begin_.size()) - 1; }
  // Built on demand from the documents (a row costs 16 bytes per token only while in use).
  Sample sample(int64_t i) const;
  int64_t sample_length(int64_t i) const;  // tokens in sample i, without building it

  const DatasetStats& stats() const { return stats_; }
  // Why the documents that train no token do not, as a parenthesis for a message (their
  // trained tokens lay past max_seq_length; with train_on_prompt false a chat trains its
  // assistant messages only, an instruction record its output), and what would make them
  // train. Empty when every document trains.
  std::string no_target_reason() const;
  std::string no_target_hint() const;
  const std::string& format() const { return format_; }  // the resolved format
  bool from_cache() const { return from_cache_; }
  // Token files keep their tokens in the mapped file: there documents().tokens is empty
  // and token(i) reads the file.
  const Documents& documents() const { return docs_; }
  int32_t token(int64_t i) const {
    return token_file_ ? static_cast<int32_t>((*token_file_)[i]) : docs_.tokens[i];
  }

  // Documents back to back, each followed by `separator` when given: the stream that
  // `memtune tokenize --out` writes with write_token_file.
  std::vector<uint32_t> token_stream(std::optional<int32_t> separator) const;

 private:
  struct Span {  // tokens [begin, begin+length) of document `doc`
    int64_t doc, begin, length;
  };
  void load(const std::filesystem::path& path, const Tokenizer* tokenizer);
  bool is_document(int64_t d) const;  // not empty, nor a token file's lone separator
  void hold_out(const std::string& what);
  void build_rows();
  int64_t span_targets(const Span& s) const;

  DatasetOptions options_;
  std::string format_;
  Documents docs_;
  std::optional<int32_t> eos_target_;  // what a document's last token predicts
  std::vector<int64_t> kept_;  // the documents rows are made of, ascending (all but a held-out side)
  std::vector<Span> spans_;
  std::vector<int64_t> row_begin_{0};  // sample i is spans_[row_begin_[i], row_begin_[i+1])
  DatasetStats stats_;
  bool from_cache_ = false;
  std::shared_ptr<const TokenFile> token_file_;  // the mapped token file (tokens format)
  std::optional<int32_t> separator_;             // token files: the eos that ends documents
  bool flat_stream_ = false;  // a token file without separators: one stream cut into rows
};

// The format "auto" resolves to for this path: by extension (.bin tokens, .txt or a
// directory plain), else from the first valid JSONL record's keys.
std::string detect_format(const std::filesystem::path& path, const std::string& text_field);

// A 64-bit fingerprint of a tokenizer's behaviour (vocabulary, special ids, a probe
// encoding), for the cache key.
uint64_t tokenizer_fingerprint(const Tokenizer& tokenizer);

}  // namespace memtune::data
