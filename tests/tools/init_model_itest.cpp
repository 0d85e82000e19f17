// `memtune init-model --config`: a model from any config.json, and clear refusals.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

TEST(InitModelFromConfig, BuildsTheShapesTheConfigSays) {
  const fs::path dir = temp_dir();
  write_file(dir / "config.json",
             json{{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"}, {"vocab_size", 300},
                  {"hidden_size", 48}, {"intermediate_size", 80}, {"num_hidden_layers", 3},
                  {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"sliding_window", 16}}
                 .dump());
  auto r = run(memtune_bin() + " init-model --config " + (dir / "config.json").string() + " --out " +
               (dir / "model").string() + " --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "model/config.json");
  const json written = json::parse(in);
  EXPECT_EQ(written["architectures"][0], "MistralForCausalLM");
  EXPECT_EQ(written["hidden_size"], 48);
  EXPECT_EQ(written["num_hidden_layers"], 3);
  EXPECT_EQ(written["num_key_value_heads"], 2);
  EXPECT_EQ(written["sliding_window"], 16);
  EXPECT_TRUE(fs::exists(dir / "model/model.safetensors"));
}

TEST(InitModelFromConfig, BadInputIsRefusedAndWritesNothing) {
  const fs::path dir = temp_dir();
  write_file(dir / "broken.json", "{\"hidden_size\": 48,");
  auto r = run(memtune_bin() + " init-model --config " + (dir / "broken.json").string() + " --out " +
               (dir / "a").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("broken.json: not valid JSON"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "a"));

  write_file(dir / "missing.json", json{{"model_type", "llama"}, {"hidden_size", 48}}.dump());
  r = run(memtune_bin() + " init-model --config " + (dir / "missing.json").string() + " --out " +
          (dir / "b").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("missing.json"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("vocab_size"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "b"));

  r = run(memtune_bin() + " init-model --config " + (dir / "missing.json").string() +
          " --preset tiny-llama --out " + (dir / "c").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;  // a usage error is bad input
  EXPECT_NE(r.output.find("excludes"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "c"));
}

}  // namespace
}  // namespace memtune::testing

