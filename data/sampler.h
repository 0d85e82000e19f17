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
};
void to_json(nlohmann::json& j, const SamplerState& s);
void from_json(const nlohmann::json& j, SamplerState& s);  // throws UserError naming a missing key

class Sampler {
 public:
  // Throws UserError when the dataset is smaller than the world size.
  Sampler(int64_t dataset_size, uint64_t seed, bool shuffle = true, int rank = 0, int world_size = 1);

  // This rank's next `count` dataset indices, or fewer: those left in the epoch. A call at
  // an epoch's end starts the next epoch.
  std::vector<int64_t> next(int64_t count);

  int64_t epoch() const { return state_.epoch; }
  int64_t per_rank() const { return per_rank_; }  // samples per rank per epoch
  // Steps in an epoch for `global_batch` samples per step over all ranks (a multiple of the
  // world size), the last one shorter where the epoch does not divide: ceil.
  int64_t steps_per_epoch(int64_t global_batch) const;

  SamplerState state() const { return state_; }
  // Throws UserError when the offset does not fit this sampler's epoch or world size.
  void restore(const SamplerState& state);

  // The permutation of [0, n) for (seed, epoch); the identity without shuffle.
  static std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch);

 private:
  void ensure_permutation();

  int64_t size_;
  bool shuffle_;
  int rank_, world_;
  int64_t per_rank_;
  SamplerState state_;
  std::vector<int64_t> order_;  // the permutation of state_.epoch
  int64_t order_epoch_ = -1;
};

// splitmix64 (Steele, Lea, Flood 2014): advances `state` and returns the next output.
uint64_t splitmix64(uint64_t& state);

}  // namespace memtune::data
