#pragma once
// Which samples each rank trains on, in which order: a deterministic shuffle by (seed,
// epoch) with splitmix64 and Fisher-Yates (our own PRNG, so the order is the same under
// every LibTorch version), sharded by rank, and an exact position for resuming.
//
// Epochs, as Hugging Face's Trainer makes them: each epoch is one pass over the samples, and
// a step never reaches into the next one. An epoch of n samples per rank at s samples per
// step is ceil(n / s) steps, the last of them on the n mod s that remain (the Trainer's last,
// shorter accumulation of an epoch: transformers' set_initial_training_values and _run_epoch).
//
// Sharding: each epoch's permutation is cut to floor(N / W) * W entries (the tail of up to
// W-1 samples is dropped, a different tail each epoch when shuffling); rank r takes the
// entries r, r+W, r+2W, ... so the ranks' shards are disjoint and equally long.
//
// Grouping by length (training.group_by_length, Hugging Face's LengthGroupedSampler): the
// epoch's permutation is cut into megabatches, each sorted by sample length, longest first
// (a stable sort: equal lengths keep their drawn order), and the first entry of the
// megabatch holding the longest sample trades places with the epoch's first entry, so an
// out-of-memory error comes at the first step rather than later (transformers'
// get_length_grouped_indices). A step then pads its rows to a similar length.
#include <cstdint>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace memtune::data {

// The same on every rank: `offset` counts permutation entries consumed in `epoch` by all
// ranks together (a multiple of the world size), so a run may resume under another
// world size when the offset divides.
struct SamplerState {
  int64_t epoch = 0;
  int64_t offset = 0;
  uint64_t seed = 0;
  // Samples per length-sorted megabatch; 0: not grouped. Kept with the position, so a run
  // resumed with another micro-batch draws the same order.
  int64_t megabatch = 0;
};
void to_json(nlohmann::json& j, const SamplerState& s);
void from_json(const nlohmann::json& j, SamplerState& s);  // throws UserError naming a missing key

class Sampler {
 public:
  // Throws UserError when the dataset is smaller than the world size.
  Sampler(int64_t dataset_size, uint64_t seed, bool shuffle = true, int rank = 0, int world_size = 1);

  // Group each epoch by length: lengths[i] is sample i's (the dataset's size of them),
  // `megabatch` the samples per group (megabatch_size). Before the first next() or restore().
  void group_by_length(std::vector<int64_t> lengths, int64_t megabatch);

  // This rank's next `count` dataset indices, or fewer: those left in the epoch. A call at
  // an epoch's end starts the next epoch.
  std::vector<int64_t> next(int64_t count);

  int64_t epoch() const { return state_.epoch; }
  int64_t per_rank() const { return per_rank_; }  // samples per rank per epoch
  // Steps in an epoch for `global_batch` samples per step over all ranks (a multiple of the
  // world size), the last one shorter where the epoch does not divide: ceil.
  int64_t steps_per_epoch(int64_t global_batch) const;

  SamplerState state() const { return state_; }
  // Throws UserError when the offset does not fit this sampler's epoch or world size, or
  // the state was grouped by length and this sampler is not (or the reverse).
  void restore(const SamplerState& state);

  // The permutation of [0, n) for (seed, epoch); the identity without shuffle.
  static std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch);
  // `order` grouped by length as above, in megabatches of `megabatch` entries (the last one
  // shorter where they do not divide).
  static std::vector<int64_t> length_grouped(std::vector<int64_t> order, const std::vector<int64_t>& lengths,
                                             int64_t megabatch);
  // transformers' default megabatch for n samples and `step` samples per step: 50 steps,
  // or fewer so that there are at least 4 megabatches, and at least one step.
  static int64_t megabatch_size(int64_t n, int64_t step);

 private:
  void ensure_permutation();

  int64_t size_;
  bool shuffle_;
  int rank_, world_;
  int64_t per_rank_;
  SamplerState state_;
  std::vector<int64_t> lengths_;  // per sample, when grouping by length
  std::vector<int64_t> order_;    // the permutation of state_.epoch
  int64_t order_epoch_ = -1;
};

// splitmix64 (Steele, Lea, Flood 2014): advances `state` and returns the next output.
uint64_t splitmix64(uint64_t& state);

}  // namespace memtune::data
