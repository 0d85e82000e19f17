#pragma once
// Dropout whose mask depends on the sample, not on the batch it happens to be in. Each row
// of a training batch carries a key (from the run's seed, the epoch and the sample's index
// in the dataset) and its length; a dropout site (a LoRA adapter's input, a GPT-2 residual,
// a layer's attention probabilities) draws row b's mask from (key_b, site) alone, over the
// row's own positions only. So a
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
// same one, whatever micro-batch or rank computes it (a step holds a sample once: it never
// reaches past its epoch, data/sampler.h).
uint64_t dropout_row_key(uint64_t seed, int64_t step, int64_t sample_index);

// A site's salt from its name (FNV-1a: stable across builds and platforms).
uint64_t dropout_site(const std::string& name);

// x (B, T, ...): each element kept with probability 1-p and scaled by 1/(1-p). With keys in
// scope (one per row of x), row b's mask depends on (keys[b], site) only, over its first
// lengths[b] positions (padding is never kept); without, at::dropout.
// fp32 on the CPU: element e of row b (position times width, plus column) is kept when
// fmix32(seed_b ^ e * 0x9E3779B9) < (1-p) 2^32, one fused pass (AVX2 where the CPU has it)
// that backward runs again on the gradient, so no mask is kept. Elsewhere (GPUs, fp16/bf16):
// a generator seeded per row, and the boolean mask kept for backward as at::dropout keeps it.
at::Tensor keyed_dropout(const at::Tensor& x, double p, uint64_t site);
// NEFTune's noise for x (B, T, C), keyed as dropout is: row b uniform in [-bounds[b],
// bounds[b]) over its first lengths[b] positions (zero on padding), drawn in fp32 from a CPU
// generator seeded by (keys[b], site) and returned in x's dtype on x's device, so the same
// sample gets the same noise in any micro-batch, retry or device. Without keys in scope,
// every position of row b from the default generator (as transformers draws it).
at::Tensor keyed_uniform_noise(const at::Tensor& x, const std::vector<double>& bounds, uint64_t site);
// Whether keyed_dropout of x keeps a boolean mask for backward (one byte per element).
bool keyed_dropout_keeps_mask(const at::Tensor& x);
// Tests: the portable kernel instead of the AVX2 one.
void use_portable_dropout_kernel(bool portable);

// Dropout on attention probabilities, drawn by position rather than from a stream, so that
// a fused kernel regenerates in backward the mask it drew in forward and keeps none: the
// probability of key s for query t of query head h in batch row b is kept when
//   attention_kept(attention_row_hash(seeds[b], h, t), s, threshold)
// with seeds[b] the row's seed for the site (attention_dropout_seeds) and threshold the
// keep probability in 32-bit fixed point. Kept probabilities are scaled by 1/(1-p), as
// torch's dropout scales them. attention_keep_mask is the same draw as a tensor.
struct AttentionDropout {
  double p = 0;         // 0: none
  at::Tensor seeds;     // int64 (B): each row's 32-bit seed for this site
  bool active() const { return p > 0; }
};

inline uint32_t fmix32(uint32_t x) {  // MurmurHash3's finaliser: a bijection of 32 bits
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}
inline uint32_t attention_row_hash(uint32_t seed, int64_t head, int64_t t) {
  const uint32_t h = fmix32(seed + static_cast<uint32_t>(head) * 0x9E3779B9u);
  return fmix32(h + static_cast<uint32_t>(t) * 0x85EBCA77u);
}
inline bool attention_kept(uint32_t row_hash, int64_t s, uint32_t threshold) {
  return fmix32(row_hash ^ (static_cast<uint32_t>(s) * 0xC2B2AE3Du)) < threshold;
}
// 1-p in 32-bit fixed point (at most 2^32 - 1): keyed_dropout's CPU pass and attention
// dropout keep a draw below it.
uint32_t dropout_keep_threshold(double p);

// Per row of the batch in scope, its seed for attention-dropout `site`: from the row's key
// (current_dropout_keys), or with no keys in scope from the default generator of `device`
// (replayed by activation checkpointing as torch's dropout is).
at::Tensor attention_dropout_seeds(uint64_t site, int64_t rows, const c10::Device& device);

// The kept (true) entries of query rows [t0, t1) of every head against keys [s0, s1), as
// bool (B, heads, t1-t0, s1-s0) on the seeds' device: attention_kept for each entry.
at::Tensor attention_keep_mask(const at::Tensor& seeds, int64_t heads, int64_t t0, int64_t t1, int64_t s0, int64_t s1,
                               double p);

}  // namespace memtune
