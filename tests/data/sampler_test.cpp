#include <algorithm>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/sampler.h"
#include "runtime/error.h"
#include "test_util.h"

using memtune::data::Sampler;
using memtune::data::SamplerState;

TEST(Sampler, Splitmix64MatchesPublishedOutputs) {
  // splitmix64 from seed 1234567: the sequence published with the algorithm's reference code.
  uint64_t s = 1234567;
  const uint64_t want[] = {6457827717110365317ULL, 3203168211198807973ULL, 9817491932198370423ULL,
                           4593380528125082431ULL, 16408922859458223821ULL};
  for (uint64_t w : want) EXPECT_EQ(memtune::data::splitmix64(s), w);
}

TEST(Sampler, PermutationMatchesPythonReference) {
  namespace t = memtune::testing;
  for (auto [n, seed, epoch] : {std::tuple<int64_t, uint64_t, int64_t>{10, 42, 0}, {37, 42, 3}, {1000, 7, 1}}) {
    const auto r = t::run(t::python() + " " + (t::source_dir() / "tests/reference/sampler_permutation.py").string() +
                          " " + std::to_string(n) + " " + std::to_string(seed) + " " + std::to_string(epoch));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream in(r.output);
    std::vector<int64_t> want;
    for (int64_t v; in >> v;) want.push_back(v);
    EXPECT_EQ(Sampler::permutation(n, seed, epoch), want) << "n=" << n << " seed=" << seed << " epoch=" << epoch;
  }
}

TEST(Sampler, EpochsAreDifferentPermutations) {
  const auto a = Sampler::permutation(50, 1, 0), b = Sampler::permutation(50, 1, 1), c = Sampler::permutation(50, 2, 0);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
}

TEST(Sampler, AStepEndsWithItsEpochAndTheNextStartsTheNextEpoch) {
  Sampler s(5, 0, /*shuffle=*/false);
  EXPECT_EQ(s.next(3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(s.next(3), (std::vector<int64_t>{3, 4}));  // the epoch's rest, not 0 of the next
  EXPECT_EQ(s.epoch(), 0);
  EXPECT_EQ(s.next(3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(s.epoch(), 1);
}

// transformers' Trainer (5.12: set_initial_training_values, _run_epoch), written out: an
// epoch is len(dataloader) = ceil(N / batch) micro-batches (the last one short, no
// drop_last), cut into optimizer steps of gradient_accumulation_steps micro-batches, the
// last one of the epoch with the remainder; max_steps = ceil(num_train_epochs x steps).
TEST(Sampler, StepsAndTheirSamplesAreTheTrainersPerEpoch) {
  for (int64_t n : {1, 7, 10, 16, 23, 64}) {
    for (auto [batch, accumulation] : {std::pair<int64_t, int64_t>{1, 1}, {2, 4}, {3, 2}, {8, 1}, {4, 5}}) {
      const int64_t len_dataloader = (n + batch - 1) / batch;
      const int64_t hf_steps = std::max<int64_t>(
          len_dataloader / accumulation + (len_dataloader % accumulation > 0 ? 1 : 0), 1);
      Sampler s(n, 3);
      const int64_t per_step = batch * accumulation;
      ASSERT_EQ(s.steps_per_epoch(per_step), hf_steps) << n << " samples, " << batch << " x " << accumulation;
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::vector<int64_t> seen;
        int64_t first_micro_batch = 0;  // the Trainer's micro-batches of this epoch, in order
        for (int64_t step = 0; step < hf_steps; ++step) {
          const int64_t micro_batches = std::min(accumulation, len_dataloader - first_micro_batch);
          const int64_t rows = std::min(n, (first_micro_batch + micro_batches) * batch) - first_micro_batch * batch;
          first_micro_batch += micro_batches;
          const auto got = s.next(per_step);
          EXPECT_EQ(static_cast<int64_t>(got.size()), rows) << "step " << step << " of epoch " << epoch;
          EXPECT_EQ(s.epoch(), epoch);
          seen.insert(seen.end(), got.begin(), got.end());
        }
        EXPECT_EQ(seen, Sampler::permutation(n, 3, epoch)) << n << " samples: each once, in the epoch's order";
      }
    }
  }
}

TEST(Sampler, SaveRestoreLosesAndRepeatsNothing) {
  const int64_t n = 23;
  Sampler a(n, 99);
  std::vector<int64_t> seen = a.next(9);
  // Checkpoint through JSON, as training checkpoints store it.
  const nlohmann::json saved = a.state();
  Sampler b(n, /*seed ignored on restore=*/12345);
  b.restore(saved.get<SamplerState>());
  const auto rest = b.next(n);  // the rest of epoch 0
  seen.insert(seen.end(), rest.begin(), rest.end());
  EXPECT_EQ(seen, Sampler::permutation(n, 99, 0));  // each sample of epoch 0 exactly once
  const auto epoch1 = b.next(5);
  const auto order1 = Sampler::permutation(n, 99, 1);
  EXPECT_EQ(epoch1, std::vector<int64_t>(order1.begin(), order1.begin() + 5));
  EXPECT_EQ(b.epoch(), 1);
  // The resumed run continues exactly as the uninterrupted one.
  EXPECT_EQ(a.next(n), rest);
  EXPECT_EQ(a.next(5), epoch1);
  // A checkpoint at an epoch's end (offset = all of it) resumes into the next epoch.
  Sampler c(n, 99);
  c.restore(SamplerState{0, n, 99});
  EXPECT_EQ(c.next(5), epoch1);
}

TEST(Sampler, TwoRankShardsAreDisjointAndCoverTheEpoch) {
  const int64_t n = 11;  // odd: the last entry of each epoch's permutation is dropped
  Sampler r0(n, 5, true, 0, 2), r1(n, 5, true, 1, 2);
  EXPECT_EQ(r0.per_rank(), 5);
  const auto a = r0.next(5), b = r1.next(5);
  const auto perm = Sampler::permutation(n, 5, 0);
  std::set<int64_t> all(a.begin(), a.end());
  for (int64_t v : b) EXPECT_EQ(all.count(v), 0u) << v;
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all, std::set<int64_t>(perm.begin(), perm.begin() + 10));
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(a[i], perm[2 * i]);
    EXPECT_EQ(b[i], perm[2 * i + 1]);
  }
  // Both ranks hold the same state, and move to epoch 1 together.
  EXPECT_EQ(r0.state().offset, 10);
  EXPECT_EQ(r1.state().offset, 10);
  EXPECT_EQ(r0.next(1)[0], Sampler::permutation(n, 5, 1)[0]);
  EXPECT_EQ(r1.next(1)[0], Sampler::permutation(n, 5, 1)[1]);
}

// Over ranks the epoch's last step is as short on each (every rank takes part in each
// step's collectives): 11 samples over 2 ranks keep 10, 5 per rank; at 2 per rank and step
// that is 2, 2 and 1 on both, disjoint, covering the 10.
TEST(Sampler, OverRanksTheLastStepOfAnEpochIsAsShortOnEach) {
  const int64_t n = 11;
  Sampler r0(n, 9, true, 0, 2), r1(n, 9, true, 1, 2);
  EXPECT_EQ(r0.steps_per_epoch(4), 3);
  std::set<int64_t> seen;
  for (int64_t want : {2, 2, 1}) {
    const auto a = r0.next(2), b = r1.next(2);
    EXPECT_EQ(static_cast<int64_t>(a.size()), want);
    EXPECT_EQ(static_cast<int64_t>(b.size()), want);
    seen.insert(a.begin(), a.end());
    seen.insert(b.begin(), b.end());
  }
  const auto perm = Sampler::permutation(n, 9, 0);
  EXPECT_EQ(seen, std::set<int64_t>(perm.begin(), perm.begin() + 10));
  EXPECT_EQ(r0.epoch(), 0);
  EXPECT_EQ(r0.next(2).size(), 2u);
  EXPECT_EQ(r0.epoch(), 1);
}

TEST(Sampler, StepsPerEpoch) {
  Sampler s(100, 0, true, 1, 2);  // 50 per rank
  EXPECT_EQ(s.steps_per_epoch(8), 13);   // 100 / 8: 12 and a last step on the other 4
  EXPECT_EQ(s.steps_per_epoch(10), 10);
  EXPECT_EQ(s.steps_per_epoch(200), 1);
  EXPECT_THROW(s.steps_per_epoch(3), memtune::UserError);  // not a multiple of 2 ranks
}

TEST(Sampler, BadStatesAreErrors) {
  Sampler s(10, 0, true, 0, 2);
  EXPECT_THROW(s.restore({0, 3, 0}), memtune::UserError);   // odd offset under 2 ranks
  EXPECT_THROW(s.restore({0, 12, 0}), memtune::UserError);  // past the epoch
  EXPECT_THROW((nlohmann::json{{"epoch", 1}, {"seed", 2}}.get<SamplerState>()), memtune::UserError);
  EXPECT_THROW(Sampler(1, 0, true, 0, 2), memtune::UserError);  // fewer samples than ranks
}

// Grouping by length against transformers' own get_length_grouped_indices (transformers
// 5.x, trainer_pt_utils.py), run with torch.randperm replaced by the same permutation
// (Sampler::permutation, which PermutationMatchesPythonReference checks): the lists below
// are what it returned. Its batch_size is per_device_train_batch_size x
// gradient_accumulation_steps, and megabatch_size is its default megabatch for that.
TEST(Sampler, LengthGroupingIsTransformersGetLengthGroupedIndices) {
  struct Case {
    std::vector<int64_t> lengths;
    int64_t batch_size;
    uint64_t seed;
    int64_t epoch;
    int64_t megabatch;  // 50 or n / (4 x batch) batches, at least one, as transformers
    std::vector<int64_t> transformers;
  };
  std::vector<int64_t> forty;  // the longest (23) not in the first megabatch
  for (int64_t i = 0; i < 40; ++i) forty.push_back((i * 37) % 23 + 1);
  std::vector<int64_t> ties;  // five lengths over 200 samples: megabatches of 48 keep their drawn order among equals
  for (int64_t i = 0; i < 200; ++i) ties.push_back((i * 13) % 5);
  const std::vector<Case> cases = {
      {{5, 9, 9, 3, 12, 7, 7, 1, 30, 4, 9, 12, 2, 8, 8, 30, 6, 11, 3, 5, 10, 1, 7},  // ties, two of the longest
       2, 7, 0, 4,
       {8, 17, 10, 13, 4, 22, 9, 18, 1, 5, 0, 7, 20, 2, 19, 21, 15, 6, 3, 12, 11, 14, 16}},
      {forty, 3, 11, 2, 9,
       {18, 16, 11, 37, 20, 38, 15, 10, 0,  26, 31, 8,  3,  39, 29, 4,  35, 5,  6,
        14, 27, 22, 17, 30, 2,  28, 23, 13, 36, 21, 34, 1,  32, 9,  7,  33, 24, 19, 12, 25}},
      {{3, 1, 4, 1, 5}, 4, 1, 0, 4, {4, 2, 0, 3, 1}},  // tiny: one batch per megabatch
      {ties, 4, 5, 1, 48,
       {
        128, 123, 8, 168, 18, 13, 148, 193, 68, 158, 183, 31, 16, 196, 91, 1, 151, 81, 186, 19,
        59, 44, 199, 134, 154, 144, 87, 122, 132, 142, 17, 187, 62, 82, 117, 190, 135, 85, 110, 100,
        10, 70, 0, 95, 170, 35, 195, 155, 113, 178, 138, 58, 83, 188, 23, 6, 106, 11, 176, 21,
        136, 171, 181, 169, 24, 49, 159, 64, 189, 4, 114, 54, 99, 34, 124, 107, 127, 22, 92, 72,
        147, 197, 27, 162, 177, 112, 57, 77, 140, 75, 120, 55, 30, 45, 165, 130, 118, 103, 93, 73,
        53, 33, 63, 198, 3, 131, 116, 71, 46, 166, 191, 141, 61, 51, 126, 146, 86, 89, 179, 104,
        29, 149, 109, 194, 84, 119, 14, 37, 152, 32, 157, 97, 42, 182, 52, 192, 167, 160, 125, 50,
        115, 80, 25, 60, 108, 98, 173, 48, 153, 38, 133, 28, 163, 156, 101, 161, 111, 76, 121, 56,
        36, 26, 66, 184, 94, 79, 174, 39, 74, 129, 9, 69, 139, 164, 102, 67, 47, 172, 137, 7,
        2, 15, 65, 180, 40, 150, 175, 105, 90, 185, 20, 145, 88, 78, 143, 43, 41, 96, 12, 5}},
  };
  for (const Case& c : cases) {
    const auto n = static_cast<int64_t>(c.lengths.size());
    EXPECT_EQ(Sampler::megabatch_size(n, c.batch_size), c.megabatch) << "n=" << n;
    EXPECT_EQ(Sampler::length_grouped(Sampler::permutation(n, c.seed, c.epoch), c.lengths, c.megabatch),
              c.transformers)
        << "n=" << n;
    // The sampler itself, one rank: the epoch's order is that.
    Sampler s(n, c.seed);
    s.group_by_length(c.lengths, c.megabatch);
    for (int64_t e = 0; e < c.epoch; ++e) s.next(n);  // to the case's epoch
    EXPECT_EQ(s.next(n), c.transformers) << "n=" << n;
  }
  EXPECT_EQ(Sampler::megabatch_size(100000, 8), 400);  // capped at 50 batches
}

// Two ranks take the grouped order as they take the shuffled one (every other entry), so
// a step's rows on every rank come from one megabatch; a checkpoint keeps the megabatch,
// and a run resumed under another micro-batch (another megabatch_size) draws the same
// order. A checkpoint grouped and a run not grouped (or the reverse) are refused.
TEST(Sampler, GroupedOrderOverRanksAndAcrossAResume) {
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 30; ++i) lengths.push_back((i * 7) % 13);
  const auto grouped = Sampler::length_grouped(Sampler::permutation(30, 3, 0), lengths, 6);
  Sampler r0(30, 3, true, 0, 2), r1(30, 3, true, 1, 2);
  r0.group_by_length(lengths, 6);
  r1.group_by_length(lengths, 6);
  const auto a = r0.next(15), b = r1.next(15);
  for (int i = 0; i < 15; ++i) {
    EXPECT_EQ(a[i], grouped[2 * i]);
    EXPECT_EQ(b[i], grouped[2 * i + 1]);
  }
  // Within each megabatch, lengths fall after its first entry (which may be the one
  // swapped out of the first megabatch for the longest).
  for (int64_t m = 0; m < 30; m += 6)
    for (int64_t i = m + 2; i < m + 6; ++i) EXPECT_GE(lengths[grouped[i - 1]], lengths[grouped[i]]) << i;
  EXPECT_EQ(lengths[grouped[0]], *std::max_element(lengths.begin(), lengths.end()));

  Sampler straight(30, 3);
  straight.group_by_length(lengths, 6);
  straight.next(8);
  const nlohmann::json saved = straight.state();
  EXPECT_EQ(saved["megabatch"], 6);
  Sampler resumed(30, 3);
  resumed.group_by_length(lengths, 12);  // the resumed run's own size: the checkpoint's wins
  resumed.restore(saved.get<SamplerState>());
  EXPECT_EQ(resumed.next(40), straight.next(40));  // the rest of epoch 0, and into epoch 1

  Sampler plain(30, 3);
  EXPECT_THROW(plain.restore(saved.get<SamplerState>()), memtune::UserError);
  Sampler grouping(30, 3);
  grouping.group_by_length(lengths, 6);
  EXPECT_THROW(grouping.restore(SamplerState{0, 4, 3}), memtune::UserError);
  EXPECT_THROW((nlohmann::json{{"epoch", 0}, {"offset", 0}, {"seed", 2}, {"megabatch", 0}}.get<SamplerState>()),
               memtune::UserError);
}
