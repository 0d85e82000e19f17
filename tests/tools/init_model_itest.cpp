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

// --arch names the family of the tiny preset: Qwen3's comes with its per-head norms (the
// family's semantics, not only its label). A preset of another family, a family without a
// tiny preset and --arch beside --config are refused by name, and write nothing.
TEST(InitModelArch, AFamilyIsBuiltWithItsOwnSemanticsOrRefused) {
  const fs::path dir = temp_dir();
  auto r = run(memtune_bin() + " init-model --arch qwen3 --out " + (dir / "q").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "q/config.json");
  const json written = json::parse(in);
  EXPECT_EQ(written["model_type"], "qwen3");
  EXPECT_EQ(written["architectures"][0], "Qwen3ForCausalLM");
  const std::string tensors = read_file(dir / "q/model.safetensors");
  EXPECT_NE(tensors.find("model.layers.0.self_attn.q_norm.weight"), std::string::npos);
  EXPECT_NE(tensors.find("model.layers.0.self_attn.k_norm.weight"), std::string::npos);
  // Gemma 3's tiny preset (tiny-gemma3): its four norms a layer, written as transformers names them.
  r = run(memtune_bin() + " init-model --arch gemma3_text --out " + (dir / "g").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream gin(dir / "g/config.json");
  const json gemma = json::parse(gin);
  EXPECT_EQ(gemma["architectures"][0], "Gemma3ForCausalLM");
  EXPECT_TRUE(gemma["query_pre_attn_scalar"].is_number_integer());
  const std::string gemma_tensors = read_file(dir / "g/model.safetensors");
  for (const char* name : {"model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight",
                           "model.layers.3.self_attn.k_norm.weight"})
    EXPECT_NE(gemma_tensors.find(name), std::string::npos) << name;
  // Gemma 2's (tiny-gemma2): its caps written as numbers, its layer types, no q or k norms.
  r = run(memtune_bin() + " init-model --arch gemma2 --out " + (dir / "g2").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream g2in(dir / "g2/config.json");
  const json gemma2 = json::parse(g2in);
  EXPECT_EQ(gemma2["architectures"][0], "Gemma2ForCausalLM");
  EXPECT_DOUBLE_EQ(gemma2["attn_logit_softcapping"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(gemma2["final_logit_softcapping"].get<double>(), 3.0);
  EXPECT_EQ(gemma2["layer_types"][0], "sliding_attention");
  EXPECT_EQ(gemma2["layer_types"][1], "full_attention");
  const std::string gemma2_tensors = read_file(dir / "g2/model.safetensors");
  EXPECT_NE(gemma2_tensors.find("model.layers.0.post_feedforward_layernorm.weight"), std::string::npos);
  EXPECT_EQ(gemma2_tensors.find("self_attn.q_norm"), std::string::npos);
  const std::vector<std::pair<std::string, std::vector<std::string>>> refused = {
      {"--arch Qwen3ForCausalLM --preset tiny-llama", {"--arch Qwen3ForCausalLM", "tiny-llama", "--config"}},
      {"--arch mistral", {"no tiny mistral preset", "mistral-7b", "--config"}},
      {"--arch gemma", {"no tiny gemma preset", "tiny-gemma2", "tiny-gemma3", "--config"}},
      {"--arch gpt2 --preset llama-3.2-1b", {"--arch gpt2", "llama"}},
      {"--arch qwen3 --config " + (dir / "q/config.json").string(), {"excludes"}}};
  for (size_t i = 0; i < refused.size(); ++i) {
    const auto& [args, words] = refused[i];
    const fs::path out = dir / ("refused-" + std::to_string(i));
    r = run(memtune_bin() + " init-model " + args + " --out " + out.string());
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    for (const std::string& w : words) EXPECT_NE(r.output.find(w), std::string::npos) << args << ": " << w << "\n" << r.output;
    EXPECT_FALSE(fs::exists(out)) << args;
  }
}

}  // namespace
}  // namespace memtune::testing

