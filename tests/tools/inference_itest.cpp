// The commands that use a trained adapter: `memtune eval`, `generate` and `merge`, through
// the real binary on a model and adapter trained by `memtune train` in the test.
// Invariants checked: eval of the adapter equals the trainer's own final evaluation of it;
// the merged model (W + s B A) computes the same function as base + adapter (eval loss and
// greedy text); a seed replays the same sampled text; --device moves the model (on a GPU:
// the same loss and text as on the CPU).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

struct Trained {
  fs::path dir, base, adapter, eval_file;
  double trainer_eval_loss = 0;
};

// A tiny base, 8 LoRA steps on the bundled corpus (text: every token is a target, in `train`
// and in `eval` alike), evaluated by the trainer on the same corpus at its end.
const Trained& trained() {
  static const Trained t = [] {
    Trained t;
    t.dir = temp_dir();
    t.base = t.dir / "base";
    const fs::path src = source_dir();
    auto init = run(memtune_bin() + " init-model --preset tiny-llama --seed 3 --out " + t.base.string() +
                    " --tokenizer " + (src / "examples/tiny-tokenizer").string());
    EXPECT_EQ(init.exit_code, 0) << init.output;
    t.eval_file = src / "examples/data/corpus.jsonl";
    auto train = run(memtune_bin() + " train " + (src / "configs/quickstart.yaml").string() +
                     " runtime.device=cpu model.name_or_path=" + t.base.string() +
                     " model.tokenizer=null model.quantization_config.load_in_4bit=false"
                     " data.format=text data.train_file=" + t.eval_file.string() +
                     " data.eval_file=" + t.eval_file.string() + " data.max_seq_length=64 data.cache_dir=" +
                     (t.dir / "cache").string() + " training.output_dir=" + (t.dir / "run").string() +
                     " training.max_steps=8 training.eval_steps=8 training.eval_accuracy_rows=0 training.save_steps=0"
                     " training.per_device_train_batch_size=4 training.gradient_accumulation_steps=1"
                     " training.learning_rate=0.01 memory.device_limit=null lora.r=4 lora.lora_alpha=8");
    EXPECT_EQ(train.exit_code, 0) << train.output;
    t.adapter = t.dir / "run/adapter";
    for (const auto& row : read_jsonl(t.dir / "run/metrics.jsonl", "eval_loss"))
      t.trainer_eval_loss = row["eval_loss"].get<double>();
    return t;
  }();
  return t;
}

json eval_json(const fs::path& model, const std::string& extra) {
  const Trained& t = trained();
  auto r = run(memtune_bin() + " eval --model " + model.string() + " --data " + t.eval_file.string() +
               " --format text --max-seq-length 64 --json " + extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.rfind('{');
  return at == std::string::npos ? json::object() : json::parse(r.output.substr(at));
}

std::string generate(const fs::path& model, const std::string& extra) {
  auto r = run(memtune_bin() + " generate --model " + model.string() + " --prompt 'Every morning the' " +
               "--max-new-tokens 12 " + extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

TEST(Inference, EvalOfTheAdapterEqualsTheTrainersFinalEvaluation) {
  const Trained& t = trained();
  ASSERT_GT(t.trainer_eval_loss, 0);
  json with = eval_json(t.base, "--adapter " + t.adapter.string());
  json without = eval_json(t.base, "");
  EXPECT_NEAR(with["loss"].get<double>(), t.trainer_eval_loss, 1e-5 * t.trainer_eval_loss);
  // The adapter learned something: the base alone does worse on the same tokens.
  EXPECT_EQ(with["tokens"], without["tokens"]);
  EXPECT_GT(without["loss"].get<double>(), with["loss"].get<double>() + 0.05);
}

TEST(Inference, MergedModelComputesWhatBasePlusAdapterDoes) {
  const Trained& t = trained();
  const fs::path merged = t.dir / "merged";
  auto r = run(memtune_bin() + " merge --model " + t.base.string() + " --adapter " + t.adapter.string() + " --out " +
               merged.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NEAR(eval_json(merged, "")["loss"].get<double>(),
              eval_json(t.base, "--adapter " + t.adapter.string())["loss"].get<double>(), 1e-5);
  EXPECT_EQ(generate(merged, "--greedy"), generate(t.base, "--adapter " + t.adapter.string() + " --greedy"));
  // --dtype bf16 writes bf16 tensors and says so in config.json.
  const fs::path half = t.dir / "merged-bf16";
  auto h = run(memtune_bin() + " merge --model " + t.base.string() + " --adapter " + t.adapter.string() + " --out " +
               half.string() + " --dtype bf16");
  ASSERT_EQ(h.exit_code, 0) << h.output;
  EXPECT_EQ(json::parse(read_file(half / "config.json"))["torch_dtype"], "bfloat16");
  models::SafetensorsFile f(half / "model.safetensors");
  EXPECT_EQ(f.info("model.layers.0.self_attn.q_proj.weight").dtype, at::kBFloat16);
}

// `memtune quantize --quant-type`: bitsandbytes' state of either code, which eval reads back;
// each quantized model computes nearly what the dense one does, and not exactly.
TEST(Inference, QuantizeWritesEitherCodeAndEvalReadsIt) {
  const Trained& t = trained();
  const double dense = eval_json(t.base, "")["loss"].get<double>();
  for (const std::string type : {"nf4", "fp4"}) {
    const fs::path out = t.dir / ("quantized-" + type);
    auto r = run(memtune_bin() + " quantize --model " + t.base.string() + " --out " + out.string() +
                 " --quant-type " + type);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(json::parse(read_file(out / "config.json"))["quantization_config"]["bnb_4bit_quant_type"], type);
    models::SafetensorsFile f(out / "model.safetensors");
    EXPECT_TRUE(f.contains("model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__" + type)) << type;
    const double loss = eval_json(out, "")["loss"].get<double>();
    EXPECT_NEAR(loss, dense, 0.05 * dense) << type;
    EXPECT_NE(loss, dense) << type;
  }
  auto bad = run(memtune_bin() + " quantize --model " + t.base.string() + " --out " + (t.dir / "q-int4").string() +
                 " --quant-type int4");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("int4"), std::string::npos) << bad.output;
}

TEST(Inference, ASeedReplaysTheSampledText) {
  const Trained& t = trained();
  const std::string args = "--adapter " + t.adapter.string() + " --temperature 1.5 --top-p 0.95 --seed 11";
  EXPECT_EQ(generate(t.base, args), generate(t.base, args));
}

TEST(Inference, DeviceFlagIsCheckedAndCpuIsTheDefault) {
  const Trained& t = trained();
  EXPECT_EQ(eval_json(t.base, "--device cpu")["loss"], eval_json(t.base, "")["loss"]);
  auto bad = run(memtune_bin() + " eval --model " + t.base.string() + " --data " + t.eval_file.string() +
                 " --device gpu0");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--device: 'gpu0' is not a device"), std::string::npos) << bad.output;
}

// --dtype bf16: the model kept and run in bf16, as from_pretrained(dtype=torch.bfloat16) (its
// losses against transformers': docs/interop.md, group bf16). It computes nearly what fp32
// does, and not exactly; fp16 has no CPU matmul and is refused by name, as is a dtype that is none.
TEST(Inference, DtypeBf16RunsTheModelInBf16AndFp16IsRefusedOnTheCpu) {
  const Trained& t = trained();
  const double fp32 = eval_json(t.base, "--adapter " + t.adapter.string())["loss"].get<double>();
  const double bf16 = eval_json(t.base, "--adapter " + t.adapter.string() + " --dtype bf16")["loss"].get<double>();
  EXPECT_NEAR(bf16, fp32, 0.02 * fp32);
  EXPECT_NE(bf16, fp32);
  EXPECT_FALSE(generate(t.base, "--adapter " + t.adapter.string() + " --greedy --dtype bf16").empty());
  for (const auto& [dtype, says] : {std::pair<std::string, std::string>{"fp16", "CPUs have no fp16 matmul"},
                                    {"int8", "--dtype 'int8' (fp32, fp16, bf16)"}}) {
    auto bad = run(memtune_bin() + " eval --model " + t.base.string() + " --data " + t.eval_file.string() +
                   " --dtype " + dtype);
    EXPECT_EQ(bad.exit_code, 2) << bad.output;
    EXPECT_NE(bad.output.find(says), std::string::npos) << bad.output;
  }
}

TEST(Inference, TopPZeroKeepsTheMostLikelyTokenAsTransformersDoes) {
  // transformers' TopPLogitsWarper always keeps one token (min_tokens_to_keep = 1): top_p 0
  // samples only the most likely token, so the text is the greedy text whatever the seed.
  const Trained& t = trained();
  EXPECT_EQ(generate(t.base, "--top-p 0 --seed 5"), generate(t.base, "--greedy"));
}

// Each bad argument: exit 2 (bad input) and a message that names it; nothing written.
TEST(Inference, BadArgumentsAndMismatchedFilesAreRefusedClearly) {
  const Trained& t = trained();
  const fs::path d = t.dir / "bad-arguments";
  fs::create_directories(d);
  auto expect_refused = [](const std::string& args, const std::string& message) {
    auto r = run(memtune_bin() + " " + args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  };
  const std::string gen = "generate --model " + t.base.string() + " --prompt 'Every morning' ";
  expect_refused(gen + "--top-p 1.5", "top_p is 1.5");
  expect_refused(gen + "--temperature nan", "temperature is nan");
  expect_refused(gen + "--temperature -1", "temperature is -1");
  const std::string eval = "eval --model " + t.base.string() + " --data " + t.eval_file.string() + " ";
  expect_refused(eval + "--batch 0", "--batch");
  // CLI usage errors are bad input too (CLI11's own codes were 105-115).
  expect_refused("eval --data " + t.eval_file.string(), "--model is required");
  expect_refused("generate --model " + t.base.string() + " --prompt x --no-such-flag", "--no-such-flag");
  // A tokenizer with more ids than the model has embedding rows.
  write_file(d / "small.json", json{{"model_type", "llama"}, {"vocab_size", 500}, {"hidden_size", 32},
                                    {"intermediate_size", 64}, {"num_hidden_layers", 1},
                                    {"num_attention_heads", 2}}.dump());
  auto init = run(memtune_bin() + " init-model --config " + (d / "small.json").string() + " --out " +
                  (d / "small").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const std::string tok = " --tokenizer " + (source_dir() / "examples/tiny-tokenizer").string();
  expect_refused("eval --model " + (d / "small").string() + " --data " + t.eval_file.string() + tok,
                 "the tokenizer has 1024 ids but the model's vocab_size is 500");
  expect_refused("generate --model " + (d / "small").string() + " --prompt hello" + tok,
                 "the tokenizer has 1024 ids but the model's vocab_size is 500");
  // --out naming a file.
  write_file(d / "a-file", "x");
  expect_refused("quantize --model " + t.base.string() + " --out " + (d / "a-file").string(),
                 "exists and is not a directory");
  EXPECT_EQ(read_file(d / "a-file"), "x");
  // Sizes no real model has: refused by key before any allocation (was a 4 PB attempt).
  write_file(d / "huge.json", json{{"model_type", "llama"}, {"vocab_size", 500}, {"hidden_size", int64_t{1} << 40},
                                   {"intermediate_size", 64}, {"num_hidden_layers", 1},
                                   {"num_attention_heads", 2}}.dump());
  expect_refused("init-model --config " + (d / "huge.json").string() + " --out " + (d / "h").string(),
                 "hidden_size is 1099511627776");
  write_file(d / "big.json", json{{"model_type", "llama"}, {"vocab_size", 1 << 24}, {"hidden_size", 1 << 20},
                                  {"intermediate_size", 64}, {"num_hidden_layers", 1},
                                  {"num_attention_heads", 2}}.dump());
  expect_refused("init-model --config " + (d / "big.json").string() + " --out " + (d / "b").string(),
                 "past the 10T memtune accepts");
  EXPECT_FALSE(fs::exists(d / "h"));
  EXPECT_FALSE(fs::exists(d / "b"));
}

TEST(Inference, OnTheGpuEvalAndGreedyTextEqualTheCpus_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const Trained& t = trained();
  const std::string adapter = "--adapter " + t.adapter.string();
  EXPECT_NEAR(eval_json(t.base, adapter + " --device cuda")["loss"].get<double>(),
              eval_json(t.base, adapter)["loss"].get<double>(), 1e-4);
  EXPECT_EQ(generate(t.base, adapter + " --greedy --device cuda"), generate(t.base, adapter + " --greedy"));
  const std::string sampled = adapter + " --temperature 1.2 --seed 5";
  EXPECT_EQ(generate(t.base, sampled + " --device cuda"), generate(t.base, sampled));
}

}  // namespace
}  // namespace memtune::testing
