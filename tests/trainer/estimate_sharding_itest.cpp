// The estimate per rank under distributed.sharding: its optimizer state against what the
// sharded optimizers of the model trainer::setup_model builds allocate (the CPU budget
// allocator), rank by rank; and `memtune estimate --nproc N`'s line per level.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "models/causal_lm.h"
#include "runtime/cpu_budget_allocator.h"
#include "trainer/estimator.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"
#include "trainer/sharding.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

struct Shape {
  std::string name;
  std::vector<std::string> overrides;
};

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

class EstimateSharding : public ::testing::TestWithParam<Shape> {};

TEST_P(EstimateSharding, PerRankOptimizerStateAgreesWithTheShardedOptimizers) {
  install_cpu_budget_allocator();
  trainer::Config c = trainer::parse_config("runtime: {device: cpu}", "test", GetParam().overrides);
  trainer::ModelBundle bundle = trainer::setup_model(c);
  const auto params = bundle.model->trainable_parameters();
  trainer::OptimizerOptions oo;
  trainer::set_optimizer_kind(c.training.optim, oo);
  trainer::dynamic_map(true);  // built once per process, not state
  trainer::dynamic_map(false);
  std::vector<int64_t> numels;
  int64_t largest_state = 0;
  for (const auto& [name, p] : params) {
    numels.push_back(p.numel());
    largest_state = std::max(largest_state, trainer::optimizer_state_bytes(oo.kind, false, p.sizes(), c.training.momentum != 0) + p.numel() * 4);
  }
  for (int w : {1, 2, 3}) {
    trainer::EstimateInput in = trainer::estimate_input(c, trainer::model_spec(c));
    in.world_size = w;
    in.sharding = "optimizer";
    const trainer::Estimate e = estimate_memory(in);
    const std::vector<int> owner = trainer::shard_owners(numels, w);
    int64_t sum = 0;
    for (int r = 0; r < w; ++r) {
      std::vector<bool> owned;
      for (int o : owner) owned.push_back(o == r);
      const int64_t before = cpu_allocated_bytes();
      trainer::Optimizer opt(params, oo, owned);
      const int64_t measured = cpu_allocated_bytes() - before;  // states and workspace on this rank
      sum += measured;
      EXPECT_LE(std::abs(measured - (e.optimizer_states + e.optimizer_workspace)), largest_state)
          << GetParam().name << " W " << w << " rank " << r << ": measured " << measured << ", estimated "
          << e.optimizer_states << " + workspace " << e.optimizer_workspace;
    }
    if (oo.kind != "adamw") {  // no workspace: the ranks' states add up to one process's
      EXPECT_LE(std::abs(sum - w * e.optimizer_states), w) << GetParam().name << " W " << w;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EstimateSharding,
    ::testing::Values(Shape{"llama_nf4_lora_adamw", {"model.name_or_path=tiny-llama",
                                                     "model.quantization_config.load_in_4bit=true"}},
                      Shape{"llama_lora_adamw_8bit", {"model.name_or_path=tiny-llama", "lora.r=64",
                                                      "training.optim=adamw_8bit"}},
                      Shape{"gpt2_full_sgd", {"model.name_or_path=tiny-gpt2", "training.finetune=full",
                                              "training.optim=sgd"}},
                      Shape{"gpt2_full_adamw", {"model.name_or_path=tiny-gpt2", "training.finetune=full"}}),
    [](const ::testing::TestParamInfo<Shape>& info) { return info.param.name; });

json estimate_json(const fs::path& cfg, const std::string& args) {
  auto r = run(memtune_bin() + " estimate " + cfg.string() + " --json " + args, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find('{');
  if (at == std::string::npos) return json::object();
  return json::parse(r.output.substr(at, r.output.rfind('}') - at + 1));
}

int64_t component(const json& j, const std::string& name) {
  for (const auto& k : j["components"])
    if (k["name"] == name) return k["bytes"].get<int64_t>();
  ADD_FAILURE() << "no component " << name << " in " << j.dump();
  return -1;
}

TEST(EstimateCommand, NprocGivesEachShardingLevelPerRank) {
  fs::path d = temp_dir();
  write_file(d / "c.yaml", "model: {name_or_path: tiny-gpt2}\ntraining: {finetune: full, output_dir: " +
                               (d / "out").string() + "}\ndata: {max_seq_length: 64}\nruntime: {device: cpu}\n");
  const json one = estimate_json(d / "c.yaml", "");
  const int64_t states = component(one, "optimizer states"), grads = component(one, "gradients");
  const json three = estimate_json(d / "c.yaml", "--nproc 3 distributed.sharding=zero2");
  EXPECT_EQ(three["world_size"], 3);
  EXPECT_EQ(three["sharding"], "gradients");
  EXPECT_EQ(component(three, "optimizer states"), (states + 2) / 3);
  EXPECT_EQ(component(three, "gradients after reduction"), (grads + 2) / 3);
  ASSERT_EQ(three["sharding_levels"].size(), 4u) << three.dump();
  std::map<std::string, json> by;
  for (const auto& l : three["sharding_levels"]) by[l["level"].get<std::string>()] = l;
  EXPECT_EQ(by["none"]["optimizer_states"], states);
  EXPECT_EQ(by["none"]["sharding_buffer"], 0);
  EXPECT_EQ(by["optimizer"]["optimizer_states"], (states + 2) / 3);
  EXPECT_EQ(by["optimizer"]["gradients_after_reduce"], grads);
  EXPECT_EQ(by["gradients"]["gradients_after_reduce"], (grads + 2) / 3);
  EXPECT_EQ(by["gradients"]["peak_bytes"], three["peak_bytes"]);
  EXPECT_GT(by["none"]["peak_bytes"].get<int64_t>(), by["optimizer"]["peak_bytes"].get<int64_t>());
  EXPECT_GE(by["optimizer"]["peak_bytes"].get<int64_t>(), by["gradients"]["peak_bytes"].get<int64_t>());
  // full: the layers' weights (a full fine-tune's, trainable) 1/3 per rank, one layer gathered whole.
  EXPECT_EQ(by["full"]["weights"].get<int64_t>(),
            by["gradients"]["weights"].get<int64_t>() - by["full"]["layers_sharded_from"].get<int64_t>() +
                (by["full"]["layers_sharded_from"].get<int64_t>() + 2) / 3);
  EXPECT_GT(by["full"]["gathered_layer"].get<int64_t>(), 0);
  EXPECT_GT(by["gradients"]["peak_bytes"].get<int64_t>(), by["full"]["peak_bytes"].get<int64_t>());

  auto table = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --nproc 2", 120);
  EXPECT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("per rank of 2"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("(configured)"), std::string::npos) << table.output;
  auto bad = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --nproc 0", 120);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--nproc 0 must be at least 1"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace memtune::testing
