#pragma once
// Dropout whose mask depends on the sample, not on the batch it happens to be in. Each row
// of a training batch carries a key (from the run's seed, the epoch and the sample's index
// in the dataset) and its length; a dropout site (a LoRA adapter's input) draws row b's
// mask from a generator seeded by (key_b, site) over the row's own positions only. So a
// micro-batch split, a retry after an out-of-memory error, a grow-back, a resume, a
// recomputation under activation checkpointing and a different number of ranks all draw
// the same masks for the same sample, and the supervisor's changes never change the math,
// dropout included. (Plain at::dropout draws from one stream in batch order: splitting a
// batch of 4 into 2 x 2 changed every mask after the first row.)
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace memtune {

struct DropoutKeys {
  std::vector<uint64_t> keys;    // per row of the batch
  std::vector<int64_t> lengths;  // per row: positions before padding
  bool empty() const { return keys.empty(); }
};

// The keys of the forward in progress on this thread (empty: none, at::dropout is used).
const DropoutKeys& current_dropout_keys();

// Installs keys for its lifetime on this thread; the previous ones come back after.
class DropoutKeysScope {
 public:
  explicit DropoutKeysScope(DropoutKeys keys);
  ~DropoutKeysScope();
  DropoutKeysScope(const DropoutKeysScope&) = delete;
  DropoutKeysScope& operator=(const DropoutKeysScope&) = delete;

 private:
  DropoutKeys previous_;
};

// A row's key: the same sample at the same optimizer step of the same run always gets the
// same one, whatever micro-batch or rank computes it. `occurrence` tells apart the copies of
// a sample that appears twice in one step (a step that wraps around a small dataset).
uint64_t dropout_row_key(uint64_t seed, int64_t step, int64_t sample_index, int64_t occurrence = 0);

// A site's salt from its name (FNV-1a: stable across builds and platforms).
uint64_t dropout_site(const std::string& name);

// x (B, T, ...): each element kept with probability 1-p and scaled by 1/(1-p). With keys in
// scope (one per row of x), row b's mask comes from a generator seeded by (keys[b], site)
// over its first lengths[b] positions (padding is never kept); without, at::dropout.
// Only the boolean mask is kept for backward, as at::dropout keeps it.
at::Tensor keyed_dropout(const at::Tensor& x, double p, uint64_t site);

}  // namespace memtune
