// The YAML config: the forms users write, strict errors (key path, line:column, value, hint),
// overrides, the round trip through to_yaml, help, and every YAML file under configs/.
// Expected line:column positions are counted in the YAML text itself (at() below), not taken
// from the parser.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <functional>
#include <set>

#include "models/layers/attention.h"
#include "runtime/compat.h"
#include "runtime/error.h"
#include "test_util.h"
#include "trainer/best_model.h"
#include "trainer/config.h"
#include "trainer/model_setup.h"
#include "models/model_spec.h"

namespace {

using memtune::SizeSpec;
using memtune::trainer::Config;
using memtune::trainer::parse_config;
using memtune::trainer::TrainingConfig;
namespace fs = std::filesystem;

// "bad.yaml:LINE:COL" of `token`, searched from the first occurrence of `needle` (1-based).
std::string at(const std::string& yaml, const std::string& needle, const std::string& token) {
  size_t pos = yaml.find(needle);
  EXPECT_NE(pos, std::string::npos) << needle;
  pos = yaml.find(token, pos);
  EXPECT_NE(pos, std::string::npos) << token;
  size_t line = 1 + std::count(yaml.begin(), yaml.begin() + pos, '\n');
  size_t line_start = yaml.rfind('\n', pos);
  size_t col = pos - (line_start == std::string::npos ? 0 : line_start + 1) + 1;
  return "bad.yaml:" + std::to_string(line) + ":" + std::to_string(col);
}

std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(yaml, "bad.yaml", overrides);
  } catch (const memtune::UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted:\n" << yaml;
  return "";
}

#define EXPECT_HAS(text, part) \
  EXPECT_NE((text).find(part), std::string::npos) << "expected '" << (part) << "' in: " << (text)

// The value at `needle`/`token` is refused: "bad.yaml:L:C: key: invalid value 'value': reason".
std::string expect_invalid(const std::string& yaml, const std::string& needle, const std::string& token,
                           const std::string& key, const std::string& value, const std::string& reason) {
  std::string e = error_of(yaml);
  EXPECT_HAS(e, at(yaml, needle, token) + ": " + key + ": invalid value '" + value + "': ");
  EXPECT_HAS(e, reason);
  return e;
}

// A wrong type: "bad.yaml:L:C: key: expected type, got 'value'".
void expect_wrong_type(const std::string& yaml, const std::string& needle, const std::string& token,
                       const std::string& key, const std::string& type, const std::string& value) {
  std::string e = error_of(yaml);
  EXPECT_HAS(e, at(yaml, needle, token) + ": " + key + ": expected " + type + ", got '" + value + "'");
}

Config parse(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return parse_config(yaml, "test.yaml", overrides);
}

// ---- The config users know ----

TEST(Config, MemoryOptimizedYamlFromTheIssueParses) {
  auto c = memtune::trainer::load_config(memtune::testing::source_dir() / "tests/trainer/fixtures/memory_optimized.yaml");
  EXPECT_TRUE(c.model.quantization_config.load_in_4bit);
  EXPECT_EQ(c.model.quantization_config.bnb_4bit_compute_dtype, "float16");
  EXPECT_EQ(c.model.quantization_config.bnb_4bit_quant_type, "nf4");
  EXPECT_TRUE(c.model.quantization_config.bnb_4bit_use_double_quant);
  EXPECT_EQ(c.model.device_map.single, "auto");
  EXPECT_TRUE(c.model.device_map.entries.empty());
  EXPECT_TRUE(c.model.low_cpu_mem_usage);
  EXPECT_EQ(c.training.per_device_train_batch_size, 1);
  EXPECT_EQ(c.training.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.training.gradient_checkpointing.policy, "all");
  EXPECT_TRUE(c.training.fp16);
  EXPECT_FALSE(c.training.bf16);
  EXPECT_FALSE(c.training.dataloader_pin_memory);
  EXPECT_EQ(c.training.dataloader_num_workers, 0);
  EXPECT_FALSE(c.training.remove_unused_columns);
  EXPECT_EQ(c.data.max_seq_length, 1024);
  EXPECT_TRUE(c.data.pack_sequences);
  EXPECT_HAS(c.source, "memory_optimized.yaml");
}

TEST(Config, EmptyTextAndEmptySectionsGiveDefaults) {
  EXPECT_TRUE(parse("") == Config());
  EXPECT_TRUE(parse("lora:\ntraining:\n") == Config());
}

// A key left out means what it means in the library it is named after. The values below are
// those libraries' own defaults, read from transformers 5.12.1 (TrainingArguments(output_dir=...)
// and BitsAndBytesConfig(load_in_4bit=True) printed in the Debian root of scripts/interop_check.sh)
// and from PEFT's LoraConfig dataclass (peft/tuners/lora/config.py).
TEST(Config, KeysLeftOutTakeTheLibrariesDefaults) {
  const Config c = parse("");
  // PEFT's LoraConfig: r 8, lora_alpha 8, lora_dropout 0.0, target_modules None (the model
  // type's default, resolved when the model is known), use_rslora False, bias "none".
  EXPECT_EQ(c.lora.r, 8);
  EXPECT_DOUBLE_EQ(c.lora.lora_alpha, 8);
  EXPECT_DOUBLE_EQ(c.lora.lora_dropout, 0);
  EXPECT_TRUE(c.lora.target_modules.empty());
  EXPECT_FALSE(c.lora.use_rslora);
  EXPECT_EQ(c.lora.bias, "none");
  // BitsAndBytesConfig: FP4 codes, compute dtype float32, no double quantization, uint8 storage.
  const auto& q = c.model.quantization_config;
  EXPECT_FALSE(q.load_in_4bit);
  EXPECT_EQ(q.bnb_4bit_quant_type, "fp4");
  EXPECT_EQ(q.bnb_4bit_compute_dtype, "float32");
  EXPECT_FALSE(q.bnb_4bit_use_double_quant);
  EXPECT_EQ(q.bnb_4bit_quant_storage, "uint8");
  // TrainingArguments.
  const auto& t = c.training;
  EXPECT_EQ(t.per_device_train_batch_size, 8);
  EXPECT_EQ(t.per_device_eval_batch_size, 8);
  EXPECT_EQ(t.gradient_accumulation_steps, 1);
  EXPECT_DOUBLE_EQ(t.learning_rate, 5e-5);
  EXPECT_DOUBLE_EQ(t.num_train_epochs, 3.0);
  EXPECT_EQ(t.max_steps, -1);
  EXPECT_EQ(t.lr_scheduler_type, "linear");
  EXPECT_EQ(t.warmup_steps, 0);
  EXPECT_DOUBLE_EQ(t.weight_decay, 0);
  EXPECT_DOUBLE_EQ(t.adam_beta1, 0.9);
  EXPECT_DOUBLE_EQ(t.adam_beta2, 0.999);
  EXPECT_DOUBLE_EQ(t.adam_epsilon, 1e-8);
  EXPECT_DOUBLE_EQ(t.max_grad_norm, 1.0);
  EXPECT_EQ(t.seed, 42u);
  EXPECT_FALSE(t.fp16);
  EXPECT_FALSE(t.bf16);
  EXPECT_EQ(t.gradient_checkpointing.policy, "none");
  // transformers 5's default optimizer, torch's fused AdamW, is the same update as adamw_torch.
  EXPECT_EQ(parse("training: {optim: adamw_torch_fused}").training.optim, "adamw_torch_fused");
}

TEST(Config, SpecialFormsFixture) {
  auto c = memtune::trainer::load_config(memtune::testing::source_dir() / "tests/trainer/fixtures/special_forms.yaml");
  EXPECT_EQ(c.model.torch_dtype, "float32");
  EXPECT_EQ(c.model.quantization_config.bnb_4bit_compute_dtype, "bfloat16");
  ASSERT_EQ(c.model.device_map.entries.size(), 4u);
  EXPECT_EQ(c.model.device_map.entries[0], std::make_pair(std::string("model.embed_tokens"), std::string("cuda:0")));
  EXPECT_EQ(c.model.device_map.entries[3], std::make_pair(std::string("lm_head"), std::string("offload")));
  EXPECT_EQ(c.model.max_memory.at("cuda:0").bytes, 20LL << 30);
  EXPECT_DOUBLE_EQ(c.model.max_memory.at("cpu").fraction, 0.5);
  EXPECT_EQ(c.lora.target_modules, (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(c.lora.rank_pattern,
            (std::vector<std::pair<std::string, int64_t>>{{"model\\.layers\\.0\\..*", 4}, {"q_proj", 32}}));
  EXPECT_EQ(c.lora.alpha_pattern, (std::vector<std::pair<std::string, double>>{{"q_proj", 64}}));
  EXPECT_EQ(c.training.per_device_train_batch_size, TrainingConfig::kAuto);
  EXPECT_EQ(c.training.gradient_checkpointing.policy, "every_n");
  EXPECT_EQ(c.training.gradient_checkpointing.n, 2);
  EXPECT_DOUBLE_EQ(c.training.learning_rate, 1e-4);
  EXPECT_EQ(c.training.resume_from_checkpoint, "latest");
  EXPECT_EQ(c.memory.device_limit.bytes, 6LL << 30);
  EXPECT_DOUBLE_EQ(c.memory.on_oom.shrink_factor, 0.5);
  EXPECT_EQ(c.memory.on_oom.max_retries, 8);
}

TEST(Config, GradientCheckpointingForms) {
  EXPECT_EQ(parse("training: {gradient_checkpointing: true}").training.gradient_checkpointing.policy, "all");
  EXPECT_EQ(parse("training: {gradient_checkpointing: false}").training.gradient_checkpointing.policy, "none");
  EXPECT_FALSE(parse("training: {gradient_checkpointing: false}").training.gradient_checkpointing.enabled());
  auto layers = parse("training:\n  gradient_checkpointing: {policy: layers, layers: [1, 3]}\n").training.gradient_checkpointing;
  EXPECT_EQ(layers.policy, "layers");
  EXPECT_EQ(layers.layers, (std::vector<int>{1, 3}));
  auto every = parse("training:\n  gradient_checkpointing:\n    n: 3\n").training.gradient_checkpointing;
  EXPECT_EQ(every.policy, "every_n");  // n alone means every_n
  EXPECT_EQ(every.n, 3);
}

TEST(Config, DeviceMapForms) {
  auto one = parse("model: {device_map: cuda:0}").model.device_map;
  EXPECT_EQ(one.single, "cuda:0");
  EXPECT_TRUE(one.entries.empty());
  EXPECT_EQ(parse("model: {device_map: cpu}").model.device_map.single, "cpu");
  // Order as written, not sorted; HF's integer devices mean cuda:N.
  auto map = parse("model:\n  device_map:\n    lm_head: cpu\n    model.layers.0-3: 1\n    model.embed: cuda:0\n").model.device_map;
  ASSERT_EQ(map.entries.size(), 3u);
  EXPECT_EQ(map.entries[0].first, "lm_head");
  EXPECT_EQ(map.entries[1], std::make_pair(std::string("model.layers.0-3"), std::string("cuda:1")));
  EXPECT_EQ(map.entries[2].first, "model.embed");
}

TEST(Config, MaxMemoryAndDeviceLimitSizes) {
  auto c = parse("model:\n  max_memory: {cuda:0: 20GiB, cpu: 64GiB}\nmemory:\n  device_limit: 512MiB\n");
  EXPECT_EQ(c.model.max_memory.at("cuda:0").bytes, 20LL * 1024 * 1024 * 1024);
  EXPECT_EQ(c.model.max_memory.at("cpu").bytes, 64LL * 1024 * 1024 * 1024);
  EXPECT_EQ(c.memory.device_limit.bytes, 512LL * 1024 * 1024);
  auto hf = parse("model:\n  max_memory: {0: \"20GiB\"}\nmemory: {device_limit: 0.9}\n");
  EXPECT_EQ(hf.model.max_memory.at("cuda:0").bytes, 20LL << 30);
  EXPECT_DOUBLE_EQ(hf.memory.device_limit.fraction, 0.9);
  EXPECT_FALSE(parse("memory: {device_limit: null}").memory.device_limit.is_set());
}

TEST(Config, TargetModulesForms) {
  EXPECT_EQ(parse("lora: {target_modules: all-linear}").lora.target_modules, (std::vector<std::string>{"all-linear"}));
  EXPECT_EQ(parse("lora: {target_modules: [q_proj, v_proj]}").lora.target_modules,
            (std::vector<std::string>{"q_proj", "v_proj"}));
  auto regex = parse("lora:\n  target_modules: '.*\\.(q_proj|v_proj)'\n");
  EXPECT_EQ(regex.lora.target_modules, (std::vector<std::string>{".*\\.(q_proj|v_proj)"}));
  auto notes = memtune::trainer::compatibility_notes(regex);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_HAS(notes[0], "lora.target_modules");
  EXPECT_HAS(notes[0], "regex");
}

// lora.rank_pattern / alpha_pattern: maps kept in the YAML's order (the first pattern that
// matches a module decides, as in PEFT). An override sets one entry in its place, adds a new
// one last, or replaces the map; to_yaml writes them back in that order.
TEST(Config, RankAndAlphaPatternsKeepTheYamlsOrder) {
  using Ranks = std::vector<std::pair<std::string, int64_t>>;
  using Alphas = std::vector<std::pair<std::string, double>>;
  const std::string yaml =
      "lora:\n  rank_pattern:\n    v_proj: 4\n    'layers\\.0\\..*': 16\n    down_proj: 2\n"
      "  alpha_pattern: {q_proj: 32.5, a_proj: 1}\n";
  const Config c = parse(yaml);
  EXPECT_EQ(c.lora.rank_pattern, (Ranks{{"v_proj", 4}, {"layers\\.0\\..*", 16}, {"down_proj", 2}}));
  EXPECT_EQ(c.lora.alpha_pattern, (Alphas{{"q_proj", 32.5}, {"a_proj", 1}}));
  const Config o = parse(yaml, {"lora.rank_pattern.layers\\.0\\..*=8", "lora.rank_pattern.model.layers.1.mlp.up_proj=3"});
  EXPECT_EQ(o.lora.rank_pattern,
            (Ranks{{"v_proj", 4}, {"layers\\.0\\..*", 8}, {"down_proj", 2}, {"model.layers.1.mlp.up_proj", 3}}));
  EXPECT_EQ(parse(yaml, {"lora.rank_pattern={k_proj: 5}"}).lora.rank_pattern, (Ranks{{"k_proj", 5}}));
  EXPECT_TRUE(parse(yaml, {"lora.alpha_pattern={}"}).lora.alpha_pattern.empty());
  const Config back = parse(to_yaml(o));
  EXPECT_EQ(back.lora.rank_pattern, o.lora.rank_pattern);
  EXPECT_EQ(back.lora.alpha_pattern, o.lora.alpha_pattern);
  EXPECT_FALSE(parse(yaml, {"lora.rank_pattern={down_proj: 2, v_proj: 4, 'layers\\.0\\..*': 16}"}) == c)
      << "the order is part of the config";
}

TEST(ConfigErrors, RankAndAlphaPatternValues) {
  expect_invalid("lora:\n  rank_pattern: {q_proj: 0}\n", "q_proj", "0", "lora.rank_pattern.q_proj", "0",
                 "a rank is an integer >= 1");
  expect_wrong_type("lora:\n  rank_pattern: {q_proj: 2.5}\n", "q_proj", "2.5", "lora.rank_pattern.q_proj", "integer",
                    "2.5");
  expect_invalid("lora:\n  alpha_pattern: {q_proj: -1}\n", "q_proj", "-1", "lora.alpha_pattern.q_proj", "-1",
                 "must be a finite number > 0");
  expect_wrong_type("lora:\n  rank_pattern: [q_proj]\n", "rank_pattern", "[q_proj]", "lora.rank_pattern",
                    "map of module pattern to rank", "[q_proj]");
  EXPECT_HAS(error_of("lora:\n  rank_pattern:\n    q_proj: 4\n    q_proj: 8\n"),
             "bad.yaml:4:5: lora.rank_pattern.q_proj: duplicate key");
}

TEST(Config, BatchSizeAuto) {
  EXPECT_EQ(parse("training: {per_device_train_batch_size: auto}").training.per_device_train_batch_size,
            TrainingConfig::kAuto);
}

TEST(Config, ComputeDtypeAliasesAreNormalised) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"float16", "float16"},   {"torch.float16", "float16"}, {"fp16", "float16"},      {"half", "float16"},
      {"bf16", "bfloat16"},     {"bfloat16", "bfloat16"},     {"torch.bfloat16", "bfloat16"},
      {"fp32", "float32"},      {"float32", "float32"},       {"torch.float32", "float32"}, {"auto", "auto"}};
  for (const auto& [written, meant] : cases) {
    auto c = parse("model:\n  quantization_config:\n    bnb_4bit_compute_dtype: " + written + "\n");
    EXPECT_EQ(c.model.quantization_config.bnb_4bit_compute_dtype, meant) << written;
  }
}

TEST(Config, ResumeFromCheckpointForms) {
  auto resume = [](const std::string& v) {
    return parse("training:\n  resume_from_checkpoint: " + v + "\n").training.resume_from_checkpoint;
  };
  EXPECT_EQ(resume("latest"), "latest");
  EXPECT_EQ(resume("true"), "latest");
  EXPECT_EQ(resume("false"), "");
  EXPECT_EQ(resume("runs/a/checkpoints/step-20"), "runs/a/checkpoints/step-20");
  EXPECT_EQ(resume("null"), "");
  EXPECT_EQ(resume(""), "");
  EXPECT_EQ(parse("model:\n  tokenizer:\n").model.tokenizer, "");  // empty value where a string is expected
}

// ---- Strict errors ----

TEST(ConfigErrors, UnknownKeyNamesNearestInExactForm) {
  const std::string yaml = "training:\n  gradient_acumulation_steps: 8\n";
  EXPECT_EQ(error_of(yaml), "bad.yaml:2:3: training.gradient_acumulation_steps: unknown key (did you mean "
                            "gradient_accumulation_steps?)");
}

TEST(ConfigErrors, UnknownKeyInNestedMappingNamesNearestThere) {
  const std::string yaml = "model:\n  quantization_config:\n    load_in_4bit: true\n    bnb_4bit_quant_typ: nf4\n";
  EXPECT_EQ(error_of(yaml), at(yaml, "bnb_4bit_quant_typ", "bnb") +
                                ": model.quantization_config.bnb_4bit_quant_typ: unknown key (did you mean "
                                "bnb_4bit_quant_type?)");
}

TEST(ConfigErrors, UnknownSectionNamesNearestSection) {
  EXPECT_EQ(error_of("trainig:\n  fp16: true\n"), "bad.yaml:1:1: trainig: unknown key (did you mean training?)");
}

TEST(ConfigErrors, UnknownKeyInsideCheckpointingMap) {
  const std::string yaml = "training:\n  gradient_checkpointing: {polcy: all}\n";
  EXPECT_EQ(error_of(yaml), at(yaml, "polcy", "polcy") +
                                ": training.gradient_checkpointing.polcy: unknown key (did you mean policy?)");
}

TEST(ConfigErrors, DuplicateKey) {
  const std::string yaml = "lora:\n  r: 8\n  r: 16\n";
  std::string e = error_of(yaml);
  EXPECT_HAS(e, "bad.yaml:3:3: lora.r: duplicate key (first at line 2)");
}

TEST(ConfigErrors, YamlSyntaxErrorHasLineAndColumn) {
  std::string e = error_of("training:\n  fp16: [true\n");
  EXPECT_HAS(e, "bad.yaml:");
  EXPECT_HAS(e, "not valid YAML");
}

TEST(ConfigErrors, TopLevelMustBeAMapping) {
  std::string e = error_of("- model\n- lora\n");
  EXPECT_HAS(e, "bad.yaml:1:1: config: expected a mapping, got '[model, lora]'");
}

TEST(ConfigErrors, WrongTypeNumber) {
  const std::string yaml = "training:\n  learning_rate: fast\n";
  expect_wrong_type(yaml, "learning_rate: fast", "fast", "training.learning_rate", "number", "fast");
}

TEST(ConfigErrors, WrongTypeInteger) {
  const std::string yaml = "training:\n  gradient_accumulation_steps: 2.5\n";
  expect_wrong_type(yaml, "gradient_accumulation_steps: 2.5", "2.5", "training.gradient_accumulation_steps",
                    "integer", "2.5");
}

TEST(ConfigErrors, WrongTypeBool) {
  const std::string yaml = "training:\n  fp16: maybe\n";
  expect_wrong_type(yaml, "fp16: maybe", "maybe", "training.fp16", "bool", "maybe");
}

TEST(ConfigErrors, WrongTypeListWhereNumber) {
  const std::string yaml = "lora:\n  lora_alpha: [16]\n";
  expect_wrong_type(yaml, "lora_alpha", "[16]", "lora.lora_alpha", "number", "[16]");
}

TEST(ConfigErrors, WrongTypeSectionNotAMapping) {
  const std::string yaml = "lora: 16\n";
  expect_wrong_type(yaml, "lora: 16", "16", "lora", "a mapping", "16");
}

TEST(ConfigErrors, WrongTypeListElementNamesIndex) {
  const std::string yaml = "lora:\n  layers_to_transform: [1, x]\n";
  expect_wrong_type(yaml, "[1, x]", "x", "lora.layers_to_transform[1]", "integer", "x");
}

TEST(ConfigErrors, BatchSizeWordOtherThanAuto) {
  const std::string yaml = "training:\n  per_device_train_batch_size: many\n";
  expect_wrong_type(yaml, "per_device_train_batch_size", "many", "training.per_device_train_batch_size",
                    "integer|auto", "many");
}

TEST(ConfigErrors, BatchSizeZero) {
  const std::string yaml = "training:\n  per_device_train_batch_size: 0\n";
  expect_invalid(yaml, "per_device_train_batch_size: 0", "0", "training.per_device_train_batch_size", "0",
                 "at least 1, or auto");
}

TEST(ConfigErrors, BatchSizeNegative) {
  const std::string yaml = "training:\n  per_device_train_batch_size: -4\n";
  expect_invalid(yaml, "per_device_train_batch_size", "-4", "training.per_device_train_batch_size", "-4",
                 "at least 1, or auto");
}

TEST(ConfigErrors, EvalBatchSizeZero) {
  const std::string yaml = "training:\n  per_device_eval_batch_size: 0\n";
  expect_invalid(yaml, "per_device_eval_batch_size", "0", "training.per_device_eval_batch_size", "0", "at least 1");
}

TEST(ConfigErrors, LearningRateNegative) {
  const std::string yaml = "training:\n  learning_rate: -1e-4\n";
  expect_invalid(yaml, "learning_rate", "-1e-4", "training.learning_rate", "-1e-4", "must be > 0");
}

TEST(ConfigErrors, LearningRateZero) {
  const std::string yaml = "training:\n  learning_rate: 0\n";
  expect_invalid(yaml, "learning_rate", "0", "training.learning_rate", "0", "must be > 0");
}

TEST(ConfigErrors, LoraRankZero) {
  const std::string yaml = "lora:\n  r: 0\n";
  expect_invalid(yaml, "r: 0", "0", "lora.r", "0", "rank must be at least 1");
}

TEST(ConfigErrors, LoraAlphaZero) {
  const std::string yaml = "lora:\n  lora_alpha: 0\n";
  expect_invalid(yaml, "lora_alpha", "0", "lora.lora_alpha", "0", "must be > 0");
}

TEST(ConfigErrors, LoraAlphaNegative) {
  const std::string yaml = "lora:\n  lora_alpha: -16\n";
  expect_invalid(yaml, "lora_alpha", "-16", "lora.lora_alpha", "-16", "must be > 0");
}

TEST(ConfigErrors, LoraDropoutOne) {
  const std::string yaml = "lora:\n  lora_dropout: 1.0\n";
  expect_invalid(yaml, "lora_dropout", "1.0", "lora.lora_dropout", "1.0", "[0, 1)");
}

TEST(ConfigErrors, LoraDropoutNegative) {
  const std::string yaml = "lora:\n  lora_dropout: -0.1\n";
  expect_invalid(yaml, "lora_dropout", "-0.1", "lora.lora_dropout", "-0.1", "[0, 1)");
}

TEST(ConfigErrors, Fp16AndBf16BothTrue) {
  const std::string yaml = "training:\n  fp16: true\n  bf16: true\n";
  expect_invalid(yaml, "bf16: true", "true", "training.bf16", "true", "fp16 and bf16 are both true");
}

TEST(ConfigErrors, QuantTypeUnknown) {
  const std::string yaml = "model:\n  quantization_config:\n    bnb_4bit_quant_type: nf3\n";
  std::string e = expect_invalid(yaml, "bnb_4bit_quant_type", "nf3", "model.quantization_config.bnb_4bit_quant_type",
                                 "nf3", "bitsandbytes' 4-bit codes are nf4 and fp4");
  EXPECT_HAS(e, "did you mean nf4?");
}

// sdpa needs LibTorch 2.x: this build (1.13 on the CPU machine) refuses it by name and
// version; the 2.x build takes it. HF's flash_attention_2 is not one of memtune's names.
TEST(ConfigErrors, AttnImplementationNamesAndVersion) {
  const std::string yaml = "model:\n  attn_implementation: sdpa\n";
  if (memtune::models::sdpa_available()) {
    EXPECT_EQ(parse(yaml).model.attn_implementation, "sdpa");
  } else {
    std::string e = expect_invalid(yaml, "attn_implementation", "sdpa", "model.attn_implementation", "sdpa",
                                   "needs LibTorch 2.0 or later");
    EXPECT_HAS(e, memtune::compat::torch_version());
  }
  expect_invalid("model:\n  attn_implementation: flash_attention_2\n", "attn_implementation", "flash",
                 "model.attn_implementation", "flash_attention_2", "expected one of auto|eager|sdpa");
  EXPECT_EQ(parse("model:\n  attn_implementation: eager\n").model.attn_implementation, "eager");
}

TEST(Config, QuantTypeNf4OrFp4) {
  for (const std::string t : {"nf4", "fp4"})
    EXPECT_EQ(parse("model:\n  quantization_config:\n    bnb_4bit_quant_type: " + t + "\n")
                  .model.quantization_config.bnb_4bit_quant_type, t);
}

// load_in_8bit: LLM.int8, with its threshold; what bitsandbytes' 8-bit layers do not read, and
// what they cannot do, refused by name.
TEST(Config, LoadIn8bitWithItsThreshold) {
  const auto q = parse("model:\n  quantization_config:\n    load_in_8bit: true\n    llm_int8_threshold: 4.5\n")
                     .model.quantization_config;
  EXPECT_TRUE(q.load_in_8bit);
  EXPECT_EQ(q.llm_int8_threshold, 4.5);
  EXPECT_EQ(parse("model:\n  quantization_config:\n    load_in_8bit: true\n").model.quantization_config.llm_int8_threshold,
            6.0);  // BitsAndBytesConfig's default
}

// llm_int8_skip_modules: null (transformers' default) and a list, even an empty one, differ;
// a bare string is refused (transformers would take its characters as the entries), and so
// is a list with nothing quantized for it to apply to.
TEST(Config, LlmInt8SkipModulesIsNullOrAList) {
  const std::string q = "model:\n  quantization_config:\n    load_in_4bit: true\n";
  EXPECT_FALSE(parse(q).model.quantization_config.llm_int8_skip_modules.has_value());
  EXPECT_FALSE(parse(q + "    llm_int8_skip_modules: null\n").model.quantization_config.llm_int8_skip_modules);
  EXPECT_EQ(parse(q + "    llm_int8_skip_modules: [lm_head, model.layers.1.mlp]\n")
                .model.quantization_config.llm_int8_skip_modules,
            (std::vector<std::string>{"lm_head", "model.layers.1.mlp"}));
  EXPECT_EQ(parse(q + "    llm_int8_skip_modules: []\n").model.quantization_config.llm_int8_skip_modules,
            std::vector<std::string>{});
  EXPECT_EQ(parse_config(q, "x", {"model.quantization_config.llm_int8_skip_modules=[lm_head, down_proj]"})
                .model.quantization_config.llm_int8_skip_modules,
            (std::vector<std::string>{"lm_head", "down_proj"}));
  EXPECT_HAS(error_of(q + "    llm_int8_skip_modules: lm_head\n"),
             "model.quantization_config.llm_int8_skip_modules: expected list of strings, or null, got the string "
             "'lm_head' (transformers would read its characters as the entries). Hint: [lm_head]");
  expect_invalid("model:\n  quantization_config:\n    llm_int8_skip_modules: [lm_head]\n", "llm_int8_skip_modules",
                 "[lm_head]", "model.quantization_config.llm_int8_skip_modules", "[lm_head]",
                 "neither load_in_4bit nor load_in_8bit");
  EXPECT_TRUE(parse("model:\n  quantization_config:\n    load_in_8bit: true\n    llm_int8_skip_modules: [lm_head]\n")
                  .model.quantization_config.llm_int8_skip_modules);
}

// BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
// bnb_4bit_compute_dtype=torch.bfloat16).to_dict() as transformers 5.12 writes it, less its
// private _load_in_4bit / _load_in_8bit mirrors: every public key reads, at the value written.
TEST(Config, ABitsAndBytesConfigDictReads) {
  const auto q = parse(R"(model:
  quantization_config: {"quant_method": "bitsandbytes", "llm_int8_threshold": 6.0, "llm_int8_skip_modules": null,
    "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false, "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": true, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
    "load_in_4bit": true, "load_in_8bit": false}
)").model.quantization_config;
  EXPECT_TRUE(q.load_in_4bit && !q.load_in_8bit && q.bnb_4bit_use_double_quant && !q.llm_int8_skip_modules);
  EXPECT_EQ(q.bnb_4bit_quant_type, "nf4");
  EXPECT_EQ(q.bnb_4bit_compute_dtype, "bfloat16");
  EXPECT_EQ(q.quant_method, "bitsandbytes");
}

TEST(ConfigErrors, LoadIn8bitRefusesWhatItCannotDo) {
  const std::string q = "model:\n  quantization_config:\n    load_in_8bit: true\n";
  expect_invalid(q + "    load_in_4bit: true\n", "load_in_8bit", "true", "model.quantization_config.load_in_8bit",
                 "true", "load_in_4bit is true too");
  expect_invalid(q + "    bnb_4bit_compute_dtype: bfloat16\n", "bnb_4bit_compute_dtype", "bfloat16",
                 "model.quantization_config.bnb_4bit_compute_dtype", "bfloat16", "applies to load_in_4bit");
  expect_invalid(q + "    bnb_4bit_quant_type: nf4\n", "bnb_4bit_quant_type", "nf4",
                 "model.quantization_config.bnb_4bit_quant_type", "nf4", "applies to load_in_4bit");
  expect_invalid(q + "    bnb_4bit_use_double_quant: true\n", "bnb_4bit_use_double_quant", "true",
                 "model.quantization_config.bnb_4bit_use_double_quant", "true", "applies to load_in_4bit");
  expect_invalid(q + "    llm_int8_threshold: -1\n", "llm_int8_threshold", "-1",
                 "model.quantization_config.llm_int8_threshold", "-1", "finite number >= 0");
  expect_invalid("model:\n  quantization_config:\n    llm_int8_threshold: 4.0\n", "llm_int8_threshold", "4.0",
                 "model.quantization_config.llm_int8_threshold", "4.0", "load_in_8bit is false");
  expect_invalid(q + "    llm_int8_has_fp16_weight: true\n", "llm_int8_has_fp16_weight", "true",
                 "model.quantization_config.llm_int8_has_fp16_weight", "true", "not supported");
  expect_invalid(q + "    llm_int8_enable_fp32_cpu_offload: true\n", "llm_int8_enable_fp32_cpu_offload", "true",
                 "model.quantization_config.llm_int8_enable_fp32_cpu_offload", "true", "keeps them quantized there");
  EXPECT_HAS(error_of(q + "    quant_method: gptq\n"), "memtune quantizes in bitsandbytes' formats only");
  expect_invalid(q + "training:\n  finetune: full\n", "load_in_8bit", "true",
                 "model.quantization_config.load_in_8bit", "true", "8-bit weights stay frozen");
  expect_invalid(q + "distributed:\n  sharding: full\n", "load_in_8bit", "true",
                 "model.quantization_config.load_in_8bit", "true", "needs each weight whole");
  // DoRA not on 8-bit weights; under sharding: full each weight's owner gives its norms
  // (tests/tools/launch_sharding_itest.cpp).
  const std::string dora = "lora: {use_dora: true}\n";
  expect_invalid(q + dora, "use_dora", "true", "lora.use_dora", "true", "DoRA on LLM.int8 (load_in_8bit) weights");
  EXPECT_TRUE(parse(dora + "distributed:\n  sharding: full\n").lora.use_dora);
  EXPECT_TRUE(parse(dora + "distributed:\n  sharding: gradients\n").lora.use_dora);
  // Without load_in_8bit the 4-bit keys are the 4-bit run's.
  EXPECT_EQ(parse("model:\n  quantization_config:\n    bnb_4bit_quant_type: nf4\n")
                .model.quantization_config.bnb_4bit_quant_type, "nf4");
}

// Keys Hugging Face / PEFT users write whose meaning memtune does not implement: refused by
// name with what memtune does instead, never accepted and ignored (issue 22).
// model.torch_dtype keeps the dense weights in that dtype, as from_pretrained does; a 16-bit
// dtype takes its own compute dtype and a LoRA run, and is refused by name otherwise.
TEST(TorchDtype, SixteenBitsNeedTheirComputeDtypeAndOnlyAdaptersTrained) {
  using memtune::trainer::resolve_dense_dtype;
  EXPECT_EQ(parse("model: {torch_dtype: torch.bfloat16}").model.torch_dtype, "bfloat16");
  EXPECT_EQ(parse("model: {torch_dtype: fp16}").model.torch_dtype, "float16");
  EXPECT_EQ(parse("model: {torch_dtype: torch.float32}").model.torch_dtype, "float32");
  expect_invalid("model:\n  torch_dtype: float64\n", "torch_dtype", "float64", "model.torch_dtype", "float64",
                 "expected one of auto|float32|float16|bfloat16");

  memtune::models::ModelSpec spec = *memtune::models::preset("tiny-llama");
  auto error = [&](const std::string& yaml, at::ScalarType compute) {
    try {
      resolve_dense_dtype(parse(yaml), spec, compute);
    } catch (const memtune::UserError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted:\n" << yaml;
    return std::string();
  };
  const std::string lora = "training: {finetune: lora}\n";
  EXPECT_EQ(resolve_dense_dtype(parse("model: {torch_dtype: float32}"), spec, at::kBFloat16), at::kFloat);
  EXPECT_EQ(resolve_dense_dtype(parse(lora + "model: {torch_dtype: bfloat16}"), spec, at::kBFloat16), at::kBFloat16);
  EXPECT_EQ(resolve_dense_dtype(parse(lora + "model: {torch_dtype: float16}"), spec, at::kHalf), at::kHalf);
  std::string e = error("training: {finetune: full}\nmodel: {torch_dtype: bfloat16}", at::kBFloat16);
  EXPECT_HAS(e, "model.torch_dtype is bfloat16, and training.finetune: full");
  EXPECT_HAS(e, "Hint: model.torch_dtype: float32 with training.bf16");
  e = error(lora + "lora: {modules_to_save: [lm_head]}\nmodel: {torch_dtype: bfloat16}", at::kBFloat16);
  EXPECT_HAS(e, "lora.modules_to_save");
  e = error(lora + "lora: {bias: lora_only}\nmodel: {torch_dtype: float16}", at::kHalf);
  EXPECT_HAS(e, "lora.bias: lora_only trains the base's biases, which memtune keeps in float32 (PEFT would train "
                "them in float16)");
  e = error(lora + "model: {torch_dtype: bfloat16}", at::kFloat);
  EXPECT_HAS(e, "the products would run in float32");
  EXPECT_HAS(e, "Hint: training.bf16: true");
  e = error(lora + "model: {torch_dtype: float16}", at::kFloat);
  EXPECT_HAS(e, "fp16: true on a GPU (CPUs have no fp16 matmul)");
  e = error(lora + "model: {torch_dtype: float16}", at::kBFloat16);
  EXPECT_HAS(e, "the products would run in bfloat16");

  // auto: config.json's dtype (transformers 5), else its torch_dtype, else float32.
  const std::string automatic = lora + "model: {torch_dtype: auto}";
  EXPECT_EQ(resolve_dense_dtype(parse(automatic), spec, at::kBFloat16), at::kFloat);
  spec.torch_dtype = "bfloat16";
  EXPECT_EQ(resolve_dense_dtype(parse(automatic), spec, at::kBFloat16), at::kBFloat16);
  spec.extra["dtype"] = "float16";
  EXPECT_EQ(resolve_dense_dtype(parse(automatic), spec, at::kHalf), at::kHalf);
  spec.extra["dtype"] = "float64";
  EXPECT_HAS(error(automatic, at::kFloat), "config.json: dtype 'float64' is not one memtune keeps");
}
TEST(ConfigErrors, LowCpuMemUsageFalseRefused) {
  const std::string yaml = "model:\n  low_cpu_mem_usage: false\n";
  expect_invalid(yaml, "low_cpu_mem_usage", "false", "model.low_cpu_mem_usage", "false",
                 "always loads tensor by tensor");
  EXPECT_TRUE(parse("model: {low_cpu_mem_usage: true}").model.low_cpu_mem_usage);
}

TEST(ConfigErrors, ModulesToSaveEmptyNameRefused) {
  const std::string yaml = "lora:\n  modules_to_save: [lm_head, \"\"]\n";
  expect_invalid(yaml, "modules_to_save", "[lm_head, \"\"]", "lora.modules_to_save", "[lm_head, \"\"]",
                 "must not be empty");
  EXPECT_EQ(parse("lora: {modules_to_save: [lm_head, embed_tokens]}").lora.modules_to_save,
            (std::vector<std::string>{"lm_head", "embed_tokens"}));
}

// transformers 4's group_by_length and transformers 5's train_sampling_strategy name one
// sampler: both may say group_by_length, but grouping and sequential contradict.
TEST(ConfigErrors, GroupByLengthAndASequentialStrategyContradict) {
  const auto both = parse("training: {group_by_length: true, train_sampling_strategy: group_by_length}").training;
  EXPECT_TRUE(both.group_by_length);
  EXPECT_EQ(both.train_sampling_strategy, "group_by_length");
  EXPECT_EQ(parse("training: {train_sampling_strategy: sequential}").training.train_sampling_strategy, "sequential");
  expect_invalid("training: {group_by_length: true, train_sampling_strategy: sequential}", "group_by_length", "true",
                 "training.group_by_length", "true", "contradicts train_sampling_strategy: sequential");
  expect_invalid("training: {train_sampling_strategy: by_length}", "train_sampling_strategy", "by_length",
                 "training.train_sampling_strategy", "by_length", "group_by_length");
}

// data.eval_split: a share in [0, 1) or a whole number (train_test_split's test_size), not
// beside data.eval_file; it serves eval_steps, but not eval_accuracy_rows (which generates
// from a file's records).
TEST(ConfigErrors, EvalSplitIsAShareOrACountAndOneSourceOfEvalData) {
  EXPECT_EQ(parse("data: {eval_split: 0.1}").data.eval_split, 0.1);
  EXPECT_EQ(parse("data: {eval_split: 200}").data.eval_split, 200);
  EXPECT_EQ(parse("data: {eval_split: 0.1}\ntraining: {eval_steps: 10}").training.eval_steps, 10);
  expect_invalid("data: {eval_split: -0.1}", "eval_split", "-0.1", "data.eval_split", "-0.1", "a share in [0, 1)");
  expect_invalid("data: {eval_split: 1.5}", "eval_split", "1.5", "data.eval_split", "1.5", "whole number");
  expect_invalid("data: {eval_split: 0.1, eval_file: e.jsonl}", "eval_split", "0.1", "data.eval_split", "0.1",
                 "data.eval_file names some too (e.jsonl)");
  const std::string e = error_of("data: {eval_split: 0.1}\ntraining: {eval_accuracy_rows: 8}");
  EXPECT_HAS(e, "training.eval_accuracy_rows");
  EXPECT_HAS(e, "data.eval_split holds out tokenized documents");
}

// transformers' IntervalStrategy keys: a *_steps key the strategy does not read is refused
// (transformers ignores it), as is an evaluation with nothing to read or eval data nothing
// reads.
TEST(ConfigErrors, IntervalStrategiesAndTheStepsKeysTheyDoNotRead) {
  const auto t = parse("training: {logging_strategy: epoch, save_strategy: no, eval_strategy: epoch}\n"
                       "data: {eval_file: e.jsonl}").training;
  EXPECT_EQ(t.logging_strategy, "epoch");
  EXPECT_EQ(t.save_strategy, "no");
  EXPECT_EQ(t.eval_strategy, "epoch");
  EXPECT_EQ(parse("training: {eval_strategy: steps}\ndata: {eval_file: e.jsonl}").training.eval_strategy, "steps");
  EXPECT_EQ(parse("training: {eval_strategy: no}").training.eval_strategy, "no");
  expect_invalid("training: {save_strategy: epoch, save_steps: 10}", "save_steps", "10", "training.save_steps", "10",
                 "save_strategy is epoch, which does not read save_steps");
  expect_invalid("training: {logging_strategy: no, logging_steps: 5}", "logging_steps", "5",
                 "training.logging_steps", "5", "logging_strategy is no, which does not read logging_steps");
  expect_invalid("training: {eval_strategy: epoch, eval_steps: 5}\ndata: {eval_file: e.jsonl}", "eval_steps", "5",
                 "training.eval_steps", "5", "eval_strategy is epoch, which does not read eval_steps");
  expect_invalid("training: {save_strategy: no, save_total_limit: 2}", "save_total_limit", "2",
                 "training.save_total_limit", "2", "no checkpoints to limit");
  expect_invalid("training: {eval_strategy: epoch}", "eval_strategy", "epoch", "training.eval_strategy", "epoch",
                 "refuses an eval_strategy without an eval_dataset");
  expect_invalid("training: {eval_strategy: no}\ndata: {eval_file: e.jsonl}", "eval_strategy", "no",
                 "training.eval_strategy", "no", "nothing would read the eval data that data.eval_file names");
  expect_invalid("training: {save_strategy: best}", "save_strategy", "best", "training.save_strategy", "best",
                 "steps|epoch|no");
}

// lr_scheduler_kwargs: the schedule function's own arguments; what its transformers
// function would not take (a TypeError there) or refuses (a ValueError) is refused.
TEST(ConfigErrors, SchedulerKwargsAreTheScheduleFunctionsOwn) {
  const auto t = parse("training: {lr_scheduler_type: cosine_with_min_lr, lr_scheduler_kwargs: {min_lr_rate: 0.1, "
                       "num_cycles: 0.5}}").training;
  EXPECT_EQ(t.lr_scheduler_kwargs, (memtune::trainer::ScheduleKwargs{{"min_lr_rate", 0.1}, {"num_cycles", 0.5}}));
  EXPECT_EQ(parse("training: {lr_scheduler_type: polynomial}", {"training.lr_scheduler_kwargs.power=2"})
                .training.lr_scheduler_kwargs,
            (memtune::trainer::ScheduleKwargs{{"power", 2.0}}));
  expect_invalid("training: {lr_scheduler_type: cosine, lr_scheduler_kwargs: {power: 2}}", "power", "2",
                 "training.lr_scheduler_kwargs.power", "2", "cosine takes only num_cycles");
  expect_invalid("training: {lr_scheduler_kwargs: {num_cycles: 2}}", "num_cycles", "2",
                 "training.lr_scheduler_kwargs.num_cycles", "2", "linear takes no kwargs");
  expect_invalid("training: {lr_scheduler_type: cosine_with_min_lr}", "lr_scheduler_type", "cosine_with_min_lr",
                 "training.lr_scheduler_type", "cosine_with_min_lr", "needs lr_scheduler_kwargs min_lr or min_lr_rate");
  EXPECT_HAS(error_of("training: {lr_scheduler_type: cosine_with_min_lr, lr_scheduler_kwargs: {min_lr: 1.0e-6, "
                      "min_lr_rate: 0.1}}"),
             "sets both min_lr and min_lr_rate");
  expect_invalid("training: {learning_rate: 1.0e-4, lr_scheduler_type: polynomial, lr_scheduler_kwargs: {lr_end: 0.001}}",
                 "lr_end", "0.001", "training.lr_scheduler_kwargs.lr_end", "0.001", "must be below the learning rate");
  expect_invalid("training: {lr_scheduler_type: cosine, lr_scheduler_kwargs: {num_cycles: 0}}", "num_cycles", "0",
                 "training.lr_scheduler_kwargs.num_cycles", "0", "must be a number > 0");
  // warmup_stable_decay's kwargs mix numbers and names (a quoted number is a name, as in Python).
  EXPECT_EQ(parse("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: 20, "
                  "decay_type: 1-sqrt, min_lr_ratio: 0.1}}")
                .training.lr_scheduler_kwargs,
            (memtune::trainer::ScheduleKwargs{{"num_decay_steps", 20.0}, {"decay_type", "1-sqrt"}, {"min_lr_ratio", 0.1}}));
  EXPECT_EQ(parse("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: 2}}",
                  {"training.lr_scheduler_kwargs.warmup_type=cosine"})
                .training.lr_scheduler_kwargs,
            (memtune::trainer::ScheduleKwargs{{"num_decay_steps", 2.0}, {"warmup_type", "cosine"}}));
  expect_invalid("training: {lr_scheduler_type: warmup_stable_decay}", "lr_scheduler_type", "warmup_stable_decay",
                 "training.lr_scheduler_type", "warmup_stable_decay", "needs lr_scheduler_kwargs num_decay_steps");
  expect_invalid("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: 2, "
                 "decay_type: exponential}}",
                 "decay_type", "exponential", "training.lr_scheduler_kwargs.decay_type", "exponential",
                 "expected linear, cosine or 1-sqrt");
  expect_invalid("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: '20'}}",
                 "num_decay_steps", "'20'", "training.lr_scheduler_kwargs.num_decay_steps", "20", "expected a number");
  expect_invalid("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: 2.5}}",
                 "num_decay_steps", "2.5", "training.lr_scheduler_kwargs.num_decay_steps", "2.5",
                 "a whole number of steps");
  expect_invalid("training: {lr_scheduler_type: warmup_stable_decay, lr_scheduler_kwargs: {num_decay_steps: 2, "
                 "min_lr_ratio: 1.5}}",
                 "min_lr_ratio", "1.5", "training.lr_scheduler_kwargs.min_lr_ratio", "1.5", "must be in [0, 1]");
  expect_invalid("training: {lr_scheduler_type: cosine, lr_scheduler_kwargs: {num_cycles: many}}", "num_cycles", "many",
                 "training.lr_scheduler_kwargs.num_cycles", "many", "expected a number");
  // reduce_lr_on_plateau steps at the periodic evaluations (transformers: "requires an eval
  // strategy") and takes no warm-up.
  const std::string eval = "\ndata: {eval_file: e.jsonl}";
  EXPECT_EQ(parse("training: {lr_scheduler_type: reduce_lr_on_plateau, eval_steps: 10, lr_scheduler_kwargs: "
                  "{mode: max, patience: 3}}" + eval)
                .training.lr_scheduler_kwargs,
            (memtune::trainer::ScheduleKwargs{{"mode", "max"}, {"patience", 3.0}}));
  EXPECT_HAS(error_of("training: {lr_scheduler_type: reduce_lr_on_plateau}" + eval),
             "steps with each periodic evaluation's eval_loss, and this run has none");
  EXPECT_HAS(error_of("training: {lr_scheduler_type: reduce_lr_on_plateau, eval_strategy: \"no\"}"),
             "steps with each periodic evaluation's eval_loss");
  expect_invalid("training: {lr_scheduler_type: reduce_lr_on_plateau, eval_steps: 10, warmup_steps: 5}" + eval,
                 "warmup_steps", "5", "training.warmup_steps", "5", "reduce_lr_on_plateau has no warm-up");
  expect_invalid("training: {lr_scheduler_type: reduce_lr_on_plateau, eval_steps: 10, lr_scheduler_kwargs: "
                 "{factor: 1.5}}" + eval,
                 "factor", "1.5", "training.lr_scheduler_kwargs.factor", "1.5", "must be in (0, 1)");
  expect_invalid("training: {lr_scheduler_type: reduce_lr_on_plateau, eval_steps: 10, lr_scheduler_kwargs: "
                 "{threshold_mode: relative}}" + eval,
                 "threshold_mode", "relative", "training.lr_scheduler_kwargs.threshold_mode", "relative",
                 "expected rel or abs");
}

// metric_for_best_model, greater_is_better and load_best_model_at_end as TrainingArguments
// reads them: the metric's default ("loss" where something ranks evaluations), the default
// of greater_is_better (not a *loss), and the strategies load_best_model_at_end needs.
TEST(ConfigErrors, BestModelKeysAreTrainingArguments) {
  const std::string eval = "\ndata: {eval_file: e.jsonl}";
  using memtune::trainer::best_is_greater;
  using memtune::trainer::best_metric_name;
  const auto t = parse("training: {load_best_model_at_end: true, eval_steps: 2, save_steps: 4}" + eval).training;
  EXPECT_EQ(best_metric_name(t), "loss");
  EXPECT_FALSE(best_is_greater(t));
  const auto a = parse("training: {metric_for_best_model: eval_token_accuracy}" + eval).training;
  EXPECT_EQ(best_metric_name(a), "token_accuracy");
  EXPECT_TRUE(best_is_greater(a));
  EXPECT_TRUE(best_is_greater(parse("training: {metric_for_best_model: perplexity}").training));  // HF's default
  EXPECT_FALSE(best_is_greater(parse("training: {metric_for_best_model: perplexity, greater_is_better: false}").training));
  EXPECT_EQ(best_metric_name(parse("training: {}").training), "");
  expect_invalid("training: {metric_for_best_model: bleu}", "metric_for_best_model", "bleu",
                 "training.metric_for_best_model", "bleu", "loss");
  expect_invalid("training: {greater_is_better: true}", "greater_is_better", "true", "training.greater_is_better", "true",
                 "nothing here ranks evaluations");
  EXPECT_HAS(error_of("training: {load_best_model_at_end: true}"), "ranks the checkpoints by their evaluations");
  EXPECT_HAS(error_of("training: {load_best_model_at_end: true, eval_strategy: epoch, save_steps: 4}" + eval),
             "training.save_strategy: invalid value 'steps': load_best_model_at_end needs a checkpoint at each "
             "evaluation: save_strategy must match eval_strategy (epoch)");
}

TEST(ConfigErrors, NeftuneNoiseAlphaIsNotNegative) {
  EXPECT_EQ(parse("training: {neftune_noise_alpha: 5}").training.neftune_noise_alpha, 5);
  expect_invalid("training: {neftune_noise_alpha: -1}", "neftune_noise_alpha", "-1", "training.neftune_noise_alpha",
                 "-1", "must be >= 0");
  expect_invalid("training: {neftune_noise_alpha: 5, per_device_train_batch_size: auto}", "neftune_noise_alpha", "5",
                 "training.neftune_noise_alpha", "5", "set per_device_train_batch_size to a number");
}

TEST(ConfigErrors, LabelSmoothingFactorIsInZeroToOne) {
  EXPECT_EQ(parse("training: {label_smoothing_factor: 0.1}").training.label_smoothing_factor, 0.1);
  expect_invalid("training: {label_smoothing_factor: 1}", "label_smoothing_factor", "1",
                 "training.label_smoothing_factor", "1", "must be in [0, 1)");
  expect_invalid("training: {label_smoothing_factor: -0.1}", "label_smoothing_factor", "-0.1",
                 "training.label_smoothing_factor", "-0.1", "must be in [0, 1)");
}

TEST(ConfigErrors, UnknownComputeDtype) {
  const std::string yaml = "model:\n  quantization_config:\n    bnb_4bit_compute_dtype: float8\n";
  expect_invalid(yaml, "bnb_4bit_compute_dtype", "float8", "model.quantization_config.bnb_4bit_compute_dtype",
                 "float8", "expected one of auto|float32|float16|bfloat16");
}

TEST(ConfigErrors, BlocksizeNotPowerOfTwo) {
  const std::string yaml = "model:\n  quantization_config:\n    blocksize: 100\n";
  expect_invalid(yaml, "blocksize", "100", "model.quantization_config.blocksize", "100", "power of two in 32..4096");
}

TEST(ConfigErrors, BlocksizeBelowRange) {
  const std::string yaml = "model:\n  quantization_config:\n    blocksize: 16\n";
  expect_invalid(yaml, "blocksize", "16", "model.quantization_config.blocksize", "16", "power of two in 32..4096");
}

TEST(ConfigErrors, BlocksizeAboveRange) {
  const std::string yaml = "model:\n  quantization_config:\n    blocksize: 8192\n";
  expect_invalid(yaml, "blocksize", "8192", "model.quantization_config.blocksize", "8192", "power of two in 32..4096");
}

TEST(ConfigErrors, ThresholdsNotIncreasing) {
  const std::string yaml = "memory:\n  warning_threshold: 0.85\n  critical_threshold: 0.8\n";
  expect_invalid(yaml, "critical_threshold", "0.8", "memory.critical_threshold", "0.8",
                 "thresholds must increase in (0, 1]: warning (0.85) < critical");
}

TEST(ConfigErrors, ThresholdAboveOne) {
  const std::string yaml = "memory:\n  emergency_threshold: 1.5\n";
  expect_invalid(yaml, "emergency_threshold", "1.5", "memory.emergency_threshold", "1.5",
                 "thresholds must increase in (0, 1]");
}

TEST(ConfigErrors, ThresholdZero) {
  const std::string yaml = "memory:\n  warning_threshold: 0\n";
  expect_invalid(yaml, "warning_threshold", "0", "memory.warning_threshold", "0", "(0, 1]");
}

TEST(ConfigErrors, ShrinkFactorOne) {
  const std::string yaml = "memory:\n  on_oom:\n    shrink_factor: 1\n";
  expect_invalid(yaml, "shrink_factor", "1", "memory.on_oom.shrink_factor", "1", "(0, 1)");
}

TEST(ConfigErrors, ShrinkFactorZero) {
  const std::string yaml = "memory:\n  on_oom: {shrink_factor: 0}\n";
  expect_invalid(yaml, "shrink_factor", "0", "memory.on_oom.shrink_factor", "0", "(0, 1)");
}

TEST(ConfigErrors, UnknownScheduler) {
  const std::string yaml = "training:\n  lr_scheduler_type: cosin\n";
  std::string e = expect_invalid(yaml, "lr_scheduler_type", "cosin", "training.lr_scheduler_type", "cosin",
                                 "expected one of constant|constant_with_warmup|linear|cosine");
  EXPECT_HAS(e, "(did you mean cosine?)");
}

// transformers would send metrics to the tracker; memtune has none, so it refuses the key
// rather than drop them silently.
TEST(ConfigErrors, ReportToATrackerIsRefused) {
  const std::string yaml = "training:\n  report_to: wandb\n";
  expect_invalid(yaml, "report_to", "wandb", "training.report_to", "wandb",
                 "memtune reports to no experiment tracker; its metrics are in output_dir/metrics.jsonl");
}

TEST(ConfigErrors, UnknownOptim) {
  const std::string yaml = "training:\n  optim: lion_8bit\n";
  expect_invalid(yaml, "optim", "lion_8bit", "training.optim", "lion_8bit",
                 "expected one of "
                 "adamw_torch|adamw_torch_fused|adamw|adamw_bnb_8bit|adamw_8bit|paged_adamw_8bit|paged_adamw_32bit|adafactor|sgd");
}

TEST(Config, OptimTakesHuggingFaceNames) {
  for (const char* name :
       {"adamw_torch", "adamw", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor",
        "sgd"})
    EXPECT_EQ(parse(std::string("training:\n  optim: ") + name + "\n").training.optim, name);
}

TEST(ConfigErrors, UnknownFinetune) {
  const std::string yaml = "training:\n  finetune: qlora\n";
  expect_invalid(yaml, "finetune", "qlora", "training.finetune", "qlora", "expected one of lora|full");
}

TEST(ConfigErrors, UnknownTruncation) {
  const std::string yaml = "data:\n  truncation: left\n";
  expect_invalid(yaml, "truncation", "left", "data.truncation", "left", "expected one of right|drop");
}

TEST(ConfigErrors, UnknownFormat) {
  const std::string yaml = "data:\n  format: csv\n";
  expect_invalid(yaml, "format", "csv", "data.format", "csv", "expected one of auto|text|instruction|chat|tokens|plain");
}

TEST(ConfigErrors, UnknownCheckpointingPolicy) {
  const std::string yaml = "training:\n  gradient_checkpointing: {policy: some, n: 2}\n";
  expect_invalid(yaml, "policy", "some", "training.gradient_checkpointing.policy", "some",
                 "expected one of none|all|every_n|layers");
}

TEST(ConfigErrors, WarmupRatioAboveOne) {
  const std::string yaml = "training:\n  warmup_ratio: 1.5\n";
  expect_invalid(yaml, "warmup_ratio", "1.5", "training.warmup_ratio", "1.5", "[0, 1]");
}

TEST(ConfigErrors, WarmupRatioNegative) {
  const std::string yaml = "training:\n  warmup_ratio: -0.1\n";
  expect_invalid(yaml, "warmup_ratio", "-0.1", "training.warmup_ratio", "-0.1", "[0, 1]");
}

// transformers 5 reads warmup_steps, logging_steps, eval_steps and save_steps below 1 as a
// share of the run: TrainingArguments.get_warmup_steps and TrainerState.compute_steps take
// math.ceil(max_steps * value); 1 and above are steps (a fraction above 1 it refuses).
TEST(ConfigSteps, BelowOneIsAShareOfTheRunRoundedUpAsTransformers) {
  const Config c = parse_config("training:\n  warmup_steps: 0.1\n  logging_steps: 0.05\n  save_steps: 0.5\n", "t");
  EXPECT_DOUBLE_EQ(c.training.warmup_steps, 0.1);
  for (int64_t total : {1, 7, 25, 100, 333}) {
    for (double v : {0.01, 0.05, 0.1, 0.25, 0.5, 0.99}) {
      const double exact = v * static_cast<double>(total);
      const int64_t want = static_cast<int64_t>(exact) + (exact > static_cast<double>(static_cast<int64_t>(exact)));
      EXPECT_EQ(memtune::trainer::steps_of(v, total), want) << v << " of " << total;
    }
    EXPECT_EQ(memtune::trainer::steps_of(10, total), 10);
    EXPECT_EQ(memtune::trainer::steps_of(0, total), 0);
  }
}

TEST(ConfigSteps, AFractionAboveOneOrBothWarmupKeysAreRefused) {
  expect_invalid("training:\n  warmup_steps: 10.5\n", "warmup_steps", "10.5", "training.warmup_steps", "10.5",
                 "a whole number of steps (at most 2^53), or in (0, 1) a share");
  expect_invalid("training:\n  logging_steps: 1e20\n", "logging_steps", "1e20", "training.logging_steps", "1e20",
                 "at most 2^53");  // a whole number, but past int64's steps
  expect_invalid("training:\n  save_steps: 2.5\n", "save_steps", "2.5", "training.save_steps", "2.5",
                 "a whole number of steps");
  expect_invalid("training:\n  logging_steps: 0\n", "logging_steps", "0", "training.logging_steps", "0",
                 "must be > 0");
  expect_invalid("training:\n  warmup_ratio: 0.1\n  warmup_steps: 5\n", "warmup_ratio", "0.1",
                 "training.warmup_ratio", "0.1", "Set one of them");
}

TEST(ConfigErrors, MaxSeqLengthBelowEight) {
  const std::string yaml = "data:\n  max_seq_length: 4\n";
  expect_invalid(yaml, "max_seq_length", "4", "data.max_seq_length", "4", "at least 8");
}

TEST(ConfigErrors, GradientAccumulationZero) {
  const std::string yaml = "training:\n  gradient_accumulation_steps: 0\n";
  expect_invalid(yaml, "gradient_accumulation_steps", "0", "training.gradient_accumulation_steps", "0", "at least 1");
}

TEST(ConfigErrors, MaxStepsZero) {
  const std::string yaml = "training:\n  max_steps: 0\n";
  expect_invalid(yaml, "max_steps", "0", "training.max_steps", "0", "-1");
}

TEST(ConfigErrors, BiasIsOneOfPefts) {
  const std::string yaml = "lora:\n  bias: some\n";
  expect_invalid(yaml, "bias", "some", "lora.bias", "some", "expected one of none|all|lora_only");
  EXPECT_EQ(parse("lora: {bias: lora_only}").lora.bias, "lora_only");
}

TEST(ConfigErrors, EveryNBelowOne) {
  const std::string yaml = "training:\n  gradient_checkpointing: {policy: every_n, n: 0}\n";
  expect_invalid(yaml, "n: 0", "0", "training.gradient_checkpointing.n", "0", "n >= 1");
}

TEST(ConfigErrors, LayersPolicyWithEmptyList) {
  const std::string yaml = "training:\n  gradient_checkpointing: {policy: layers, layers: []}\n";
  expect_invalid(yaml, "layers: []", "[]", "training.gradient_checkpointing.layers", "[]", "list of layer indices");
}

TEST(ConfigErrors, LayersPolicyWithoutList) {
  const std::string yaml = "training:\n  gradient_checkpointing: {policy: layers}\n";
  std::string e = error_of(yaml);
  // No layers key: the error points at the checkpointing map.
  EXPECT_HAS(e, at(yaml, "gradient_checkpointing", "{") + ": training.gradient_checkpointing.layers: invalid value '[]'");
}

TEST(ConfigErrors, RuntimeDeviceNotADevice) {
  const std::string yaml = "runtime:\n  device: gpu\n";
  expect_invalid(yaml, "device", "gpu", "runtime.device", "gpu", "expected auto, cpu, cuda or cuda:N");
}

TEST(ConfigErrors, RuntimeDeviceBadIndex) {
  const std::string yaml = "runtime:\n  device: cuda:x\n";
  expect_invalid(yaml, "device", "cuda:x", "runtime.device", "cuda:x", "expected auto, cpu, cuda or cuda:N");
}

TEST(ConfigErrors, DeviceMapStringNotADevice) {
  const std::string yaml = "model:\n  device_map: tpu\n";
  expect_invalid(yaml, "device_map", "tpu", "model.device_map", "tpu", "expected auto, cpu, cuda, cuda:N");
}

TEST(ConfigErrors, DeviceMapEntryNotADevice) {
  const std::string yaml = "model:\n  device_map:\n    model.layers: cuda:0\n    lm_head: disk\n";
  expect_invalid(yaml, "lm_head", "disk", "model.device_map.lm_head", "disk", "expected cuda, cuda:N, cpu or offload");
}

TEST(ConfigErrors, MaxMemoryKeyNotADevice) {
  const std::string yaml = "model:\n  max_memory: {gpu0: 20GiB}\n";
  expect_invalid(yaml, "max_memory", "20GiB", "model.max_memory.gpu0", "20GiB", "must be a device");
}

TEST(ConfigErrors, BadSizeNamesKeyAndPlace) {
  const std::string yaml = "memory:\n  device_limit: 6 parsecs\n";
  std::string e = error_of(yaml);
  EXPECT_HAS(e, at(yaml, "device_limit", "6") + ": memory.device_limit: unknown unit 'parsecs' in '6 parsecs'");
}

// ---- Overrides ----

TEST(ConfigOverrides, TypedLikeYaml) {
  auto c = parse("training:\n  learning_rate: 2e-4\n",
                 {"training.learning_rate=1e-4", "lora.target_modules=[q_proj,v_proj]", "memory.device_limit=6GiB",
                  "training.gradient_checkpointing={policy: every_n, n: 2}", "model.max_memory.cuda:0=20GiB",
                  "model.device_map=cuda:0", "training.per_device_train_batch_size=auto", "lora.r=4",
                  "training.resume_from_checkpoint="});
  EXPECT_DOUBLE_EQ(c.training.learning_rate, 1e-4);
  EXPECT_EQ(c.lora.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(c.memory.device_limit.bytes, 6LL << 30);
  EXPECT_EQ(c.training.gradient_checkpointing.policy, "every_n");
  EXPECT_EQ(c.training.gradient_checkpointing.n, 2);
  EXPECT_EQ(c.model.max_memory.at("cuda:0").bytes, 20LL << 30);
  EXPECT_EQ(c.model.device_map.single, "cuda:0");
  EXPECT_EQ(c.training.per_device_train_batch_size, TrainingConfig::kAuto);
  EXPECT_EQ(c.lora.r, 4);
  EXPECT_EQ(c.training.resume_from_checkpoint, "");
}

TEST(ConfigOverrides, WholeSectionAsFlowMap) {
  auto c = parse("lora: {r: 8, lora_alpha: 16}\n", {"lora={r: 32}"});
  EXPECT_EQ(c.lora.r, 32);
  EXPECT_DOUBLE_EQ(c.lora.lora_alpha, 16);
}

TEST(ConfigOverrides, UnknownKeyPathSaysDidYouMean) {
  EXPECT_EQ(error_of("", {"training.gradient_acumulation_steps=4"}),
            "override 'training.gradient_acumulation_steps=4': training.gradient_acumulation_steps: unknown key "
            "(did you mean gradient_accumulation_steps?)");
  EXPECT_EQ(error_of("", {"trainng.learning_rate=1"}),
            "override 'trainng.learning_rate=1': trainng: unknown key (did you mean training?)");
}

TEST(ConfigOverrides, PathThroughALeafIsUnknown) {
  std::string e = error_of("", {"training.learning_rate.x=1"});
  EXPECT_HAS(e, "override 'training.learning_rate.x=1': training.learning_rate.x: unknown key");
}

TEST(ConfigOverrides, MalformedWithoutEquals) {
  EXPECT_HAS(error_of("", {"training.learning_rate"}), "override 'training.learning_rate': expected key=value");
  EXPECT_HAS(error_of("", {"=3"}), "override '=3': expected key=value");
}

TEST(ConfigOverrides, WrongTypeNamesOverride) {
  EXPECT_EQ(error_of("", {"training.learning_rate=fast"}),
            "override 'training.learning_rate=fast': training.learning_rate: expected number, got 'fast'");
}

TEST(ConfigOverrides, ImpossibleValueNamesOverride) {
  std::string e = error_of("training:\n  per_device_train_batch_size: 4\n", {"training.per_device_train_batch_size=0"});
  EXPECT_HAS(e, "override 'training.per_device_train_batch_size=0': training.per_device_train_batch_size: invalid value '0'");
}

// ---- Round trip, equality, help, notes ----

// Every field differs from its default, except where only one value is valid.
Config every_field_changed() {
  Config c;
  auto& m = c.model;
  m.name_or_path = "models/llama-3-8b";
  m.architecture = "llama";
  m.tokenizer = "tok/tokenizer.json";
  m.torch_dtype = "bfloat16";
  m.quantization_config.load_in_4bit = true;
  m.quantization_config.bnb_4bit_compute_dtype = "float16";
  m.quantization_config.bnb_4bit_use_double_quant = true;
  m.quantization_config.blocksize = 128;
  m.quantization_config.llm_int8_skip_modules = std::vector<std::string>{"lm_head", "model.layers.1.mlp"};
  m.device_map.entries = {{"model.layers.0-15", "cuda:0"}, {"model.layers.16-31", "cpu"}, {"lm_head", "offload"}};
  m.max_memory["cuda:0"] = memtune::parse_size("20GiB");
  m.max_memory["cpu"] = memtune::parse_size("0.75");
  m.attn_implementation = "eager";
  m.init_seed = 7;
  auto& l = c.lora;
  l.r = 16;
  l.lora_alpha = 32.5;
  l.lora_dropout = 0.05;
  l.target_modules = {"q_proj", "v_proj"};
  l.exclude_modules = {"lm_head"};
  l.modules_to_save = {"lm_head", "embed_tokens"};
  l.layers_to_transform = {0, 2};
  l.rank_pattern = {{"model.layers.0.self_attn.q_proj", 4}, {"q_proj", 32}};
  l.alpha_pattern = {{"layers\\.1\\..*", 2.5}};
  l.use_rslora = true;
  l.use_dora = true;
  l.bias = "lora_only";
  l.init_lora_weights = "gaussian";
  l.fan_in_fan_out = true;
  auto& t = c.training;
  t.output_dir = "runs/a #1: 'test'";  // needs quoting in YAML
  t.finetune = "full";
  t.per_device_train_batch_size = TrainingConfig::kAuto;
  t.per_device_eval_batch_size = 4;
  t.gradient_accumulation_steps = 8;
  t.gradient_checkpointing.policy = "every_n";
  t.gradient_checkpointing.n = 3;
  t.activation_offload = "checkpoints";
  t.fp16 = true;
  t.learning_rate = 1.5e-4 / 3;  // not a short decimal: needs all 17 digits
  t.num_train_epochs = 2.5;
  t.max_steps = 100;
  t.lr_scheduler_type = "cosine";
  t.lr_scheduler_kwargs = {{"num_cycles", 0.75}};
  t.gradient_checkpointing_kwargs.use_reentrant = true;
  t.label_smoothing_factor = 0.1;
  t.logging_first_step = true;
  t.warmup_steps = 10;  // (warmup_ratio: every_field_changed_b, as the two may not be set together)
  t.weight_decay = 0.01;
  t.adam_beta1 = 0.85;
  t.adam_beta2 = 0.95;
  t.adam_epsilon = 1e-6;
  t.optim = "sgd";
  t.momentum = 0.9;
  t.max_grad_norm = 0.3;
  t.logging_steps = 5;
  t.save_steps = 50;
  t.save_total_limit = 3;
  t.eval_steps = 25;
  t.eval_accuracy_rows = 40;
  t.seed = 18446744073709551615ull;
  t.resume_from_checkpoint = "runs/x/checkpoints/step-50";
  t.fp16_init_scale = 1024;
  t.fp16_growth_interval = 100;
  t.dataloader_pin_memory = false;
  t.dataloader_num_workers = 2;
  t.remove_unused_columns = false;
  t.eval_strategy = "steps";
  t.metric_for_best_model = "eval_perplexity";
  t.greater_is_better = "false";
  t.load_best_model_at_end = true;  // save_steps 50, a multiple of eval_steps 25
  t.group_by_length = true;
  t.train_sampling_strategy = "group_by_length";
  auto& d = c.data;
  d.train_file = "data/train.jsonl";
  d.eval_file = "data/eval.jsonl";
  d.format = "chat";
  d.template_name = "chatml";
  d.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}";
  d.text_field = "content";
  d.max_seq_length = 1024;
  d.pack_sequences = false;
  d.truncation = "drop";
  d.train_on_prompt = true;
  d.skip_invalid = true;
  d.add_eos_token = false;
  d.shuffle = false;
  d.cache_dir = "cache/tok";
  auto& mem = c.memory;
  mem.device_limit = memtune::parse_size("6GiB");
  mem.warning_threshold = 0.8;
  mem.critical_threshold = 0.88;
  mem.emergency_threshold = 0.97;
  mem.on_oom.shrink_factor = 0.25;
  mem.on_oom.max_retries = 4;
  mem.on_oom.ladder = {"activation_offload", "checkpointing"};
  mem.optimizer_offload = "cpu";
  mem.grow_after_steps = 20;
  mem.grow_threshold = 0.5;
  mem.supervise = false;
  mem.inject_oom = "3:backward,5:optimizer:1";
  c.runtime.device = "cuda:1";
  c.runtime.num_threads = 2;
  c.runtime.log_level = "debug";
  c.distributed.backend = "gloo";
  c.distributed.timeout = 60.5;
  c.distributed.bucket_size_mb = 50;
  c.distributed.sharding = "gradients";
  c.distributed.prefetch = false;
  return c;
}

// The second variant: the other forms of the fields the first cannot change at once.
Config every_field_changed_b() {
  Config c = every_field_changed();
  c.training.fp16 = false;
  c.training.bf16 = true;
  c.training.gradient_checkpointing.policy = "layers";
  c.training.gradient_checkpointing.n = memtune::trainer::CheckpointingConfig{}.n;  // only every_n reads n
  c.training.gradient_checkpointing.layers = {1, 3};
  c.training.warmup_steps = 0;
  c.training.warmup_ratio = 0.1;
  c.data.eval_file.clear();  // evaluation on what eval_split holds out instead; accuracy needs a file
  c.training.logging_steps = 1;  // the strategies that do not read their *_steps keys
  c.training.logging_strategy = "epoch";
  c.training.save_steps = 0;
  c.training.save_strategy = "epoch";
  c.training.eval_steps = 0;
  c.training.eval_strategy = "epoch";
  c.training.metric_for_best_model = "token_accuracy";
  c.training.greater_is_better = "true";
  c.training.per_device_train_batch_size = 4;  // NEFTune's scale follows a set micro-batch, not auto
  c.training.neftune_noise_alpha = 5;
  c.data.eval_split = 0.2;
  c.training.eval_accuracy_rows = 0;
  c.model.device_map = {};
  c.model.device_map.single = "cuda:1";
  return c;
}

// Key path -> value (flow YAML) of every leaf of a written config, read with yaml-cpp.
std::map<std::string, std::string> leaves(const std::string& yaml) {
  std::map<std::string, std::string> out;
  std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& n, const std::string& p) {
    if (n.IsMap() && n.Style() != YAML::EmitterStyle::Flow && !p.empty() && p != "model.device_map") {
      for (const auto& kv : n) walk(kv.second, p + "." + kv.first.Scalar());
      return;
    }
    if (n.IsMap() && p.empty()) {
      for (const auto& kv : n) walk(kv.second, kv.first.Scalar());
      return;
    }
    YAML::Emitter e;
    e.SetMapFormat(YAML::Flow);
    e.SetSeqFormat(YAML::Flow);
    e << n;
    out[p] = e.c_str();
  };
  walk(YAML::Load(yaml), "");
  return out;
}

// Keys with one valid value: they cannot differ from the default in a valid config (each is
// refused otherwise: ConfigErrors.*Refused*). load_in_8bit excludes every_field_changed's
// load_in_4bit, and llm_int8_threshold needs load_in_8bit (ConfigErrors.LoadIn8bitRefusesWhatItCannotDo).
const std::set<std::string> kSingleValued = {
    "model.quantization_config.load_in_8bit", "model.quantization_config.llm_int8_has_fp16_weight",
    "model.quantization_config.llm_int8_threshold",
    "model.quantization_config.llm_int8_enable_fp32_cpu_offload", "model.quantization_config.quant_method",
    "model.quantization_config.bnb_4bit_quant_type",
    "model.quantization_config.bnb_4bit_quant_storage", "lora.task_type",
    "model.low_cpu_mem_usage", "training.report_to"};

TEST(ConfigRoundTrip, EveryFieldChangedIsComplete) {
  auto defaults = leaves(to_yaml(Config()));
  auto a = leaves(to_yaml(every_field_changed()));
  auto b = leaves(to_yaml(every_field_changed_b()));
  EXPECT_EQ(defaults.size(), 119u);  // the leaves config.h declares: a new key belongs in every_field_changed()
  for (const auto& [path, value] : defaults) {
    if (kSingleValued.count(path)) continue;
    EXPECT_TRUE(a.at(path) != value || b.at(path) != value) << path << " is never changed from " << value;
  }
}

TEST(ConfigRoundTrip, ParseOfToYamlGivesTheSameConfig) {
  for (const Config& c : {every_field_changed(), every_field_changed_b(), Config()}) {
    std::string yaml = to_yaml(c);
    Config back = parse_config(yaml, "written.yaml");
    EXPECT_TRUE(back == c) << yaml << "\n--- read back as ---\n" << to_yaml(back);
    EXPECT_EQ(to_yaml(back), yaml);
  }
  EXPECT_DOUBLE_EQ(parse_config(to_yaml(every_field_changed()), "w").training.learning_rate, 1.5e-4 / 3);
  EXPECT_EQ(parse_config(to_yaml(every_field_changed()), "w").training.seed, 18446744073709551615ull);
}

TEST(ConfigRoundTrip, EqualityComparesEveryKey) {
  // Each key of the changed config, set alone by an override on the defaults, makes a difference.
  const Config defaults;
  auto base = leaves(to_yaml(defaults));
  std::set<std::string> tried;
  for (const Config& changed : {every_field_changed(), every_field_changed_b()}) {
    for (const auto& [path, value] : leaves(to_yaml(changed))) {
      if (base.at(path) == value) continue;
      tried.insert(path);
      // A key valid only beside another is set on a base that has the other.
      const std::map<std::string, std::vector<std::string>> needs = {
          {"training.activation_offload", {"training.gradient_checkpointing=true"}},
          {"training.eval_steps", {"data.eval_file=data/eval.jsonl"}},
          {"training.eval_accuracy_rows", {"data.eval_file=data/eval.jsonl"}},
          {"training.eval_strategy", {"data.eval_file=data/eval.jsonl"}},
          {"training.lr_scheduler_kwargs", {"training.lr_scheduler_type=cosine"}},
          {"training.momentum", {"training.optim=sgd"}},
          {"training.greater_is_better", {"training.metric_for_best_model=loss"}},
          {"training.load_best_model_at_end",
           {"data.eval_file=data/eval.jsonl", "training.eval_steps=25", "training.save_steps=50"}},
          {"model.quantization_config.llm_int8_skip_modules", {"model.quantization_config.load_in_4bit=true"}}};
      const std::vector<std::string> base_overrides = needs.count(path) ? needs.at(path) : std::vector<std::string>{};
      std::vector<std::string> overrides = base_overrides;
      overrides.push_back(path + "=" + value);
      Config one = parse_config("", "x", overrides);
      EXPECT_FALSE(one == parse_config("", "x", base_overrides)) << path << "=" << value << " is not compared";
      EXPECT_TRUE(one == one);
    }
  }
  EXPECT_EQ(tried.size(), base.size() - kSingleValued.size());
  Config other_source = defaults;
  other_source.source = "elsewhere.yaml";
  EXPECT_TRUE(other_source == defaults);
}

TEST(ConfigRoundTrip, ToYamlWritesEveryKeyNested) {
  auto keys = leaves(to_yaml(Config()));
  for (const char* k : {"model.quantization_config.bnb_4bit_compute_dtype", "training.gradient_checkpointing",
                        "memory.on_oom.shrink_factor", "memory.device_limit", "model.max_memory",
                        "distributed.bucket_size_mb", "runtime.log_level", "data.cache_dir"})
    EXPECT_TRUE(keys.count(k)) << k;
  EXPECT_EQ(keys.at("training.learning_rate"), "5e-05");
  EXPECT_EQ(keys.at("training.gradient_checkpointing"), "false");
  EXPECT_EQ(keys.at("memory.device_limit"), "~");
}

TEST(ConfigHelp, ContainsEveryKeyWithTypeDefaultAndHelp) {
  const std::string help = memtune::trainer::config_help();
  for (const auto& [path, value] : leaves(to_yaml(Config()))) EXPECT_HAS(help, "  " + path + " (");
  EXPECT_HAS(help, "training.learning_rate (number, default: 5e-05)\n      peak learning rate");
  EXPECT_HAS(help, "training.per_device_train_batch_size (integer|auto, default: 8)");
  EXPECT_HAS(help, "model.quantization_config.blocksize (integer, default: 64)");
  EXPECT_HAS(help, "memory.device_limit (size, default: null)");
  EXPECT_HAS(help, "lora.target_modules (string or list of strings, default: [])");
}

TEST(ConfigNotes, CompatibilityKeysSayTheyChangeNothing) {
  auto c = memtune::trainer::load_config(memtune::testing::source_dir() / "tests/trainer/fixtures/memory_optimized.yaml");
  auto notes = memtune::trainer::compatibility_notes(c);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_HAS(notes[0], "training.dataloader_pin_memory: accepted for compatibility;");
  EXPECT_EQ(notes[1], "training.remove_unused_columns: accepted for compatibility; memtune builds its own "
                      "batches, so it changes nothing");
  auto more = memtune::trainer::compatibility_notes(parse("training: {dataloader_num_workers: 4, report_to: none}"));
  ASSERT_EQ(more.size(), 1u);
  EXPECT_HAS(more[0], "training.dataloader_num_workers: accepted for compatibility;");
  EXPECT_TRUE(memtune::trainer::compatibility_notes(Config()).empty());
  // transformers' gradient_checkpointing_kwargs: use_reentrant only (false, transformers 5's
  // default, says nothing); torch.utils.checkpoint's other arguments are refused by name.
  EXPECT_TRUE(memtune::trainer::compatibility_notes(
                  parse("training: {gradient_checkpointing_kwargs: {use_reentrant: false}}"))
                  .empty());
  auto reentrant =
      memtune::trainer::compatibility_notes(parse("training: {gradient_checkpointing_kwargs: {use_reentrant: true}}"));
  ASSERT_EQ(reentrant.size(), 1u);
  EXPECT_HAS(reentrant[0], "training.gradient_checkpointing_kwargs.use_reentrant: accepted for compatibility;");
  EXPECT_HAS(error_of("training: {gradient_checkpointing_kwargs: {preserve_rng_state: false}}"),
             "training.gradient_checkpointing_kwargs.preserve_rng_state: unknown key");
}

TEST(ConfigValidate, RefusesConfigsBuiltInCode) {
  Config c;
  c.lora.r = 0;
  c.source = "built";
  try {
    memtune::trainer::validate(c);
    FAIL() << "accepted r = 0";
  } catch (const memtune::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "built: lora.r: invalid value '0': the rank must be at least 1");
  }
}

// ---- The project's own configs ----

TEST(ConfigFiles, EveryYamlUnderConfigsValidatesAndRoundTrips) {
  const fs::path root = memtune::testing::source_dir();
  ASSERT_TRUE(fs::is_directory(root / "configs")) << root / "configs";
  int checked = 0;
  for (const fs::path& dir : {root / "configs", root / "tests/trainer/fixtures"}) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() != ".yaml") continue;
      SCOPED_TRACE(entry.path().string());
      Config c;
      try {
        c = memtune::trainer::load_config(entry.path());
      } catch (const memtune::UserError& e) {
        ADD_FAILURE() << e.what();
        continue;
      }
      Config back = parse_config(to_yaml(c), entry.path().string());
      EXPECT_TRUE(back == c) << to_yaml(c);
      ++checked;
    }
  }
  EXPECT_GE(checked, 2);
}

}  // namespace

namespace memtune::trainer {
namespace {

TEST(Config, InjectOomIsParsedOnceForValidationAndTheTrainer) {
  const auto points = parse_inject_oom("3:backward,5:optimizer:1,,3:backward");
  ASSERT_TRUE(points.has_value());
  ASSERT_EQ(points->size(), 3u);
  EXPECT_EQ((*points)[0].step, 3);
  EXPECT_EQ((*points)[0].phase, "backward");
  EXPECT_EQ((*points)[0].rank, -1);
  EXPECT_EQ((*points)[1].rank, 1);
  EXPECT_EQ((*points)[2].phase, "backward");  // listed twice: fires on two attempts
  EXPECT_TRUE(parse_inject_oom("")->empty());
  // A rank that is not a number used to reach std::stoi in the trainer (exit 1).
  for (const char* bad : {"3", "3:sideways", "x:forward", "-1:forward", "3:forward:one", "3:forward:1:2"})
    EXPECT_FALSE(parse_inject_oom(bad).has_value()) << bad;
}

TEST(ConfigErrors, ActivationOffloadNeedsCheckpointingAndRefusesAll) {
  expect_invalid("training:\n  activation_offload: all\n  gradient_checkpointing: true\n", "activation_offload", "all",
                 "training.activation_offload", "all", "saved-tensor hooks");
  expect_invalid("training:\n  activation_offload: checkpoints\n", "activation_offload", "checkpoints",
                 "training.activation_offload", "checkpoints", "gradient_checkpointing is off");
  expect_invalid("training:\n  activation_offload: cpu\n", "activation_offload", "cpu", "training.activation_offload",
                 "cpu", "expected one of false|checkpoints|all");
  EXPECT_EQ(parse("training: {activation_offload: checkpoints, gradient_checkpointing: true}").training.activation_offload,
            "checkpoints");
}

}  // namespace

TEST(ConfigErrors, OnOomLadderNamesEachRungOnceAndMicroBatchFirst) {
  const std::string base = "model: {name_or_path: tiny-llama}\n";
  EXPECT_EQ(parse_config(base, "t.yaml", {"memory.on_oom.ladder=[checkpointing, layer_offload]"}).memory.on_oom.ladder,
            (std::vector<std::string>{"checkpointing", "layer_offload"}));
  EXPECT_TRUE(parse_config(base, "t.yaml", {"memory.on_oom.ladder=[]"}).memory.on_oom.ladder.empty());
  auto refused = [&](const std::string& value, const std::string& says) {
    try {
      parse_config(base, "t.yaml", {"memory.on_oom.ladder=" + value});
      ADD_FAILURE() << value << " accepted";
    } catch (const UserError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("memory.on_oom.ladder"), std::string::npos) << m;
      EXPECT_NE(m.find(says), std::string::npos) << m;
    }
  };
  refused("[checkpointing, micro_batch]", "list micro_batch first");
  refused("[checkpointing, checkpointing]", "listed twice");
  refused("[checkpointng]", "checkpointing");  // the nearest name
  // optimizer_8bit quantizes AdamW's fp32 state: taken with AdamW, refused by name without it.
  EXPECT_EQ(parse_config(base, "t.yaml", {"memory.on_oom.ladder=[micro_batch, optimizer_8bit]"}).memory.on_oom.ladder,
            (std::vector<std::string>{"micro_batch", "optimizer_8bit"}));
  try {
    parse_config(base, "t.yaml", {"memory.on_oom.ladder=[micro_batch, optimizer_8bit]", "training.optim=sgd"});
    ADD_FAILURE() << "optimizer_8bit with sgd accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("training.optim: sgd keeps none"), std::string::npos) << e.what();
  }
  for (const char* host : {"training.optim=paged_adamw_32bit", "memory.optimizer_offload=cpu"}) {
    try {
      parse_config(base, "t.yaml", {"memory.on_oom.ladder=[micro_batch, optimizer_8bit]", host});
      ADD_FAILURE() << "optimizer_8bit with " << host << " accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("8 bits would free nothing on the device"), std::string::npos) << e.what();
    }
  }
}

}  // namespace memtune::trainer

// Keys that only another key gives a meaning to: refused by name where that other key says they
// would change nothing (Hugging Face's Trainer refuses an evaluation schedule without eval data).
TEST(ConfigErrors, KeysWithoutTheKeyThatReadsThemAreRefused) {
  expect_invalid("training:\n  eval_steps: 10\n", "eval_steps", "10", "training.eval_steps", "10",
                 "evaluation needs data.eval_file or data.eval_split, and neither is set");
  expect_invalid("training:\n  eval_accuracy_rows: 50\n", "eval_accuracy_rows", "50", "training.eval_accuracy_rows",
                 "50", "measured on data.eval_file's rows, and none is set");
  expect_invalid("training:\n  optim: adamw_torch\n  momentum: 0.9\n", "momentum", "0.9", "training.momentum", "0.9",
                 "only optim: sgd has a momentum, and optim is adamw_torch");
  expect_invalid("training:\n  gradient_checkpointing: {policy: all, n: 3}\n", "n: 3", "3",
                 "training.gradient_checkpointing.n", "3", "only policy every_n reads n, and the policy is all");
  expect_invalid("training:\n  gradient_checkpointing: {policy: every_n, layers: [1]}\n", "layers: [1]", "[",
                 "training.gradient_checkpointing.layers", "[1]",
                 "only policy layers reads the list, and the policy is every_n");
  // With the key that reads them, each is taken.
  const Config ok = parse(
      "training:\n  eval_steps: 10\n  eval_accuracy_rows: 50\n  optim: sgd\n  momentum: 0.9\n"
      "  gradient_checkpointing: {policy: every_n, n: 3}\ndata:\n  eval_file: eval.jsonl\n");
  EXPECT_EQ(ok.training.eval_steps, 10);
  EXPECT_EQ(ok.training.eval_accuracy_rows, 50);
  EXPECT_DOUBLE_EQ(ok.training.momentum, 0.9);
  EXPECT_EQ(ok.training.gradient_checkpointing.n, 3);
}

// A checkpointing value replaces the whole setting: memtune estimate --plan's overrides
// (gradient_checkpointing=false, or a whole map) apply over a config with another policy.
TEST(ConfigOverrides, ACheckpointingValueReplacesTheWholeSetting) {
  const std::string yaml = "training:\n  gradient_checkpointing: {policy: every_n, n: 4}\n";
  const Config off = parse(yaml, {"training.gradient_checkpointing=false"});
  EXPECT_EQ(off.training.gradient_checkpointing.policy, "none");
  EXPECT_EQ(off.training.gradient_checkpointing.n, memtune::trainer::CheckpointingConfig{}.n);
  const Config layers = parse(yaml, {"training.gradient_checkpointing={policy: layers, layers: [0, 2]}"});
  EXPECT_EQ(layers.training.gradient_checkpointing.layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(layers.training.gradient_checkpointing.n, memtune::trainer::CheckpointingConfig{}.n);
  const Config back = parse("training:\n  gradient_checkpointing: {policy: layers, layers: [0, 1]}\n",
                            {"training.gradient_checkpointing={policy: every_n, n: 2}"});
  EXPECT_TRUE(back.training.gradient_checkpointing.layers.empty());
}

// A checkpoint's config.yaml is read as written: a rule added since (here, momentum only with
// sgd) does not make an older checkpoint unresumable.
TEST(ConfigSaved, ACheckpointsConfigIsReadWithoutTheRulesAcrossKeys) {
  const std::string saved = "training:\n  optim: adamw_torch\n  momentum: 0.9\n  eval_steps: 5\n";
  EXPECT_NE(error_of(saved).find("only optim: sgd has a momentum"), std::string::npos);
  const Config c = memtune::trainer::parse_saved_config(saved, "step-1/config.yaml");
  EXPECT_EQ(c.training.optim, "adamw_torch");
  EXPECT_DOUBLE_EQ(c.training.momentum, 0.9);
  EXPECT_THROW(memtune::trainer::parse_saved_config("training: {optimm: sgd}\n", "s"), memtune::UserError);
}

// One config may serve a LoRA and a full run (training.finetune=full as an override): the lora
// section is then unused, and the log says so, naming the key.
TEST(ConfigNotes, ALoraSectionInAFullFineTuneIsNamed) {
  auto notes = memtune::trainer::compatibility_notes(parse("training: {finetune: full}\nlora: {r: 64, lora_dropout: 0.1}"));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "lora.r is set, and training.finetune is full: every weight trains and no adapter is built, "
                      "so the lora section changes nothing in this run");
  notes = memtune::trainer::compatibility_notes(parse("training: {finetune: full}\nlora: {target_modules: [q_proj]}"));
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_HAS(notes[0], "lora.target_modules is set");
  EXPECT_TRUE(memtune::trainer::compatibility_notes(parse("training: {finetune: full}")).empty());
  EXPECT_TRUE(memtune::trainer::compatibility_notes(parse("lora: {r: 64}")).empty());
}
