// llm_int8_skip_modules (models/skip_modules.h): which modules a quantized model keeps dense.
// The matching against transformers' own should_convert_module: its answers for 28 pattern
// lists over 10 module names, in tests/reference/transformers_skip_modules.json (written by
// transformers 5.12 through scripts/interop/check.py, group skip, which checks the table
// again on every run). Loading, saving and reading back a model whose projections are part
// 4-bit, part dense, against the dense checkpoint's own bytes and a whole-model quantization.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/hf_model.h"
#include "models/registry.h"
#include "models/skip_modules.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(SkipModules, MatchesAsTransformersShouldConvertModule) {
  const json table = json::parse(read_file(source_dir() / "tests/reference/transformers_skip_modules.json"));
  const std::vector<std::string> names = table["names"];
  int answers = 0, dense = 0;
  for (const json& c : table["cases"]) {
    const std::vector<std::string> patterns = c["patterns"];
    const models::SkipMatcher m(patterns, "test");
    for (size_t i = 0; i < names.size(); ++i) {
      EXPECT_EQ(m.keeps_dense(names[i]), c["dense"][i].get<bool>()) << c["patterns"].dump() << " on " << names[i];
      dense += c["dense"][i].get<bool>();
      ++answers;
    }
  }
  EXPECT_EQ(answers, 280);
  EXPECT_GT(dense, 40);  // both answers are well represented
  EXPECT_LT(dense, 240);
  // Unset is transformers' default: nothing memtune quantizes stays dense.
  EXPECT_FALSE(models::SkipMatcher(std::nullopt, "test").keeps_dense("model.layers.0.mlp.down_proj"));
}

models::ModelSpec twelve_layers() {
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.num_layers = 12;
  return spec;
}

int layer_of(const std::string& name) {  // "model.layers.10.mlp.down_proj" -> 10
  const std::string p = "model.layers.";
  return name.rfind(p, 0) == 0 ? std::stoi(name.substr(p.size())) : -1;
}

TEST(SkipModules, APrefixAlsoReachesTheLayersItBegins) {
  auto model = models::build_model(twelve_layers());
  const std::vector<bool> dense = models::dense_projections(*model, std::vector<std::string>{"lm_head", "model.layers.1"}, "t");
  ASSERT_EQ(dense.size(), model->tensors().size());
  int n = 0;
  for (size_t k = 0; k < dense.size(); ++k) {
    const models::TensorSlot& t = model->tensors()[k];
    const bool projection = t.role == models::TensorRole::kLinearWeight;
    const int layer = projection ? layer_of(t.linear->name()) : -1;
    EXPECT_EQ(dense[k], projection && (layer == 1 || layer == 10 || layer == 11)) << t.name;
    n += dense[k];
  }
  EXPECT_EQ(n, 3 * 7);  // seven projections in each of layers 1, 10 and 11
}

TEST(SkipModules, AListNamesTheOutputLayerAndIsAValidRegex) {
  auto model = models::build_model(twelve_layers());
  const std::string e = error_of([&] { models::check_skip_modules(*model, {"mlp", "down_proj"}, "where.key"); });
  EXPECT_NE(e.find("where.key: ['mlp', 'down_proj'] does not name lm_head"), std::string::npos) << e;
  EXPECT_NE(e.find("Hint: add 'lm_head'"), std::string::npos) << e;
  // "head" names it (lm_head ends with it); an entry that reaches nothing is returned.
  EXPECT_EQ(models::check_skip_modules(*model, {"head", "vision_tower", "o_proj", "mlp"}, "k"),
            (std::vector<std::string>{"vision_tower", "mlp"}));
  const std::string bad = error_of([&] { models::check_skip_modules(*model, {"lm_head", "layers.(1"}, "where.key"); });
  EXPECT_NE(bad.find("where.key: 'layers.(1' is not a valid regular expression"), std::string::npos) << bad;
}

// A dense checkpoint loaded with load_in_4bit / load_in_8bit and a list: the listed
// projections hold the checkpoint's bytes, the others what quantizing the whole model gives.
// Written back in 4 bits, config.json lists the dense ones, and the model reads back as it
// was, whatever the caller then asks; a config.json whose list disagrees with the tensors is
// refused by name.
TEST(SkipModulesLoad, ListedProjectionsStayDenseAndReadBackFromTheWrittenList) {
  const models::ModelSpec spec = *models::preset("tiny-llama");
  const fs::path d = temp_dir("skip-modules");
  models::save_hf_model(*models::init_random_model(spec, 4), d / "dense", {});
  auto dense = models::load_hf_model(d / "dense", {});
  models::LoadOptions o4;
  o4.load_in_4bit = true;
  o4.quant_type = QuantType::kNF4;
  auto whole = models::load_hf_model(d / "dense", o4);
  o4.skip_modules = std::vector<std::string>{"lm_head", "model.layers.1.mlp"};
  auto mixed = models::load_hf_model(d / "dense", o4);
  std::vector<std::string> kept;
  for (size_t k = 0; k < mixed->linears().size(); ++k) {
    const models::Linear* l = mixed->linears()[k];
    if (l->name().rfind("model.layers.1.mlp.", 0) == 0) {
      ASSERT_FALSE(l->quantized()) << l->name();
      EXPECT_TRUE(same_bits(l->weight, dense->linears()[k]->weight)) << l->name();
      kept.push_back(l->name());
    } else {
      ASSERT_TRUE(l->quantized()) << l->name();
      EXPECT_TRUE(at::equal(l->dense_weight(), whole->linears()[k]->dense_weight())) << l->name();
    }
  }
  ASSERT_EQ(kept.size(), 3u);  // gate, up, down
  EXPECT_LT(mixed->base_storage_bytes(), dense->base_storage_bytes());
  EXPECT_GT(mixed->base_storage_bytes(), whole->base_storage_bytes());

  models::save_hf_model(*mixed, d / "mixed", {});
  const json config = json::parse(read_file(d / "mixed/config.json"));
  json list = json::array({"lm_head"});
  for (const auto& k : kept) list.push_back(k);
  EXPECT_EQ(config["quantization_config"]["llm_int8_skip_modules"], list) << config.dump();
  models::LoadOptions other;  // a stored model's own list decides, not the caller's
  other.load_in_4bit = true;
  other.skip_modules = std::vector<std::string>{"lm_head"};
  for (const models::LoadOptions& o : {models::LoadOptions{}, other}) {
    auto back = models::load_hf_model(d / "mixed", o);
    for (size_t k = 0; k < back->linears().size(); ++k) {
      const models::Linear* a = mixed->linears()[k];
      const models::Linear* b = back->linears()[k];
      ASSERT_EQ(a->quantized(), b->quantized()) << b->name();
      EXPECT_TRUE(same_bits(a->dense_weight(), b->dense_weight())) << b->name();
    }
  }

  // config.json that does not list the dense projections, or lists a quantized one.
  auto with_list = [&](const json& l) {
    json c = config;
    c["quantization_config"]["llm_int8_skip_modules"] = l;
    write_file(d / "mixed/config.json", c.dump(2));
    return error_of([&] { models::load_hf_model(d / "mixed", {}); });
  };
  std::string e = with_list(nullptr);
  EXPECT_NE(e.find("3 projections are stored dense though its llm_int8_skip_modules (unset: transformers' default, "
                   "the output layer) does not keep them dense: 'model.layers.1.mlp.gate_proj' and 2 more"),
            std::string::npos) << e;
  e = with_list(json::array({"lm_head", "model.layers.1.mlp", "o_proj"}));
  EXPECT_NE(e.find("llm_int8_skip_modules keeps 'model.layers.0.self_attn.o_proj' dense (entry 'o_proj'), and the "
                   "checkpoint stores it quantized"),
            std::string::npos) << e;
  e = with_list("lm_head");
  EXPECT_NE(e.find("quantization_config.llm_int8_skip_modules is \"lm_head\"; bitsandbytes reads a list"),
            std::string::npos) << e;
  EXPECT_EQ(with_list(json::array({"lm_head", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up",
                                      "model\\.layers\\.1\\.mlp\\.d"})),
            "");  // any list that selects exactly the dense ones reads
  remove_tree(d);
}

TEST(SkipModulesLoad, EightBitAndShardedLoadsKeepTheListedProjectionsDense) {
  const models::ModelSpec spec = *models::preset("tiny-gpt2");
  const fs::path d = temp_dir("skip-modules-8");
  models::save_hf_model(*models::init_random_model(spec, 5), d / "dense", {});
  auto dense = models::load_hf_model(d / "dense", {});
  models::LoadOptions o8;
  o8.load_in_8bit = true;
  o8.skip_modules = std::vector<std::string>{"lm_head", "c_attn"};
  auto m8 = models::load_hf_model(d / "dense", o8);
  for (size_t k = 0; k < m8->linears().size(); ++k) {
    const models::Linear* l = m8->linears()[k];
    const bool attn = l->name().size() > 6 && l->name().compare(l->name().size() - 6, 6, "c_attn") == 0;
    EXPECT_EQ(l->int8(), !attn) << l->name();
    if (attn) {
      EXPECT_TRUE(same_bits(l->weight, dense->linears()[k]->weight)) << l->name();
    }
  }
  // distributed.sharding full: tensors of other ranks are checked, not read; a listed
  // projection becomes a dense meta tensor, the others 4-bit ones.
  models::LoadOptions o4;
  o4.load_in_4bit = true;
  o4.skip_modules = o8.skip_modules;
  o4.skip = [](const models::CausalLM& m) { return std::vector<bool>(m.tensors().size(), true); };
  auto shard = models::load_hf_model(d / "dense", o4);
  for (const models::Linear* l : shard->linears()) {
    const bool attn = l->name().compare(l->name().size() - 6, 6, "c_attn") == 0;
    EXPECT_EQ(l->quantized(), !attn) << l->name();
    if (attn) {
      EXPECT_TRUE(l->weight.is_meta()) << l->name();
    }
  }
  remove_tree(d);
}

}  // namespace
}  // namespace memtune::testing
