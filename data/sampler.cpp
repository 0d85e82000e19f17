#include "data/sampler.h"

#include <algorithm>
#include <numeric>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace memtune::data {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void to_json(nlohmann::json& j, const SamplerState& s) {
  j = nlohmann::json{{"epoch", s.epoch}, {"offset", s.offset}, {"seed", s.seed}};
  if (s.megabatch > 0) j["megabatch"] = s.megabatch;
}

void from_json(const nlohmann::json& j, SamplerState& s) {
  for (const char* key : {"epoch", "offset", "seed"})
    MEMTUNE_CHECK(j.is_object() && j.contains(key) && j[key].is_number_integer(), "sampler state: key '", key,
                  "' is missing or not an integer in ", j.dump(), "; expected {\"epoch\", \"offset\", \"seed\"}");
  s.epoch = j["epoch"].get<int64_t>();
  s.offset = j["offset"].get<int64_t>();
  s.seed = j["seed"].get<uint64_t>();
  s.megabatch = 0;  // absent: not grouped by length (and every checkpoint before grouping existed)
  if (j.contains("megabatch")) {
    MEMTUNE_CHECK(j["megabatch"].is_number_integer() && j["megabatch"].get<int64_t>() > 0,
                  "sampler state: 'megabatch' is ", j["megabatch"].dump(), "; expected a positive integer");
    s.megabatch = j["megabatch"].get<int64_t>();
  }
}

std::vector<int64_t> Sampler::permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  // One stream per (seed, epoch): the epoch's stream starts from the seed's stream mixed
  // with the epoch, so neighbouring seeds and epochs give unrelated orders.
  uint64_t s = seed;
  uint64_t state = splitmix64(s) ^ (static_cast<uint64_t>(epoch) * 0xd1b54a32d192ed03ULL);
  for (int64_t i = n - 1; i > 0; --i) {
    // j uniform in [0, i]: the high 64 bits of a 64x64 product (Lemire), bias < 2^-40 here.
    const uint64_t j = static_cast<uint64_t>((static_cast<unsigned __int128>(splitmix64(state)) *
                                              static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(p[i], p[j]);
  }
  return p;
}

std::vector<int64_t> Sampler::length_grouped(std::vector<int64_t> order, const std::vector<int64_t>& lengths,
                                             int64_t megabatch) {
  MEMTUNE_CHECK(megabatch > 0, "sampler: a megabatch of ", megabatch, " samples; expected at least one");
  const int64_t n = static_cast<int64_t>(order.size());
  int64_t longest = -1, longest_at = 0;  // the first megabatch holding the longest sample
  for (int64_t b = 0; b < n; b += megabatch) {
    const auto first = order.begin() + b, last = order.begin() + std::min(n, b + megabatch);
    std::stable_sort(first, last, [&](int64_t x, int64_t y) { return lengths[x] > lengths[y]; });
    if (lengths[*first] > longest) {
      longest = lengths[*first];
      longest_at = b;
    }
  }
  if (n > 0) std::swap(order[0], order[longest_at]);
  return order;
}

int64_t Sampler::megabatch_size(int64_t n, int64_t step) {
  MEMTUNE_CHECK(step > 0, "sampler: ", step, " samples per step; expected at least one");
  return std::max<int64_t>(1, std::min<int64_t>(n / (4 * step), 50)) * step;
}

Sampler::Sampler(int64_t dataset_size, uint64_t seed, bool shuffle, int rank, int world_size)
    : size_(dataset_size), shuffle_(shuffle), rank_(rank), world_(world_size) {
  MEMTUNE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "sampler: rank ", rank,
                " outside a world of size ", world_size);
  per_rank_ = dataset_size / world_size;
  MEMTUNE_CHECK(per_rank_ > 0, "sampler: ", dataset_size, " samples cannot be shared by ", world_size,
                " ranks; each rank needs at least one (use more data or fewer processes)");
  state_.seed = seed;
}

void Sampler::group_by_length(std::vector<int64_t> lengths, int64_t megabatch) {
  MEMTUNE_CHECK(static_cast<int64_t>(lengths.size()) == size_, "sampler: ", lengths.size(), " lengths for ", size_,
                " samples");
  MEMTUNE_CHECK(megabatch > 0, "sampler: a megabatch of ", megabatch, " samples; expected at least one");
  lengths_ = std::move(lengths);
  state_.megabatch = megabatch;
  order_epoch_ = -1;
}

void Sampler::ensure_permutation() {
  if (order_epoch_ == state_.epoch) return;
  if (shuffle_) {
    order_ = permutation(size_, state_.seed, state_.epoch);
  } else {
    order_.resize(size_);
    std::iota(order_.begin(), order_.end(), 0);
  }
  if (state_.megabatch > 0) order_ = length_grouped(std::move(order_), lengths_, state_.megabatch);
  order_epoch_ = state_.epoch;
}

std::vector<int64_t> Sampler::next(int64_t count) {
  const int64_t used = per_rank_ * world_;  // entries of the permutation in use per epoch
  if (state_.offset >= used) {
    ++state_.epoch;
    state_.offset = 0;
  }
  ensure_permutation();
  const int64_t n = std::min(count, (used - state_.offset) / world_);
  std::vector<int64_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i, state_.offset += world_) out.push_back(order_[state_.offset + rank_]);
  return out;
}

int64_t Sampler::steps_per_epoch(int64_t global_batch) const {
  MEMTUNE_CHECK(global_batch > 0 && global_batch % world_ == 0, "sampler: a global batch of ", global_batch,
                " samples is not a positive multiple of the ", world_, " ranks");
  return (per_rank_ * world_ + global_batch - 1) / global_batch;
}

void Sampler::restore(const SamplerState& state) {
  MEMTUNE_CHECK(state.epoch >= 0 && state.offset >= 0 && state.offset <= per_rank_ * world_ &&
                    state.offset % world_ == 0,
                "sampler state: offset ", state.offset, " in epoch ", state.epoch, " does not fit ", size_,
                " samples over ", world_, " ranks (an epoch uses ", per_rank_ * world_,
                " and the offset must be a multiple of the world size); was the dataset or world size changed?");
  MEMTUNE_CHECK((state.megabatch > 0) == !lengths_.empty(), "sampler state: the checkpoint's order ",
                state.megabatch > 0 ? "was" : "was not", " grouped by length and this run's ",
                lengths_.empty() ? "is not" : "is", "; training.group_by_length must stay as the run began");
  state_ = state;
  order_epoch_ = -1;  // the seed may differ from the one the cached order was drawn with
}

}  // namespace memtune::data
