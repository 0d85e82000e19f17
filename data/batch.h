#pragma once
// What the data layer hands the trainer: samples (one packed row, or one example) and
// micro-batches collated from them.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace memtune::data {

constexpr int32_t kIgnoreIndex = -100;  // a target that does not count in the loss

// One training sample: a row of at most max_seq_length tokens. Targets are already shifted:
// targets[t] is the token the model must predict after reading input_ids[0..t], or
// kIgnoreIndex (prompt tokens when train_on_prompt is false, the last token of a packed
// document, padding). A packed row holds several documents: positions restart at 0 and
// segment ids number the documents, so attention never crosses a document boundary.
struct Sample {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> targets;
  std::vector<int32_t> position_ids;
  std::vector<int32_t> segment_ids;
  int64_t target_tokens() const;  // targets != kIgnoreIndex
};

// A micro-batch of B samples padded to a common length T (CPU tensors).
struct Batch {
  at::Tensor input_ids;     // (B,T) int64; padding holds pad_id
  at::Tensor targets;       // (B,T) int64; kIgnoreIndex where not trained (padding too)
  at::Tensor position_ids;  // (B,T) int64
  at::Tensor segment_ids;   // (B,T) int64; -1 on padding; attention only within a segment
  int64_t target_tokens = 0;  // number of targets != kIgnoreIndex
  std::vector<int64_t> row_lengths;  // per row: tokens before padding
  std::vector<uint64_t> row_keys;    // per row: dropout key (runtime/keyed_dropout.h); empty: unkeyed
  // per row: the length NEFTune's noise is scaled by, the padded length of the micro-batch
  // the run is configured with that the row belongs to (transformers' output.size(1)), so a
  // smaller micro-batch after an out-of-memory error draws the same noise; empty: length().
  std::vector<int64_t> noise_lengths;
  int64_t rows() const { return input_ids.defined() ? input_ids.size(0) : 0; }
  int64_t length() const { return input_ids.defined() ? input_ids.size(1) : 0; }
};

// Pads samples to the longest, rounded up to a multiple of `pad_multiple`.
Batch collate(const std::vector<Sample>& samples, int64_t pad_multiple, int32_t pad_id);

}  // namespace memtune::data
