// PEFT adapter files: what memtune reads must mean what PEFT means, and every field or
// tensor that changes PEFT's math and that memtune does not implement is refused by name.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <regex>
#include <set>

#include "models/hf_model.h"
#include "models/io/safetensors.h"
#include "models/lora.h"
#include "models/model_spec.h"
#include "models/peft.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::models {
namespace {

using memtune::testing::temp_dir;
using memtune::testing::write_file;
using nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kRank = 4;

std::unique_ptr<CausalLM> tiny_llama() { return init_random_model(*preset("tiny-llama"), 3); }

// PEFT's adapter_config.json for LoRA on q_proj, as PEFT 0.17 writes it.
json base_config() {
  return {{"peft_type", "LORA"},         {"task_type", "CAUSAL_LM"}, {"r", kRank},
          {"lora_alpha", 8},             {"lora_dropout", 0.0},      {"target_modules", {"q_proj"}},
          {"bias", "none"},              {"use_rslora", false},      {"use_dora", false},
          {"fan_in_fan_out", false},     {"modules_to_save", nullptr}, {"lora_bias", false},
          {"rank_pattern", json::object()}, {"alpha_pattern", json::object()}, {"layers_to_transform", nullptr}};
}

// lora_A / lora_B of every q_proj of `model`, named as PEFT saves them.
std::vector<std::pair<std::string, at::Tensor>> q_proj_tensors(const CausalLM& model) {
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (Linear* l : model.linears()) {
    if (l->name().find("q_proj") == std::string::npos) continue;
    t.emplace_back(peft_key(l->name(), "lora_A"), at::randn({kRank, l->in_features()}));
    t.emplace_back(peft_key(l->name(), "lora_B"), at::randn({l->out_features(), kRank}));
  }
  return t;
}

fs::path write_adapter(const json& config, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  fs::path dir = temp_dir();
  write_file(dir / "adapter_config.json", config.dump(2));
  save_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  return dir;
}

// Loading must throw a UserError whose message contains every one of `words`.
void expect_refused(const fs::path& dir, const std::vector<std::string>& words) {
  auto model = tiny_llama();
  try {
    load_adapter(*model, dir);
    ADD_FAILURE() << "loaded without a word; expected a refusal naming " << words.front();
  } catch (const UserError& e) {
    for (const auto& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

// The same, on a model of `spec`.
void expect_refused_model(const fs::path& dir, const ModelSpec& spec, const std::vector<std::string>& words) {
  auto model = init_random_model(spec, 1);
  try {
    load_adapter(*model, dir);
    ADD_FAILURE() << "loaded; expected a refusal naming " << words.front();
  } catch (const UserError& e) {
    for (const auto& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

// PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py) for
// the model types memtune builds: what target_modules=None adapts.
TEST(PeftDefaults, TargetModulesByModelTypeArePefts) {
  for (const char* type : {"llama", "mistral", "qwen2", "qwen3"})
    EXPECT_EQ(peft_default_targets(type), (std::vector<std::string>{"q_proj", "v_proj"})) << type;
  EXPECT_EQ(peft_default_targets("gpt2"), std::vector<std::string>{"c_attn"});
  EXPECT_TRUE(peft_default_targets("parallel_block").empty());  // PEFT asks for target_modules
  // On the presets every layer's q and v (Llama) or fused qkv (GPT-2) get an adapter, nothing else.
  for (const char* name : {"tiny-llama", "tiny-gpt2", "tiny-qwen3"}) {
    std::unique_ptr<CausalLM> m = init_random_model(*preset(name), 1);
    LoraTargets t;
    t.target_modules = peft_default_targets(m->spec().model_type);
    LoraOptions o;
    o.r = kRank;
    const LoraSummary s = apply_lora(*m, o, t);
    const size_t per_layer = m->spec().is_gpt2() ? 1 : 2;
    EXPECT_EQ(s.modules.size(), per_layer * static_cast<size_t>(m->spec().num_layers)) << name;
    for (const std::string& module : s.modules) {
      const bool qv = module.size() >= 7 && (module.compare(module.size() - 7, 7, ".q_proj") == 0 ||
                                             module.compare(module.size() - 7, 7, ".v_proj") == 0);
      const bool qkv = module.size() >= 7 && module.compare(module.size() - 7, 7, ".c_attn") == 0;
      EXPECT_TRUE(m->spec().is_gpt2() ? qkv : qv) << name << ": " << module;
    }
  }
}

TEST(PeftAdapter, PlainLoraLoads) {
  auto model = tiny_llama();
  fs::path dir = write_adapter(base_config(), q_proj_tensors(*model));
  LoraSummary s = load_adapter(*model, dir);
  EXPECT_EQ(s.modules.size(), static_cast<size_t>(model->num_layers()));
}

// PEFT saves a module of modules_to_save as "base_model.model.<module>.<param>" (its
// get_peft_model_state_dict drops "modules_to_save.default"), and its loader maps exactly
// that name back; the module's weights replace the base's.
TEST(PeftAdapter, ModulesToSaveLoadAsPeftSavesThem) {
  auto model = tiny_llama();
  json c = base_config();
  c["modules_to_save"] = {"lm_head", "embed_tokens"};
  auto tensors = q_proj_tensors(*model);
  const at::Tensor head = at::randn({1024, 128}), embed = at::randn({1024, 128});
  tensors.emplace_back("base_model.model.lm_head.weight", head);
  tensors.emplace_back("base_model.model.model.embed_tokens.weight", embed);
  LoraSummary s = load_adapter(*model, write_adapter(c, tensors));
  EXPECT_TRUE(at::equal(*model->find_tensor("lm_head.weight")->tensor, head));
  EXPECT_TRUE(at::equal(*model->find_tensor("model.embed_tokens.weight")->tensor, embed));
  EXPECT_TRUE(model->find_tensor("lm_head.weight")->tensor->requires_grad());
  EXPECT_FALSE(model->find_tensor("model.norm.weight")->tensor->requires_grad());
  EXPECT_EQ(s.modules.size(), static_cast<size_t>(model->num_layers()) + 2);
  // PEFT's print_trainable_parameters: the copies train, and count beside the originals.
  int64_t adapters = 0;
  for (Linear* l : model->linears())
    if (l->lora) adapters += kRank * (l->in_features() + l->out_features());
  const int64_t copies = head.numel() + embed.numel();
  EXPECT_EQ(s.trainable_parameters, adapters + copies);
  EXPECT_EQ(s.total_parameters, tiny_llama()->base_parameter_count() + adapters + copies);
}

TEST(PeftAdapter, ModulesToSaveMismatchesAreRefused) {
  auto model = tiny_llama();
  json c = base_config();
  c["modules_to_save"] = {"lm_head"};
  // The field without its tensor: PEFT's loader fails on the missing key.
  expect_refused(write_adapter(c, q_proj_tensors(*model)), {"modules_to_save", "base_model.model.lm_head.weight"});
  // A name PEFT never writes (and could not load).
  auto odd = q_proj_tensors(*model);
  odd.emplace_back("base_model.model.lm_head.modules_to_save.default.weight", at::randn({1024, 128}));
  expect_refused(write_adapter(c, odd), {"lm_head.modules_to_save.default.weight", "base_model.model.lm_head.weight"});
  // A saved module that the config does not list.
  auto extra = q_proj_tensors(*model);
  extra.emplace_back("base_model.model.lm_head.weight", at::randn({1024, 128}));
  expect_refused(write_adapter(base_config(), extra), {"lm_head.weight", "modules_to_save"});
  // The wrong shape.
  auto wrong = q_proj_tensors(*model);
  wrong.emplace_back("base_model.model.lm_head.weight", at::randn({1024, 64}));
  expect_refused(write_adapter(c, wrong), {"lm_head.weight", "shape"});
}

// What memtune does not train as a module_to_save is refused by name (PEFT would train it).
TEST(PeftAdapter, ModulesToSaveOutsideWhatMemtuneTrainsAreRefused) {
  auto model = tiny_llama();
  auto refused = [&](const CausalLM& m, const std::string& entry, const std::string& word) {
    try {
      modules_to_save_tensors(m, {entry}, "lora.modules_to_save");
      ADD_FAILURE() << entry << " accepted; expected a refusal naming " << word;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("lora.modules_to_save: '" + entry + "'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  refused(*model, "q_proj", "projection");
  refused(*model, "norm", "inside decoder layer");  // PEFT's suffix test: every layer's norms too
  refused(*model, "layers.1", "block");
  refused(*model, "score", "selects no module");
  ModelSpec tied = *preset("tiny-llama");
  tied.tie_word_embeddings = true;
  auto tied_model = init_random_model(tied, 1);
  refused(*tied_model, "lm_head", "tie_word_embeddings");
  refused(*tied_model, "embed_tokens", "tie_word_embeddings");
  // What it trains: the embeddings, the final norm named in full, an untied head.
  auto ok = modules_to_save_tensors(*model, {"model.norm", "lm_head", "embed_tokens"}, "x");
  std::vector<std::string> names;
  for (const TensorSlot* s : ok) names.push_back(s->name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}));
  auto gpt2 = init_random_model(*preset("tiny-gpt2"), 1);
  names.clear();
  for (const TensorSlot* s : modules_to_save_tensors(*gpt2, {"wpe", "ln_f"}, "x")) names.push_back(s->name);
  EXPECT_EQ(names, (std::vector<std::string>{"transformer.wpe.weight", "transformer.ln_f.weight",
                                             "transformer.ln_f.bias"}));
}

// Saved as PEFT saves them, and read back to the same weights.
TEST(PeftAdapter, ModulesToSaveAreSavedUnderPeftsNames) {
  auto model = tiny_llama();
  LoraOptions o;
  o.r = kRank;
  LoraTargets t;
  t.target_modules = {"q_proj"};
  apply_lora(*model, o, t);
  EXPECT_EQ(apply_modules_to_save(*model, {"lm_head"}, "lora.modules_to_save"), 1024 * 128);
  {
    at::NoGradGuard g;
    model->find_tensor("lm_head.weight")->tensor->add_(1.0);  // as if trained
  }
  AdapterConfig config;
  config.lora = o;
  config.targets = t;
  config.modules_to_save = {"lm_head"};
  fs::path dir = temp_dir();
  save_adapter(*model, config, dir);
  EXPECT_EQ(json::parse(memtune::testing::read_file(dir / "adapter_config.json"))["modules_to_save"],
            json::array({"lm_head"}));
  SafetensorsFile file(dir / "adapter_model.safetensors");
  const auto names = file.names();
  ASSERT_EQ(std::count(names.begin(), names.end(), "base_model.model.lm_head.weight"), 1);
  EXPECT_TRUE(at::equal(file.load("base_model.model.lm_head.weight"), *model->find_tensor("lm_head.weight")->tensor));
  auto fresh = tiny_llama();
  load_adapter(*fresh, dir);
  EXPECT_TRUE(at::equal(*fresh->find_tensor("lm_head.weight")->tensor, *model->find_tensor("lm_head.weight")->tensor));
}

TEST(PeftAdapter, RefusesLoraOnEmbeddings) {
  auto model = tiny_llama();
  json c = base_config();
  c["target_modules"] = {"q_proj", "embed_tokens"};
  auto tensors = q_proj_tensors(*model);
  // PEFT's Embedding layer: lora_embedding_A [r, vocab], lora_embedding_B [hidden, r], no ".weight".
  tensors.emplace_back("base_model.model.model.embed_tokens.lora_embedding_A", at::randn({kRank, 1024}));
  tensors.emplace_back("base_model.model.model.embed_tokens.lora_embedding_B", at::randn({128, kRank}));
  expect_refused(write_adapter(c, tensors), {"embed_tokens"});
  // The target list alone names it, even where the tensors were stripped.
  expect_refused(write_adapter(c, q_proj_tensors(*model)), {"target_modules", "embed_tokens"});
  // Unless modules_to_save names it: PEFT keeps its targets out of those (the embedding then
  // trains whole and is saved whole), and the adapter loads.
  c["modules_to_save"] = {"embed_tokens"};
  tensors = q_proj_tensors(*model);
  const at::Tensor embedding = at::randn({1024, 128});
  tensors.emplace_back("base_model.model.model.embed_tokens.weight", embedding);
  auto fresh = tiny_llama();
  load_adapter(*fresh, write_adapter(c, tensors));
  EXPECT_TRUE(at::equal(*fresh->find_tensor("model.embed_tokens.weight")->tensor, embedding));
}

TEST(PeftAdapter, RefusesLoraBias) {
  auto model = tiny_llama();
  json c = base_config();
  c["lora_bias"] = true;
  auto tensors = q_proj_tensors(*model);
  Linear* q = model->find_linear("model.layers.0.self_attn.q_proj");
  tensors.emplace_back("base_model.model." + q->name() + ".lora_B.bias", at::randn({q->out_features()}));
  expect_refused(write_adapter(c, tensors), {"lora_bias"});
  // A bias tensor without the flag is not silently skipped either.
  expect_refused(write_adapter(base_config(), tensors), {"lora_B.bias"});
}

// PEFT's bias: all trains every bias (GPT-2: the projections', ln_1/ln_2's and ln_f's: 6 per
// layer and 1), lora_only the adapted projections' (c_attn: 1 per layer); an adapted
// projection's is saved on its base layer. A selection of none is refused in training.
TEST(LoraBias, AllAndLoraOnlySelectPeftsBiases) {
  const ModelSpec spec = *preset("tiny-gpt2");
  const int64_t L = spec.num_layers;
  LoraOptions o;
  o.r = kRank;
  LoraTargets t;
  t.target_modules = {"c_attn"};
  for (const std::string bias : {"all", "lora_only"}) {
    auto model = init_random_model(spec, 1);
    apply_lora(*model, o, t);
    const int64_t n = apply_lora_bias(*model, bias, "lora.bias");
    std::set<std::string> keys;
    int64_t elements = 0;
    for (const TensorSlot& s : model->tensors()) {
      if (!s.tensor->defined() || !s.tensor->requires_grad()) continue;
      EXPECT_EQ(s.tensor->scalar_type(), at::kFloat) << s.name;
      keys.insert(peft_bias_key(s));
      elements += s.tensor->numel();
    }
    EXPECT_EQ(static_cast<int64_t>(keys.size()), bias == "all" ? 6 * L + 1 : L) << bias;
    EXPECT_EQ(n, elements);
    EXPECT_TRUE(keys.count("base_model.model.transformer.h.0.attn.c_attn.base_layer.bias")) << bias;
    EXPECT_EQ(keys.count("base_model.model.transformer.h.0.mlp.c_fc.bias"), bias == "all" ? 1u : 0u);
    EXPECT_EQ(keys.count("base_model.model.transformer.ln_f.bias"), bias == "all" ? 1u : 0u);
  }
  for (const std::string bias : {"all", "lora_only"}) {  // Llama's projections have no biases
    auto model = tiny_llama();
    apply_lora(*model, o, LoraTargets{});
    try {
      apply_lora_bias(*model, bias, "lora.bias");
      ADD_FAILURE() << bias << " accepted on a model without biases";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("lora.bias: '" + bias + "' selects no bias"), std::string::npos) << e.what();
    }
  }
}

// An adapter with bias: all | lora_only loads the biases it selects from PEFT's keys; one
// missing, or a bias the setting does not train, is refused by name.
TEST(PeftAdapter, TrainedBiasesLoadFromPeftsKeysAndNothingElse) {
  const ModelSpec spec = *preset("tiny-gpt2");
  auto base = init_random_model(spec, 1);
  json c = base_config();
  c["target_modules"] = {"c_attn"};
  c["fan_in_fan_out"] = true;
  c["bias"] = "lora_only";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, at::Tensor> biases;
  for (Linear* l : base->linears()) {
    if (l->name().find("c_attn") == std::string::npos) continue;
    tensors.emplace_back(peft_key(l->name(), "lora_A"), at::randn({kRank, l->in_features()}));
    tensors.emplace_back(peft_key(l->name(), "lora_B"), at::randn({l->out_features(), kRank}));
    biases[l->name() + ".bias"] = at::randn({l->out_features()});
    tensors.emplace_back("base_model.model." + l->name() + ".base_layer.bias", biases[l->name() + ".bias"]);
  }
  const fs::path dir = write_adapter(c, tensors);
  auto model = init_random_model(spec, 1);
  load_adapter(*model, dir);
  for (const auto& [name, want] : biases) {
    const at::Tensor& got = *model->find_tensor(name)->tensor;
    EXPECT_TRUE(got.requires_grad()) << name;
    EXPECT_TRUE(at::equal(got.detach(), want)) << name;
  }
  EXPECT_FALSE(model->find_tensor("transformer.h.0.mlp.c_fc.bias")->tensor->requires_grad());
  // One missing; one more than lora_only trains; the same file read as all (c_fc's missing).
  auto missing = tensors;
  missing.pop_back();
  expect_refused_model(write_adapter(c, missing), spec, {"has no tensor", "c_attn.base_layer.bias"});
  auto extra = tensors;
  extra.emplace_back("base_model.model.transformer.h.0.mlp.c_fc.bias", at::randn({spec.intermediate_size}));
  expect_refused_model(write_adapter(c, extra), spec, {"transformer.h.0.mlp.c_fc.bias", "does not train"});
  c["bias"] = "all";
  expect_refused_model(write_adapter(c, tensors), spec, {"bias 'all' trains", "has no tensor"});
  c["bias"] = "none";
  expect_refused_model(write_adapter(c, tensors), spec, {"c_attn.base_layer.bias", "trained base bias", "bias is none"});
}

TEST(PeftAdapter, RefusesEveryFieldThatChangesTheMath) {
  auto model = tiny_llama();
  const std::vector<std::pair<std::string, json>> fields = {
      {"bias", "some"},  // PEFT's are none, all and lora_only (PeftAdapter.TrainedBiases*)
      {"layer_replication", {{0, 2}}},
      {"trainable_token_indices", {1, 2}},
      {"use_qalora", true},
      {"target_parameters", {"mlp.experts.down_proj"}},
      {"alora_invocation_tokens", {5, 6}},
      {"peft_type", "IA3"},
  };
  for (const auto& [key, value] : fields) {
    json c = base_config();
    c[key] = value;
    SCOPED_TRACE(key);
    expect_refused(write_adapter(c, q_proj_tensors(*model)), {key});
  }
}

// rank_pattern / alpha_pattern, as PEFT's get_pattern_key reads them: the first pattern in the
// file's order that matches the module's name as (.*\.)?(pattern)$; a bare suffix that is not
// a dotted part ("proj") matches nothing. Bad values and patterns are refused with the file.
TEST(PeftAdapter, RankAndAlphaPatternsFollowTheFilesOrder) {
  const fs::path root = temp_dir();
  auto config_of = [&](const std::string& patterns) {
    json c = base_config();
    c.erase("rank_pattern");
    c.erase("alpha_pattern");
    std::string text = c.dump();
    text = text.substr(0, text.size() - 1) + "," + patterns + "}";  // the patterns' order as written
    const fs::path d = root / std::to_string(std::hash<std::string>{}(patterns));
    fs::create_directories(d);
    write_file(d / "adapter_config.json", text);
    return d;
  };
  const auto c = read_adapter_config(config_of(
      R"("rank_pattern": {"model.layers.0.self_attn.q_proj": 3, "q_proj": 5, "proj": 7}, "alpha_pattern": {"layers\\.1\\..*": 2.5})"));
  EXPECT_EQ(c.options_for("model.layers.0.self_attn.q_proj").r, 3);
  EXPECT_EQ(c.options_for("model.layers.1.self_attn.q_proj").r, 5);
  EXPECT_EQ(c.options_for("model.layers.1.self_attn.v_proj").r, kRank);
  EXPECT_EQ(c.options_for("model.layers.1.self_attn.v_proj").alpha, 2.5);
  EXPECT_EQ(c.options_for("model.layers.0.self_attn.v_proj").alpha, 8);
  // Written in the other order, the bare q_proj comes first and decides for layer 0 too.
  EXPECT_EQ(read_adapter_config(config_of(R"("rank_pattern": {"q_proj": 5, "model.layers.0.self_attn.q_proj": 3})"))
                .options_for("model.layers.0.self_attn.q_proj").r,
            5);
  for (const auto& [patterns, words] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {R"("rank_pattern": {"q_proj": 0})", {"rank_pattern", "q_proj", "an integer >= 1"}},
           {R"("rank_pattern": {"q_proj": 2.5})", {"rank_pattern", "2.5"}},
           {R"("rank_pattern": {"q_(proj": 2})", {"rank_pattern", "q_(proj", "regular expression"}},
           {R"("alpha_pattern": {"q_proj": -1})", {"alpha_pattern", "number > 0"}},
           {R"("alpha_pattern": [1])", {"alpha_pattern", "must map"}}}) {
    try {
      read_adapter_config(config_of(patterns));
      ADD_FAILURE() << patterns << " was read";
    } catch (const UserError& e) {
      for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("adapter_config.json"), std::string::npos) << e.what();
    }
  }
}

// A tensor memtune does not recognise is an error naming it, never skipped.
// The training config's lora.rank_pattern / alpha_pattern (apply_lora): each adapted module
// takes the rank and alpha of the first pattern, in order, matching its name as
// (.*\.)?(pattern)$, else r and lora_alpha; scaling is its alpha over its rank. The expected
// values are PEFT's rule written out by hand for tiny-llama's module names.
TEST(LoraPatterns, EachModuleTakesTheFirstMatchingPatternsRankAndAlpha) {
  auto model = tiny_llama();
  LoraOptions o;
  o.r = 4;
  o.alpha = 8;
  LoraTargets t;  // all-linear
  LoraPatterns p;
  p.rank = {{"model.layers.1.self_attn.v_proj", 3}, {"v_proj", 2}, {"layers\\.0\\.mlp\\..*", 6}};
  p.alpha = {{"q_proj", 16}, {"o_proj|k_proj", 2}};
  // What each pattern decides, counted by hand over tiny-llama's 4 layers.
  EXPECT_EQ(check_lora_patterns(*model, t, p, "lora"),
            "rank_pattern: model.layers.1.self_attn.v_proj -> 3 (1 module), v_proj -> 2 (3 modules), "
            "layers\\.0\\.mlp\\..* -> 6 (3 modules); alpha_pattern: q_proj -> 16 (4 modules), o_proj|k_proj -> 2 "
            "(8 modules)");
  const LoraSummary s = apply_lora(*model, o, t, p);
  auto ends = [](const std::string& n, const std::string& tail) {
    return n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
  };
  int64_t parameters = 0, checked = 0;
  for (Linear* l : model->linears()) {
    const std::string& n = l->name();
    if (!l->lora) continue;
    const int64_t r = n == "model.layers.1.self_attn.v_proj" ? 3
                      : ends(n, ".v_proj")                    ? 2
                      : n.rfind("model.layers.0.mlp.", 0) == 0 ? 6
                                                               : 4;
    const double alpha = ends(n, ".q_proj") ? 16 : ends(n, ".o_proj") || ends(n, ".k_proj") ? 2 : 8;
    EXPECT_EQ(l->lora->A.size(0), r) << n;
    EXPECT_EQ(l->lora->B.size(1), r) << n;
    EXPECT_DOUBLE_EQ(l->lora->scaling, alpha / static_cast<double>(r)) << n;
    parameters += r * (l->in_features() + l->out_features());
    ++checked;
  }
  EXPECT_EQ(checked, 28);  // 7 projections in each of tiny-llama's 4 layers
  EXPECT_EQ(s.trainable_parameters, parameters);
  // rslora's scaling takes each module's own rank.
  auto rs = tiny_llama();
  o.use_rslora = true;
  apply_lora(*rs, o, t, p);
  EXPECT_DOUBLE_EQ(rs->find_linear("model.layers.0.self_attn.v_proj")->lora->scaling, 8 / std::sqrt(2.0));
}

// A pattern that would change nothing is refused (PEFT ignores it): one that matches no
// adapted module, and one that only matches modules an earlier pattern decides.
TEST(LoraPatterns, APatternThatDecidesNoModuleIsRefused) {
  auto model = tiny_llama();
  LoraTargets q;
  q.target_modules = {"q_proj"};
  const std::vector<std::tuple<LoraTargets, LoraPatterns, std::vector<std::string>>> cases = {
      {LoraTargets{}, LoraPatterns{{{"proj", 2}}, {}}, {"lora.rank_pattern: 'proj' matches none of the 28 adapted"}},
      {q, LoraPatterns{{{"down_proj", 2}}, {}}, {"'down_proj' matches none", "selects q_proj"}},
      {LoraTargets{}, LoraPatterns{{}, {{"v_proj", 2}, {"layers\\.1\\.self_attn\\.v_proj", 3}}},
       {"lora.alpha_pattern: 'layers\\.1\\.self_attn\\.v_proj' decides no module", "earlier pattern ('v_proj')"}},
      {LoraTargets{}, LoraPatterns{{{"q_(proj", 2}}, {}}, {"lora.rank_pattern: pattern 'q_(proj'", "regular expression"}}};
  for (const auto& [targets, patterns, words] : cases) {
    try {
      check_lora_patterns(*model, targets, patterns, "lora");
      ADD_FAILURE() << "accepted; expected " << words.front();
    } catch (const UserError& e) {
      for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
    }
  }
}

TEST(PeftAdapter, RefusesUnknownTensors) {
  auto model = tiny_llama();
  auto tensors = q_proj_tensors(*model);
  tensors.emplace_back("base_model.model.model.layers.0.self_attn.q_proj.hada_w1_a", at::randn({128}));
  expect_refused(write_adapter(base_config(), tensors), {"hada_w1_a"});
}

// ---- writing: target_modules as PEFT will read it back ----

// The modules that carry lora_A tensors in a written adapter file.
std::set<std::string> modules_in_file(const fs::path& dir) {
  std::set<std::string> modules;
  SafetensorsFile file(dir / "adapter_model.safetensors");
  const std::string prefix = "base_model.model.", tail = ".lora_A.weight";
  for (const auto& key : file.names())
    if (key.size() > tail.size() && key.compare(key.size() - tail.size(), tail.size(), tail) == 0)
      modules.insert(key.substr(prefix.size(), key.size() - prefix.size() - tail.size()));
  return modules;
}

json saved_target_modules(const LoraTargets& targets, fs::path* dir_out = nullptr) {
  auto model = tiny_llama();
  LoraOptions o;
  o.r = kRank;
  apply_lora(*model, o, targets);
  AdapterConfig config;
  config.lora = o;
  config.targets = targets;
  fs::path dir = temp_dir(std::to_string(targets.layers_to_transform.size()) + targets.target_modules[0].substr(0, 3));
  save_adapter(*model, config, dir);
  if (dir_out) *dir_out = dir;
  return json::parse(memtune::testing::read_file(dir / "adapter_config.json"))["target_modules"];
}

// PEFT refuses a str target_modules with layers_to_transform ("`layers_to_transform` cannot
// be used when `target_modules` is a str"): the names of the adapted modules are written.
TEST(PeftAdapter, StringTargetsWithLayersAreWrittenAsTheAdaptedModules) {
  for (const std::string& target : {std::string("all-linear"), std::string(".*\\.(q_proj|down_proj)")}) {
    SCOPED_TRACE(target);
    LoraTargets t;
    t.target_modules = {target};
    t.layers_to_transform = {1, 3};
    fs::path dir;
    json written = saved_target_modules(t, &dir);
    ASSERT_TRUE(written.is_array()) << written.dump();
    std::set<std::string> listed(written.begin(), written.end());
    EXPECT_EQ(listed.size(), written.size()) << "duplicates in " << written.dump();
    EXPECT_EQ(listed, modules_in_file(dir));
    EXPECT_FALSE(listed.empty());
    for (const auto& m : listed)
      EXPECT_TRUE(m.find("layers.1.") != std::string::npos || m.find("layers.3.") != std::string::npos) << m;
    // memtune reads it back to the same modules.
    auto model = tiny_llama();
    LoraSummary s = load_adapter(*model, dir);
    EXPECT_EQ(std::set<std::string>(s.modules.begin(), s.modules.end()), listed);
  }
}

// Without layers_to_transform a str is what PEFT expects for all-linear and a regex; one
// plain name stays a list (PEFT would read the str "q_proj" as a regex matching nothing).
TEST(PeftAdapter, TargetModulesKeepPeftsMeaning) {
  LoraTargets all;
  EXPECT_EQ(saved_target_modules(all), json("all-linear"));
  LoraTargets regex;
  regex.target_modules = {".*\\.q_proj"};
  EXPECT_EQ(saved_target_modules(regex), json(".*\\.q_proj"));
  LoraTargets one;
  one.target_modules = {"q_proj"};
  EXPECT_EQ(saved_target_modules(one), json::array({"q_proj"}));
}

// PEFT's check_target_module_exists (peft/tuners/tuners_utils.py, 0.16 and later), restated:
// an excluded module first (a str exclude_modules matched in full as a regex, a list's entries
// exactly or as a dotted suffix), then anything in or under a modules_to_save module, then
// target_modules the same way, where layers_to_transform filters the suffix matches alone (a
// module named in full is taken in any layer) by the index after a dotted name.
bool peft_adapts(const json& config, const std::string& key) {
  auto matches = [&](const json& v) {
    if (v.is_null()) return false;
    if (v.is_string()) return std::regex_match(key, std::regex(v.get<std::string>()));
    for (const auto& e : v) {
      const std::string name = e.get<std::string>();
      if (key == name || (key.size() > name.size() && key.compare(key.size() - name.size(), name.size(), name) == 0 &&
                          key[key.size() - name.size() - 1] == '.'))
        return true;
    }
    return false;
  };
  if (matches(config["exclude_modules"])) return false;
  if (config.contains("modules_to_save") && !config["modules_to_save"].is_null())
    for (const auto& m : config["modules_to_save"])
      if (std::regex_match(key, std::regex("(^|.*\\.)" + m.get<std::string>() + "($|\\..*)"))) return false;
  const json& target = config["target_modules"];
  if (target.is_array() && std::find(target.begin(), target.end(), key) != target.end()) return true;
  const bool found = target == "all-linear" ? key.find("lm_head") == std::string::npos : matches(target);
  if (!found || !config.contains("layers_to_transform") || config["layers_to_transform"].is_null()) return found;
  std::smatch index;
  if (!std::regex_search(key, index, std::regex("^.*\\.[^.]*\\.(\\d+)\\."))) return false;
  const int layer = std::stoi(index[1]);
  for (const auto& l : config["layers_to_transform"])
    if (l.get<int>() == layer) return true;
  return false;
}

// Written exclude_modules mean to PEFT what they meant to memtune: reading the config, PEFT
// adapts exactly the modules whose tensors the file holds. A regex is written as a str (in a
// list PEFT would compare it with module names, excluding nothing).
TEST(PeftAdapter, ExcludeModulesKeepPeftsMeaning) {
  for (const auto& exclude : {std::vector<std::string>{".*mlp.*"}, std::vector<std::string>{"down_proj"},
                              std::vector<std::string>{"down_proj", "q_proj"},
                              std::vector<std::string>{"model.layers.0.self_attn.k_proj"}}) {
    SCOPED_TRACE(exclude[0]);
    LoraTargets t;
    t.target_modules = {"all-linear"};
    t.exclude_modules = exclude;
    fs::path dir;
    saved_target_modules(t, &dir);
    const json config = json::parse(memtune::testing::read_file(dir / "adapter_config.json"));
    EXPECT_EQ(config["exclude_modules"].is_string(), exclude[0] == ".*mlp.*") << config["exclude_modules"].dump();
    const std::set<std::string> in_file = modules_in_file(dir);
    auto model = tiny_llama();
    std::set<std::string> by_peft;
    for (Linear* l : model->linears())
      if (peft_adapts(config, l->name())) by_peft.insert(l->name());
    EXPECT_EQ(by_peft, in_file);
    EXPECT_LT(in_file.size(), model->linears().size());  // something was excluded
  }
}

// transformers' Qwen3ForCausalLM's module names (model.named_modules(), the root aside) for
// `layers` decoder layers, and whether each is an nn.Linear.
std::vector<std::pair<std::string, bool>> qwen3_modules(int layers) {
  std::vector<std::pair<std::string, bool>> m = {{"model", false}, {"model.embed_tokens", false}, {"model.layers", false}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    for (const auto& [name, linear] : std::vector<std::pair<std::string, bool>>{
             {"", false}, {".self_attn", false}, {".self_attn.q_proj", true}, {".self_attn.k_proj", true},
             {".self_attn.v_proj", true}, {".self_attn.o_proj", true}, {".self_attn.q_norm", false},
             {".self_attn.k_norm", false}, {".mlp", false}, {".mlp.gate_proj", true}, {".mlp.up_proj", true},
             {".mlp.down_proj", true}, {".mlp.act_fn", false}, {".input_layernorm", false},
             {".post_attention_layernorm", false}})
      m.emplace_back(p + name, linear);
  }
  for (const char* name : {"model.norm", "model.rotary_emb"}) m.emplace_back(name, false);
  m.emplace_back("lm_head", true);  // a Linear PEFT would adapt; memtune does not
  return m;
}

// Targets that select any module but a decoder layer's projection stop apply_lora, by the
// module's name, where PEFT stops too (a norm, a block: "Target module ... is not supported")
// or would adapt what memtune does not (the embedding, lm_head); targets PEFT would apply to
// projections alone are taken. Whether PEFT selects something else is PEFT's own check over
// transformers' module names, restated above.
TEST(LoraTargets, AnythingButAProjectionIsRefusedWherePeftWouldNotAdaptTheSame) {
  const ModelSpec spec = *preset("tiny-qwen3");
  const auto hf_modules = qwen3_modules(static_cast<int>(spec.num_layers));
  // target_modules, and the other keys of the config (exclude_modules, modules_to_save,
  // layers_to_transform).
  const std::vector<std::pair<json, json>> cases = {
      {".*q_.*", {}},
      {".*\\.(q|k|v|o)_proj", {}},
      {json::array({"q_proj", "norm"}), {}},
      {json::array({"q_proj", "self_attn"}), {}},
      {json::array({"q_proj", "lm_head"}), {}},
      {json::array({"embed_tokens", "v_proj"}), {}},
      {json::array({"q_proj", "k_norm"}), {}},
      {".*mlp\\..*", {}},  // the activation (act_fn) holds no weights
      {".*q_.*", {{"exclude_modules", ".*norm"}}},
      {json::array({"q_proj", "v_proj", "down_proj"}), {}},
      // modules_to_save keeps PEFT's targets out of its modules.
      {json::array({"v_proj", "embed_tokens"}), {{"modules_to_save", {"embed_tokens"}}}},
      // layers_to_transform filters suffix matches; a module named in full is taken anyway.
      {json::array({"q_proj", "lm_head"}), {{"layers_to_transform", {0}}}},
      {json::array({"model.layers.1.self_attn.q_proj", "v_proj"}), {{"layers_to_transform", {0}}}}};
  int refused = 0;
  for (const auto& [target, rest] : cases) {
    SCOPED_TRACE(target.dump() + " with " + rest.dump());
    json config = rest;
    config["target_modules"] = target;
    if (!config.contains("exclude_modules")) config["exclude_modules"] = nullptr;
    std::string other;  // the first module PEFT selects that is not a decoder layer's projection
    for (const auto& [name, linear] : hf_modules)
      if (peft_adapts(config, name) && (!linear || name == "lm_head") && other.empty()) other = name;
    LoraTargets t;
    t.target_modules = target.is_string() ? std::vector<std::string>{target.get<std::string>()}
                                          : target.get<std::vector<std::string>>();
    if (rest.contains("exclude_modules")) t.exclude_modules = {rest["exclude_modules"].get<std::string>()};
    if (rest.contains("modules_to_save")) t.modules_to_save = rest["modules_to_save"].get<std::vector<std::string>>();
    if (rest.contains("layers_to_transform")) t.layers_to_transform = rest["layers_to_transform"].get<std::vector<int>>();
    LoraOptions o;
    o.r = kRank;
    std::unique_ptr<CausalLM> model = init_random_model(spec, 1);
    try {
      const LoraSummary s = apply_lora(*model, o, t);
      EXPECT_EQ(other, "") << "applied, where PEFT selects " << other;
      std::set<std::string> by_peft;
      for (const auto& [name, linear] : hf_modules)
        if (linear && peft_adapts(config, name)) by_peft.insert(name);
      EXPECT_EQ(std::set<std::string>(s.modules.begin(), s.modules.end()), by_peft);
    } catch (const UserError& e) {
      ++refused;
      EXPECT_NE(other, "") << "refused what PEFT adapts as memtune would: " << e.what();
      EXPECT_NE(std::string(e.what()).find("lora.target_modules"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(refused, 8);
}

}  // namespace
}  // namespace memtune::models

namespace memtune::testing {
namespace {

std::string adapter_config_error(const std::string& text) {
  const fs::path dir = temp_dir();
  write_file(dir / "adapter_config.json", text);
  try {
    models::read_adapter_config(dir);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Found by fuzz/adapter_config_fuzz.cpp (fuzz/regressions/adapter_config-*): JSON that is not
// an object, or a key of the wrong type before `r`, escaped as nlohmann's type_error (exit 1).
TEST(AdapterConfig, WrongTypesAreRefusedWithTheFile) {
  for (const std::string text : {"0", "[]", "\"LORA\"", R"({"peft_type": 5, "r": 8, "target_modules": "q_proj"})",
                                 R"({"bias": [], "r": 8, "target_modules": "q_proj"})",
                                 R"({"use_dora": "no", "r": 8, "target_modules": "q_proj"})",
                                 R"({"r": "8", "target_modules": "q_proj"})",
                                 R"({"r": 8, "target_modules": "q_proj", "rank_pattern": 3})"}) {
    const std::string e = adapter_config_error(text);
    EXPECT_NE(e.find("adapter_config.json"), std::string::npos) << text << " -> '" << e << "'";
  }
  EXPECT_EQ(adapter_config_error(R"({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]})"), "");
  // Found by the adapter_config target after the embedding check landed (fuzz/regressions/
  // adapter_config-943eacd3f08b): a target_modules string that is no regex threw std::regex_error.
  const std::string e = adapter_config_error(R"({"r": 8, "target_modules": "q_proj(("})");
  EXPECT_NE(e.find("target_modules 'q_proj((' is not a valid regular expression"), std::string::npos) << e;
  // And (fuzz/regressions/adapter_config-2bf6c953259d) an r past int64's range, a float that
  // nlohmann converted with undefined behaviour; layer indices likewise.
  for (const std::string text : {R"({"r": 4444444444444444444444444444444, "target_modules": ["q_proj"]})",
                                 R"({"r": 8.5, "target_modules": ["q_proj"]})",
                                 R"({"r": 8, "target_modules": ["q_proj"], "layers_to_transform": [1e30]})",
                                 R"({"r": 8, "target_modules": ["q_proj"], "layers_to_transform": -1})"})
    EXPECT_NE(adapter_config_error(text).find("adapter_config.json"), std::string::npos) << text;
}

}  // namespace
}  // namespace memtune::testing
