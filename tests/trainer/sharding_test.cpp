// distributed.sharding without processes: the partition against hand-worked cases and the
// greedy bound, the level's names and refusals, and the optimizer's share: W optimizers each
// owning 1/W of the tensors update them exactly as one optimizer owning all (the reference,
// itself tested against torch.optim and bitsandbytes), with 1/W of its state; the sharded
// checkpoint's layout, partial reads, a missing shard, the staged shards of a save that died,
// and the resume check across world sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/error.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"
#include "trainer/sharding.h"
#include "trainer/train_state.h"

namespace memtune::trainer {
namespace {

std::vector<int64_t> loads(const std::vector<int64_t>& numels, const std::vector<int>& owner, int world) {
  std::vector<int64_t> l(static_cast<size_t>(world), 0);
  for (size_t i = 0; i < numels.size(); ++i) l[static_cast<size_t>(owner[i])] += numels[i];
  return l;
}

TEST(ShardingPartition, HandWorkedCases) {
  // Largest first, each to the least loaded rank (the lower on ties):
  // 10 -> r0, 8 -> r1, 5 -> r1 (8 < 10), 4 -> r0 (10 < 13), 1 -> r1 (13 < 14).
  EXPECT_EQ(partition_by_numel({5, 10, 1, 8, 4}, 2), (std::vector<int>{1, 0, 1, 1, 0}));
  // Equal sizes go round the ranks in index order.
  EXPECT_EQ(partition_by_numel({3, 3, 3, 3, 3}, 3), (std::vector<int>{0, 1, 2, 0, 1}));
  // One rank owns everything; more ranks than tensors leave some with none.
  EXPECT_EQ(partition_by_numel({7, 1, 2}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(partition_by_numel({7, 1}, 3), (std::vector<int>{0, 1}));
  EXPECT_TRUE(partition_by_numel({}, 2).empty());
}

TEST(ShardingPartition, BalancedWithinTheLargestTensorOfTheIdeal) {
  // LoRA-like sizes: A (r x in) and B (out x r) of many projections.
  std::vector<int64_t> numels;
  for (int layer = 0; layer < 12; ++layer)
    for (int64_t out : {768, 768, 256, 768, 2048, 2048, 768}) {
      numels.push_back(16 * 768);
      numels.push_back(out * 16);
    }
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  for (int w : {2, 3, 4, 7}) {
    const std::vector<int> owner = partition_by_numel(numels, w);
    EXPECT_EQ(owner, partition_by_numel(numels, w)) << "deterministic";
    const auto l = loads(numels, owner, w);
    EXPECT_EQ(std::accumulate(l.begin(), l.end(), int64_t{0}), total);
    for (int64_t x : l) EXPECT_LE(x, (total + w - 1) / w + largest) << "W " << w;
    EXPECT_LE(*std::max_element(l.begin(), l.end()) - *std::min_element(l.begin(), l.end()), largest) << "W " << w;
  }
}

TEST(ShardingPartition, ContiguousRunsEndAtTheNearestBoundary) {
  // 28 elements, 2 ranks: the boundary nearest 14 is after 5 + 10 = 15.
  EXPECT_EQ(partition_contiguous({5, 10, 1, 8, 4}, 2), (std::vector<int>{0, 0, 1, 1, 1}));
  // 15 over 3: nearest 5 is 6 (after two), nearest 10 is 9 (after three).
  EXPECT_EQ(partition_contiguous({3, 3, 3, 3, 3}, 3), (std::vector<int>{0, 0, 1, 2, 2}));
  // A tie (1 and 3 both 1 from 2): the earlier boundary.
  EXPECT_EQ(partition_contiguous({1, 2, 1}, 2), (std::vector<int>{0, 1, 1}));
  // One rank owns everything; a large first tensor leaves rank 0 with none.
  EXPECT_EQ(partition_contiguous({7, 1, 2}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(partition_contiguous({7, 1}, 3), (std::vector<int>{1, 2}));
  EXPECT_TRUE(partition_contiguous({}, 2).empty());
}

TEST(ShardingPartition, ContiguousRunsAreWithinTheLargestTensorOfTheIdeal) {
  std::vector<int64_t> numels;
  for (int layer = 0; layer < 12; ++layer)
    for (int64_t out : {768, 768, 256, 768, 2048, 2048, 768}) {
      numels.push_back(16 * 768);
      numels.push_back(out * 16);
    }
  numels.push_back(32000 * 16);  // a large one at the end (a trained head's adapter, say)
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  for (int w : {2, 3, 4, 7}) {
    const std::vector<int> owner = partition_contiguous(numels, w);
    EXPECT_TRUE(std::is_sorted(owner.begin(), owner.end())) << "W " << w << ": runs in rank order";
    const auto l = loads(numels, owner, w);
    EXPECT_EQ(std::accumulate(l.begin(), l.end(), int64_t{0}), total);
    for (int64_t x : l) EXPECT_LE(x, total / w + largest) << "W " << w;
  }
  // The trainable tensors' owners: the same runs over the list reversed.
  EXPECT_EQ(shard_owners({5, 10, 1, 8, 4}, 2), (std::vector<int>{1, 1, 0, 0, 0}));  // 4 + 8 + 1 = 13 nearest 14
  // A sharded layer's tensors (marked) divided by themselves: each rank keeps half of them,
  // where one partition would give rank 0 all four beside the large unmarked one.
  EXPECT_EQ(shard_owners({100, 1, 1, 1, 1}, 2), (std::vector<int>{1, 0, 0, 0, 0}));
  EXPECT_EQ(shard_owners({100, 1, 1, 1, 1}, 2, {false, true, true, true, true}), (std::vector<int>{1, 1, 1, 0, 0}));
}

TEST(ShardingLevel, NamesAliasesAndRefusals) {
  EXPECT_EQ(shard_level("none"), ShardLevel::none);
  EXPECT_EQ(shard_level("optimizer"), ShardLevel::optimizer);
  EXPECT_EQ(shard_level("zero2"), ShardLevel::gradients);
  EXPECT_EQ(shard_level("full"), ShardLevel::full);
  EXPECT_EQ(shard_level("zero3"), ShardLevel::full);
  EXPECT_THROW(shard_level("stage2"), UserError);
}

TEST(ShardingLevel, ConfigTakesDeepSpeedStageNames) {
  const std::string base = "model: {name_or_path: tiny-llama}\n";
  EXPECT_EQ(parse_config(base, "t.yaml").distributed.sharding, "none");
  EXPECT_EQ(parse_config(base, "t.yaml", {"distributed.sharding=zero1"}).distributed.sharding, "optimizer");
  EXPECT_EQ(parse_config(base, "t.yaml", {"distributed.sharding=ZeRO2"}).distributed.sharding, "gradients");
  EXPECT_EQ(parse_config(base + "distributed: {sharding: gradients}\n", "t.yaml").distributed.sharding, "gradients");
  EXPECT_EQ(parse_config(base, "t.yaml", {"distributed.sharding=zero3"}).distributed.sharding, "full");
  // full shards a full fine-tune's weights too (trainer/layer_shards.h).
  EXPECT_EQ(parse_config(base, "t.yaml", {"distributed.sharding=full", "training.finetune=full"}).distributed.sharding,
            "full");
  try {
    parse_config(base, "t.yaml", {"distributed.sharding=optimiser"});
    FAIL() << "a misspelt level accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer"), std::string::npos) << e.what();
  }
}

// Parameters of mixed sizes (8-bit states from 4096 elements), norms among them.
std::vector<std::pair<std::string, at::Tensor>> make_params() {
  at::manual_seed(3);
  return {{"l0.q.lora_A.weight", at::randn({8, 640})}, {"l0.q.lora_B.weight", at::randn({96, 8})},
          {"l0.norm.weight", at::randn({96})},         {"l1.up.lora_A.weight", at::randn({8, 96})},
          {"l1.up.lora_B.weight", at::randn({800, 8})}, {"lm_head.weight", at::randn({7, 96})}};
}

struct Outcome {
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> state;
  int64_t state_bytes = 0;
  int64_t held = 0;  // budget bytes the optimizer allocated
};

// Three updates from gradients drawn from a fixed seed; `owned` as the optimizer takes it.
Outcome run(const std::string& optim, const std::vector<bool>& owned) {
  install_cpu_budget_allocator();
  auto params = make_params();
  dynamic_map(true);
  dynamic_map(false);
  OptimizerOptions o;
  set_optimizer_kind(optim, o);
  o.weight_decay = 0.01;
  o.momentum = 0.9;
  const int64_t before = cpu_allocated_bytes();
  Optimizer opt(params, o, owned);
  Outcome r;
  r.held = cpu_allocated_bytes() - before;
  at::manual_seed(11);
  for (int step = 0; step < 3; ++step) {
    for (auto& [name, p] : params) p.mutable_grad() = at::randn(p.sizes());
    opt.step(1e-2, 0.5);
  }
  for (auto& [name, p] : params) r.params.push_back(p.clone());
  for (auto& [name, t] : opt.state_tensors()) r.state.emplace_back(name, t.clone());
  r.state_bytes = opt.state_bytes();
  opt.zero_grad();
  for (auto& [name, p] : params) EXPECT_FALSE(p.grad().defined()) << name << ": zero_grad drops every gradient";
  return r;
}

class ShardedOptimizer : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedOptimizer, EachShardUpdatesItsTensorsAsTheWholeOptimizerDoes) {
  const Outcome whole = run(GetParam(), {});
  std::vector<int64_t> numels;
  for (const auto& [name, p] : make_params()) numels.push_back(p.numel());
  for (int w : {2, 3}) {
    const std::vector<int> owner = partition_by_numel(numels, w);
    std::vector<int> seen(numels.size(), 0);
    std::map<std::string, at::Tensor> states;
    int64_t bytes = 0;
    for (int r = 0; r < w; ++r) {
      std::vector<bool> owned;
      for (int o : owner) owned.push_back(o == r);
      const Outcome part = run(GetParam(), owned);
      bytes += part.state_bytes;
      for (size_t i = 0; i < numels.size(); ++i) {
        if (!owned[i]) {  // left alone: the initial value
          EXPECT_TRUE(at::equal(part.params[i], make_params()[i].second)) << "W " << w << " rank " << r << " tensor " << i;
          continue;
        }
        ++seen[i];
        EXPECT_TRUE(at::equal(part.params[i], whole.params[i])) << "W " << w << " rank " << r << " tensor " << i;
      }
      for (const auto& [name, t] : part.state) EXPECT_TRUE(states.emplace(name, t).second) << name << " in two shards";
    }
    EXPECT_EQ(seen, std::vector<int>(numels.size(), 1)) << "every tensor updated by exactly one shard";
    ASSERT_EQ(states.size(), whole.state.size());
    for (const auto& [name, t] : whole.state) EXPECT_TRUE(at::equal(states.at(name), t)) << name;
    // The shards' states add up to the whole's (workspaces aside: each shard's is its largest tensor).
    if (GetParam() != "adamw_torch") {
      EXPECT_EQ(bytes, whole.state_bytes) << "W " << w;
    }
  }
}

TEST_P(ShardedOptimizer, StateIsAllocatedForOwnedTensorsOnly) {
  const Outcome whole = run(GetParam(), {});
  const Outcome none = run(GetParam(), std::vector<bool>(6, false));
  EXPECT_GT(whole.state_bytes, 0);
  EXPECT_EQ(none.state_bytes, 0);
  EXPECT_TRUE(none.state.empty());
  if (GetParam().rfind("paged", 0) != 0) {  // paged states live outside the budget
    EXPECT_EQ(whole.held, whole.state_bytes) << "the budget allocator sees the state";
    EXPECT_EQ(none.held, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, ShardedOptimizer,
                         ::testing::Values("adamw_torch", "sgd", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"));

}  // namespace
}  // namespace memtune::trainer

namespace memtune::trainer {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::path(MEMTUNE_BUILD_DIR) / "test-tmp" / ("ShardedCheckpoint_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A checkpoint as two ranks write it: each its shard, then rank 0 the rest and the index.
fs::path save_two_shards(const fs::path& out, int64_t step) {
  models::save_safetensors(optimizer_shard_path(out, step, 0, 2),
                           {{"a.weight.exp_avg", at::full({3}, 1.0f)}, {"a.weight.exp_avg_sq", at::full({3}, 2.0f)}});
  models::save_safetensors(optimizer_shard_path(out, step, 1, 2), {{"b.weight.exp_avg", at::full({2, 2}, 3.0f)},
                                                                   {"b.weight.exp_avg_sq", at::full({2, 2}, 4.0f)}});
  TrainState s;
  s.step = step;
  s.sampler = {{"epoch", 0}, {"offset", 0}, {"seed", 1}};
  s.scaler = s.supervisor = s.optimizer = nlohmann::json::object();
  s.world_size = 2;
  return save_training_checkpoint(out, s, {{"a.weight", at::zeros({3})}, {"b.weight", at::zeros({2, 2})}}, {},
                                  at::zeros({4}, at::kByte), "model: {name_or_path: tiny-llama}\n", 0, 2);
}

TEST(ShardedCheckpoint, ShardsMoveInWithAnIndexAndEachRankReadsItsOwnTensors) {
  const fs::path out = fresh_dir("layout");
  const fs::path ck = save_two_shards(out, 4);
  EXPECT_EQ(ck, out / "checkpoints/step-4");
  EXPECT_TRUE(fs::exists(ck / "optimizer-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(ck / "optimizer-00002-of-00002.safetensors"));
  EXPECT_FALSE(fs::exists(ck / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(out / "checkpoints/step-4.shards")) << "the staging directory is gone";
  const auto index = nlohmann::json::parse(std::ifstream(ck / "optimizer.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"]["b.weight.exp_avg_sq"], "optimizer-00002-of-00002.safetensors");
  EXPECT_EQ(index["metadata"]["world_size"], "2");
  // Rank 1 of 3 under another partition wants b's state only; a plain process all of it.
  const TrainingCheckpoint some = load_training_checkpoint(ck, [](const std::string& k) { return k[0] == 'b'; });
  ASSERT_EQ(some.optimizer.size(), 2u);
  EXPECT_TRUE(at::equal(some.optimizer.at("b.weight.exp_avg_sq"), at::full({2, 2}, 4.0f)));
  EXPECT_EQ(load_training_checkpoint(ck).optimizer.size(), 4u);
  EXPECT_EQ(some.state.world_size, 2);
  // A shard gone: refused, naming it.
  fs::remove(ck / "optimizer-00002-of-00002.safetensors");
  try {
    load_training_checkpoint(ck);
    FAIL() << "a checkpoint without one of its shards loaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer-00002-of-00002.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
}

TEST(ShardedCheckpoint, TheShardsOfASaveThatDiedAreRemovedAndThePreviousCheckpointStays) {
  const fs::path out = fresh_dir("died");
  save_two_shards(out, 2);
  // Step 4: both ranks wrote their shards, then the run died before rank 0 committed.
  models::save_safetensors(optimizer_shard_path(out, 4, 0, 2), {{"a.weight.exp_avg", at::zeros({3})}});
  models::save_safetensors(optimizer_shard_path(out, 4, 1, 2), {{"b.weight.exp_avg", at::zeros({2, 2})}});
  EXPECT_EQ(latest_checkpoint(out), out / "checkpoints/step-2") << "staged shards are no checkpoint";
  EXPECT_EQ(remove_incomplete_checkpoints(out), 1);
  EXPECT_FALSE(fs::exists(out / "checkpoints/step-4.shards"));
  EXPECT_EQ(latest_checkpoint(out), out / "checkpoints/step-2");
  EXPECT_EQ(load_training_checkpoint(out / "checkpoints/step-2").optimizer.size(), 4u);
}

// Earlier versions took warmup_steps over warmup_ratio where a config set both (refused
// now): such a checkpoint resumes under the same warm-up given as warmup_steps alone, and
// not under another.
TEST(ResumeCompatibility, AnEarlierConfigWithBothWarmupKeysTrainedByItsSteps) {
  Config then = parse_config("model: {name_or_path: tiny-llama}\ntraining: {warmup_steps: 5}\n", "t");
  then.training.warmup_ratio = 0.1;  // as an earlier version wrote it beside warmup_steps
  const Config now = parse_config("model: {name_or_path: tiny-llama}\ntraining: {warmup_steps: 5}\n", "t");
  EXPECT_NO_THROW(check_resume_compatible(now, then, "ck", 1, 1));
  const Config ratio = parse_config("model: {name_or_path: tiny-llama}\ntraining: {warmup_ratio: 0.1}\n", "t");
  EXPECT_THROW(check_resume_compatible(ratio, then, "ck", 1, 1), UserError);
}

TEST(ShardedCheckpoint, ResumeKeepsTheSamplesOfAStepOverAllRanks) {
  const Config c2 = parse_config("model: {name_or_path: tiny-llama}\ntraining: {per_device_train_batch_size: 3}\n", "t");
  const Config c3 = parse_config("model: {name_or_path: tiny-llama}\ntraining: {per_device_train_batch_size: 2}\n", "t");
  EXPECT_NO_THROW(check_resume_compatible(c3, c2, "ck", 3, 2));  // 3 x 2 after 2 x 3
  EXPECT_NO_THROW(check_resume_compatible(c2, c2, "ck", 2, 0));  // an older checkpoint: the same world assumed
  try {
    check_resume_compatible(c2, c2, "ck", 3, 2);  // 3 x 3 after 2 x 3
    FAIL() << "a step of 9 samples continued one of 6";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("a step trained on 6 samples (2 ranks x 3"), std::string::npos) << m;
    EXPECT_NE(m.find("this run has 3 ranks x 3 = 9"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace memtune::trainer

namespace memtune::trainer {
namespace {

// save_total_limit with a best checkpoint (metric_for_best_model): what transformers 5.12's
// rotate_checkpoints leaves of checkpoint-<step> directories, run on each case below.
TEST(CheckpointRotation, KeepsWhatTransformersKeeps) {
  struct Case {
    std::vector<int64_t> steps;
    int limit;
    int64_t best;
    std::vector<int64_t> transformers_kept;
  };
  const std::vector<Case> cases = {
      {{2, 4, 6, 8}, 2, 0, {6, 8}},       {{2, 4, 6, 8}, 2, 2, {2, 8}},        {{2, 4, 6, 8}, 1, 4, {4, 8}},
      {{2, 4, 6, 8}, 1, 8, {8}},          {{2, 4, 6, 8, 10}, 3, 4, {4, 8, 10}}, {{2, 4}, 1, 2, {2, 4}},
      {{5, 10, 15}, 5, 5, {5, 10, 15}},   {{3, 6, 9, 12}, 2, 12, {9, 12}},     {{3, 6, 9, 12}, 2, 6, {6, 12}},
  };
  for (const Case& c : cases) {
    const std::vector<size_t> gone = checkpoints_to_prune(c.steps, c.limit, c.best);
    std::vector<int64_t> kept;
    for (size_t i = 0; i < c.steps.size(); ++i)
      if (std::find(gone.begin(), gone.end(), i) == gone.end()) kept.push_back(c.steps[i]);
    EXPECT_EQ(kept, c.transformers_kept) << "limit " << c.limit << " best " << c.best;
  }
}

// state.json's best (metric_for_best_model) round-trips, and a damaged one is refused naming
// the field.
TEST(CheckpointRotation, StateKeepsTheBestAndRefusesADamagedOne) {
  TrainState s;
  s.step = 6;
  s.sampler = s.scaler = s.supervisor = s.optimizer = nlohmann::json::object();
  s.world_size = 1;
  s.best_metric = 2.5;
  s.best_step = 4;
  s.best_checkpoint = 4;
  const TrainState back = TrainState::from_json(s.to_json(), "state.json");
  EXPECT_EQ(back.best_metric, 2.5);
  EXPECT_EQ(back.best_checkpoint, 4);
  nlohmann::json bad = s.to_json();
  bad["best"]["metric"] = "low";
  try {
    TrainState::from_json(bad, "state.json");
    ADD_FAILURE() << "accepted";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("state.json.best.metric is \"low\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memtune::trainer
