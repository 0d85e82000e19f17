// distributed.sharding end to end: `memtune launch` with 2 and 3 CPU processes (Gloo on
// 127.0.0.1) against one process on the same global batch, for each level, optimizer and
// fine-tuning mode; the optimizer state split into one shard per rank that add up to the
// one process's state; a stop mid-run resumed equal to the straight run; and a resume under
// another world size (the state resharded by name) equal to the run that kept its size.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/units.h"
#include "test_util.h"
#include "trainer/train_state.h"

namespace memtune::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string base_config(const fs::path& out) {
  fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "  quantization_config: {load_in_4bit: true, bnb_4bit_compute_dtype: auto}\n"
         "lora: {r: 4, lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear}\n"
         "runtime: {device: cpu}\n"
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  per_device_train_batch_size: 2\n"
         "  gradient_accumulation_steps: 1\n"
         "  learning_rate: 1.0e-3\n"
         "  max_steps: 4\n"
         "  logging_steps: 1\n"
         "  lr_scheduler_type: linear\n"
         "  warmup_steps: 1\n"
         "  max_grad_norm: 1.0\n"  // clipping on: the global norm must be the one process's
         "  seed: 7\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 64\n"
         "  cache_dir: " + (out.parent_path() / "cache").string() + "\n"
         "distributed: {timeout: 120}\n";
}

fs::path write_config(const fs::path& dir) {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", base_config(dir / "out"));
  return dir / "config.yaml.in";
}

std::string train_cmd(const fs::path& config, const std::string& overrides) {
  return memtune_bin() + " train " + config.string() + " " + overrides;
}

std::string launch_cmd(int nproc, const fs::path& config, const std::string& overrides) {
  return memtune_bin() + " launch --standalone --stop-timeout 5 --nproc-per-node " + std::to_string(nproc) +
         " -- train " + config.string() + " " + overrides;
}

std::vector<double> step_losses(const fs::path& out) {
  std::vector<double> l;
  for (const auto& m : read_jsonl(out / "metrics.jsonl", "loss")) l.push_back(m["loss"].get<double>());
  return l;
}

void expect_same_losses(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol * std::max(1.0, std::abs(b[i]))) << "step " << i;
}

int64_t bytes_of(const std::map<std::string, at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& [name, t] : tensors) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

// The optimizer state of a checkpoint: whole, or every shard its index names.
std::map<std::string, at::Tensor> optimizer_state(const fs::path& ck) {
  if (fs::exists(ck / "optimizer.safetensors")) return load_all_tensors(ck / "optimizer.safetensors");
  std::map<std::string, at::Tensor> all;
  const json index = json::parse(read_file(ck / "optimizer.safetensors.index.json"));
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  for (const auto& f : files)
    for (auto& [name, t] : load_all_tensors(ck / f)) EXPECT_TRUE(all.emplace(name, t).second) << name << " twice";
  return all;
}

struct Case {
  std::string level;
  int world;
  std::string optim;
  std::string finetune;  // lora (QLoRA) | full (dense base, every weight)
  double tol;
  std::string extra = "";  // more overrides
  std::string tag = "";    // in the test's name
};

void PrintTo(const Case& k, std::ostream* os) {
  *os << k.level << " W=" << k.world << " " << k.optim << " " << k.finetune << " " << k.extra;
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  return info.param.level + "_W" + std::to_string(info.param.world) + "_" + info.param.optim + "_" + info.param.finetune +
         info.param.tag;
}

class ShardedRun : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedRun, EqualsOneProcessOnTheGlobalBatch) {
  MEMTUNE_REQUIRE_GLOO();
  const Case k = GetParam();
  fs::path d = temp_dir();
  std::string common = "training.optim=" + k.optim + " training.save_steps=2";
  if (k.optim == "sgd") common += " training.momentum=0.9 training.learning_rate=0.05";
  if (k.finetune == "full") common += " training.finetune=full model.quantization_config.load_in_4bit=false";
  common += " " + k.extra;
  auto one = run(train_cmd(write_config(d / "one"), common + " training.per_device_train_batch_size=" +
                                                        std::to_string(2 * k.world)),
                 600);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto many = run(launch_cmd(k.world, write_config(d / "many"), common + " distributed.sharding=" + k.level), 600);
  ASSERT_EQ(many.exit_code, 0) << many.output;

  expect_same_losses(step_losses(d / "one/out"), step_losses(d / "many/out"), k.tol);
  // The same steps skipped (fp16 overflow: every rank agrees) at the same loss scales.
  const auto rows_one = read_jsonl(d / "one/out/metrics.jsonl", "loss");
  const auto rows_many = read_jsonl(d / "many/out/metrics.jsonl", "loss");
  ASSERT_EQ(rows_one.size(), rows_many.size());
  for (size_t i = 0; i < rows_one.size(); ++i) {
    EXPECT_EQ(rows_one[i]["events"].dump(), rows_many[i]["events"].dump()) << "step " << i;
    EXPECT_EQ(rows_one[i]["loss_scale"], rows_many[i]["loss_scale"]) << "step " << i;
  }
  if (k.extra.find("optimizer_offload=cpu") != std::string::npos) {  // every rank's gradients left the device
    size_t at = 0;
    int ranks = 0;
    while ((at = many.output.find("gradients (", at)) != std::string::npos) ++ranks, ++at;
    EXPECT_EQ(ranks, k.world) << many.output;
  }
  if (k.extra.find("fp16") != std::string::npos) {
    EXPECT_NE(rows_many.front()["events"].dump().find("skip"), std::string::npos) << "the first step overflowed";
  }
  if (k.finetune == "lora")
    expect_same_tensors(d / "one/out/adapter/adapter_model.safetensors", d / "many/out/adapter/adapter_model.safetensors",
                        k.tol);
  else
    expect_same_tensors(d / "one/out/model/model.safetensors", d / "many/out/model/model.safetensors", k.tol);

  // Every rank owns a share and says so; the rest of the state lives elsewhere.
  for (int r = 0; r < k.world; ++r)
    EXPECT_NE(many.output.find(str_cat("distributed.sharding: ", k.level, ": rank ", r, " of ", k.world, " owns")),
              std::string::npos) << many.output;
  if (k.level == "gradients") {
    EXPECT_NE(many.output.find("the exact equivalent of a reduce-scatter"), std::string::npos);
  }
  if (k.level == "full") {
    for (int r = 0; r < k.world; ++r) {
      EXPECT_NE(many.output.find(str_cat("distributed.sharding: full: rank ", r, " of ", k.world, " keeps ")),
                std::string::npos) << many.output;
    }
  }

  // The last checkpoint's optimizer state: one shard per rank, each within one tensor of
  // 1/W, together the one process's state (to the run's tolerance).
  const fs::path ck_one = d / "one/out/checkpoints/step-4", ck = d / "many/out/checkpoints/step-4";
  ASSERT_TRUE(fs::exists(ck / "optimizer.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(ck / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(d / "many/out/checkpoints/step-4.shards")) << "the staging directory is gone";
  const auto whole = optimizer_state(ck_one), sharded = optimizer_state(ck);
  ASSERT_EQ(whole.size(), sharded.size());
  int64_t largest = 0;
  for (const auto& [name, t] : whole) {
    ASSERT_TRUE(sharded.count(name)) << name;
    largest = std::max<int64_t>(largest, 2 * t.numel() * static_cast<int64_t>(t.element_size()));
    if (t.scalar_type() == at::kFloat) {
      EXPECT_TRUE(at::allclose(sharded.at(name), t, 1e-4, 1e-7)) << name;  // moments of gradients equal to ~1e-6
    }
  }
  int shards = 0;
  for (int r = 0; r < k.world; ++r) {
    const fs::path f = ck / str_cat("optimizer-0000", r + 1, "-of-0000", k.world, ".safetensors");
    ASSERT_TRUE(fs::exists(f)) << f;
    ++shards;
    EXPECT_LE(bytes_of(load_all_tensors(f)), bytes_of(whole) / k.world + largest) << f;
  }
  EXPECT_EQ(shards, k.world);

  // Each step's row names the bytes every rank sent.
  for (const auto& row : read_jsonl(d / "many/out/metrics.jsonl", "loss")) {
    ASSERT_TRUE(row.contains("sent_bytes")) << row.dump();
    ASSERT_EQ(row["sent_bytes"].size(), static_cast<size_t>(k.world));
    for (const auto& b : row["sent_bytes"]) EXPECT_GT(b.get<int64_t>(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Levels, ShardedRun,
    ::testing::Values(Case{"optimizer", 2, "sgd", "lora", 1e-6}, Case{"optimizer", 3, "adamw", "lora", 1e-5},
                      Case{"gradients", 2, "adamw", "lora", 1e-5}, Case{"gradients", 3, "sgd", "lora", 1e-6},
                      Case{"optimizer", 2, "adamw", "full", 1e-5}, Case{"gradients", 3, "adamw", "full", 1e-5},
                      Case{"gradients", 2, "sgd", "full", 1e-6}, Case{"optimizer", 3, "adamw_8bit", "lora", 1e-5},
                      Case{"gradients", 2, "paged_adamw_8bit", "lora", 1e-5},
                      Case{"gradients", 3, "paged_adamw_32bit", "lora", 1e-5},
                      Case{"optimizer", 2, "adafactor", "full", 1e-5},
                      // Gradient offload (memory.optimizer_offload: cpu) on a CPU group: each rank's
                      // gradients in host buffers, reduced there, at each level.
                      Case{"optimizer", 2, "adamw", "full", 1e-5, "memory.optimizer_offload=cpu", "_grad_offload"},
                      Case{"gradients", 3, "adamw", "lora", 1e-5, "memory.optimizer_offload=cpu", "_grad_offload"},
                      Case{"full", 2, "adamw", "lora", 1e-5, "memory.optimizer_offload=cpu", "_grad_offload"},
                      Case{"gradients", 2, "adamw", "full", 1e-5, "model.name_or_path=tiny-gpt2", "_tied_gpt2"},
                      Case{"gradients", 3, "adamw", "lora", 1e-5, "training.fp16=true training.fp16_init_scale=1e39",
                           "_fp16_overflow"},
                      // full: the layers' frozen base sharded too (QLoRA, a dense base, GPT-2's biases and
                      // LayerNorms), with evaluations, whose forwards gather as training's do.
                      Case{"full", 2, "sgd", "lora", 1e-6}, Case{"full", 3, "adamw", "lora", 1e-5},
                      // full with a full fine-tune: the layers' trainable weights sharded (the
                      // embeddings and head whole; GPT-2's tied).
                      Case{"full", 2, "adamw", "full", 1e-5, "", "_full_finetune"},
                      Case{"full", 3, "sgd", "full", 1e-6, "model.name_or_path=tiny-gpt2", "_gpt2_full_finetune"},
                      Case{"full", 2, "adamw", "lora", 1e-5, "model.quantization_config.load_in_4bit=false", "_dense"},
                      // A bf16 model's base (model.torch_dtype), dense: its bf16 tensors sharded and gathered.
                      Case{"full", 2, "adamw", "lora", 1e-5,
                           "model.quantization_config.load_in_4bit=false model.torch_dtype=bfloat16 training.bf16=true",
                           "_bf16_model"},
                      Case{"full", 3, "adamw", "lora", 1e-5, "distributed.prefetch=false", "_no_prefetch"},
                      // DoRA's magnitudes gathered and trained inside the sharded layers.
                      Case{"full", 2, "adamw", "lora", 1e-5, "lora.use_dora=true", "_qdora"},
                      // lora.bias: all: GPT-2's biases (its LayerNorms' too) trained inside the sharded
                      // layers beside the adapters, saved in the adapter.
                      Case{"full", 2, "adamw", "lora", 1e-5, "model.name_or_path=tiny-gpt2 lora.bias=all", "_gpt2_bias_all"},
                      // An LLM.int8 base (load_in_8bit), each rank quantizing its own copy.
                      Case{"gradients", 2, "adamw", "lora", 1e-5,
                           "model.quantization_config.load_in_4bit=false model.quantization_config.load_in_8bit=true "
                           "model.quantization_config.bnb_4bit_compute_dtype=float32",
                           "_int8"},
                      Case{"full", 3, "adamw", "lora", 1e-5,
                           "model.name_or_path=tiny-gpt2 data.eval_file=" +
                               (source_dir() / "examples/data/tasks_eval.jsonl").string() +
                               " training.eval_steps=2 training.eval_accuracy_rows=4",
                           "_gpt2_eval"}),
    name_of);

// One rank runs out of memory while the others go on; every rank learns it, drops the
// step, shrinks and runs the same samples again: the losses and the adapter are the clean
// run's. gradients: in the optimizer phase, after the gradients were reduced to their
// owners and dropped elsewhere; before a backward or in a forward, while the others reduce
// their buckets in backward and learn it there. full: inside the layers (forward, or the
// reruns of backward), while the others run on to their next gather, where they learn it.
class ShardedOom : public ::testing::TestWithParam<std::tuple<std::string, int, std::string>> {};

TEST_P(ShardedOom, EveryRankRetriesTheStepAndTheMathStays) {
  MEMTUNE_REQUIRE_GLOO();
  const auto [level, world, point] = GetParam();
  fs::path d = temp_dir();
  const std::string args = "training.optim=adamw distributed.sharding=" + level;
  auto clean = run(launch_cmd(world, write_config(d / "clean"), args), 600);
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  auto oom = run(launch_cmd(world, write_config(d / "oom"), args + " memory.inject_oom=" + point), 600);
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  const auto rows = read_jsonl(d / "oom/out/metrics.jsonl", "loss");
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_NE(rows[2]["events"].dump().find("oom"), std::string::npos) << rows[2].dump();
  EXPECT_EQ(rows[2]["micro_batch"], 1) << rows[2].dump();
  expect_same_losses(step_losses(d / "clean/out"), step_losses(d / "oom/out"), 1e-5);
  expect_same_tensors(d / "clean/out/adapter/adapter_model.safetensors", d / "oom/out/adapter/adapter_model.safetensors",
                      1e-5);
}

INSTANTIATE_TEST_SUITE_P(Points, ShardedOom,
                         ::testing::Values(std::make_tuple("gradients", 2, "2:optimizer:1"),
                                           // in backward, where the others reduce their buckets
                                           std::make_tuple("gradients", 3, "2:backward:1"),
                                           std::make_tuple("gradients", 2, "2:forward:0"),
                                           std::make_tuple("full", 2, "2:forward:1"),
                                           std::make_tuple("full", 3, "2:backward:1"),
                                           std::make_tuple("full", 3, "2:forward:0")),
                         [](const auto& info) {
                           std::string p = std::get<2>(info.param);
                           for (char& c : p)
                             if (c == ':') c = '_';
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param)) + "_step" + p;
                         });

// A tied Llama of `layers` layers of width 256 (vocab 1024, a dense fp32 base) in HF format
// at d/model, random weights (memtune init-model).
void init_llama(const fs::path& d, int layers) {
  const json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", 256},
                    {"intermediate_size", 1024}, {"num_hidden_layers", layers}, {"num_attention_heads", 4},
                    {"num_key_value_heads", 4}, {"head_dim", 64}, {"hidden_act", "silu"},
                    {"max_position_embeddings", 1024}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                    {"tie_word_embeddings", true}, {"vocab_size", 1024}, {"bos_token_id", 1019},
                    {"eos_token_id", 1020}, {"torch_dtype", "float32"}};
  fs::create_directories(d / "spec");
  write_file(d / "spec/config.json", cfg.dump(1));
  auto init = run(memtune_bin() + " init-model --config " + (d / "spec/config.json").string() + " --out " +
                  (d / "model").string() + " --tokenizer " + (source_dir() / "examples/tiny-tokenizer").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
}

// memory_report.txt's "peak at load" (rank 0's).
int64_t load_peak(const fs::path& out) {
  const std::string r = read_file(out / "memory_report.txt");
  const size_t at = r.find("peak at load:");
  EXPECT_NE(at, std::string::npos) << r;
  std::string v = r.substr(at + 13, r.find('\n', at) - at - 13);
  v.erase(0, v.find_first_not_of(' '));
  return parse_size(v, "peak at load").bytes;
}

// The point of distributed.sharding: full: a model that does not fit one rank's
// memory.device_limit trains on 3 ranks with that limit each. A Llama whose layers hold most
// of its bytes (8 layers of hidden 256, a dense fp32 base: 32 MiB of its 33) under 28 MiB:
// one process is refused before loading (every saving estimated at 36.6 MiB), so are 3 ranks
// sharding only the optimizer state and gradients; with the layers sharded each rank keeps
// 1/3 of them plus the layer it runs, and the run's losses and adapter are those of the
// 3-rank run without a limit.
TEST(ShardedFull, AModelThatDoesNotFitOneRanksLimitTrainsOnThreeRanks) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  ASSERT_NO_FATAL_FAILURE(init_llama(d, 8));
  const std::string args = "model.name_or_path=" + (d / "model").string() +
                           " model.quantization_config.load_in_4bit=false training.per_device_train_batch_size=1 "
                           "\"memory.on_oom.ladder=[micro_batch,checkpointing,activation_offload,optimizer_offload]\"";
  const std::string limit = " memory.device_limit=28MiB";

  auto one = run(train_cmd(write_config(d / "one"), args + limit), 600);
  EXPECT_EQ(one.exit_code, 3) << one.output;
  EXPECT_NE(one.output.find("cannot fit in 28.00 MiB"), std::string::npos) << one.output;
  auto zero2 = run(launch_cmd(3, write_config(d / "zero2"), args + limit + " distributed.sharding=gradients"), 600);
  EXPECT_NE(zero2.exit_code, 0) << zero2.output;
  EXPECT_NE(zero2.output.find("cannot fit in 28.00 MiB"), std::string::npos) << zero2.output;

  auto free = run(launch_cmd(3, write_config(d / "free"), args + " distributed.sharding=gradients"), 600);
  ASSERT_EQ(free.exit_code, 0) << free.output;
  auto full = run(launch_cmd(3, write_config(d / "full"), args + limit + " distributed.sharding=full"), 600);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(full.output.find(str_cat("[rank ", r, "] distributed.sharding: full: rank ", r, " of 3 keeps ")),
              std::string::npos) << full.output;
  expect_same_losses(step_losses(d / "free/out"), step_losses(d / "full/out"), 1e-5);
  expect_same_tensors(d / "free/out/adapter/adapter_model.safetensors", d / "full/out/adapter/adapter_model.safetensors",
                      1e-5);
  // Each rank read only its share of the layers from the checkpoint: the peak while loading
  // (the memory report's, rank 0) is under half the unsharded run's.
  EXPECT_LT(load_peak(d / "full/out"), load_peak(d / "free/out") / 2);

  // QLoRA from the same directory: the skipped projections are quantized by their owners
  // (their nested offsets reach the others at sharding), and the run equals `gradients`.
  const std::string qlora = args + " model.quantization_config.load_in_4bit=true";
  auto q2 = run(launch_cmd(3, write_config(d / "q2"), qlora + " distributed.sharding=gradients"), 600);
  ASSERT_EQ(q2.exit_code, 0) << q2.output;
  auto q3 = run(launch_cmd(3, write_config(d / "q3"), qlora + " distributed.sharding=full"), 600);
  ASSERT_EQ(q3.exit_code, 0) << q3.output;
  expect_same_losses(step_losses(d / "q2/out"), step_losses(d / "q3/out"), 1e-5);
  expect_same_tensors(d / "q2/out/adapter/adapter_model.safetensors", d / "q3/out/adapter/adapter_model.safetensors",
                      1e-5);

  // Rank 0's measured step peaks against the memory model's per-rank figure for full.
  auto est = run(memtune_bin() + " estimate " + write_config(d / "est").string() + " --nproc 3 --json " + args +
                 " distributed.sharding=full");
  ASSERT_EQ(est.exit_code, 0) << est.output;
  const json e = json::parse(est.output);
  const int64_t predicted = e["peak_bytes"].get<int64_t>();
  EXPECT_LT(predicted, int64_t{28} << 20);
  for (const auto& row : read_jsonl(d / "full/out/metrics.jsonl", "loss")) {
    EXPECT_EQ(row["events"].dump().find("oom"), std::string::npos) << "no out-of-memory error: " << row.dump();
    const int64_t peak = row["memory"]["cpu"]["peak"].get<int64_t>();
    EXPECT_LE(peak, predicted) << row.dump();
    EXPECT_GE(peak, predicted * 8 / 10) << row.dump();
  }
}

// A full fine-tune under `full` from a Hugging Face directory: each rank reads only its share
// of the layers' weights from the checkpoint (the others' stay on disk), and the run equals one
// process on the same global batch. A tied Llama of 4 layers of width 256 (17 MiB of fp32, 16
// of them in the layers) on 3 ranks.
TEST(ShardedFull, AFullFineTuneReadsItsShareOfTheLayers) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  ASSERT_NO_FATAL_FAILURE(init_llama(d, 4));
  const std::string args = "model.name_or_path=" + (d / "model").string() +
                           " model.quantization_config.load_in_4bit=false training.finetune=full "
                           "training.optim=adamw training.max_steps=3 training.save_steps=0";
  auto one = run(train_cmd(write_config(d / "one"), args + " training.per_device_train_batch_size=3"), 600);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto full = run(launch_cmd(3, write_config(d / "full"), args + " training.per_device_train_batch_size=1 "
                                                                 "distributed.sharding=full"),
                  600);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  expect_same_losses(step_losses(d / "one/out"), step_losses(d / "full/out"), 1e-5);
  expect_same_tensors(d / "one/out/model/model.safetensors", d / "full/out/model/model.safetensors", 1e-5);
  // Rank 0 keeps about a third of the layers; while a layer's share moves into its packed
  // buffer, that share is there twice (one layer's at most), so the peak stays more than a
  // third of the layers under the one process's, which read them all.
  const int64_t layers = 4 * (4 * (4 * 256 * 256 + 3 * 256 * 1024) + 2 * 256 * 4);
  EXPECT_LT(load_peak(d / "full/out"), load_peak(d / "one/out") - layers / 3);
}

// QDoRA under `full` (FSDP + QDoRA's recipe) from a Hugging Face directory: each rank reads
// only its share of the layers' weights, and DoRA's magnitudes start at the row norms of
// weights that only their owners read (share_dora_magnitudes: rank 0, whose values every
// rank's adapters start from, has a third of them). The run equals one process. NF4, and a
// dense base.
TEST(ShardedFull, DoraMagnitudesComeFromEachWeightsOwner) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  ASSERT_NO_FATAL_FAILURE(init_llama(d, 4));
  for (const char* base : {"true", "false"}) {
    const fs::path run_dir = d / (std::string("nf4_") + base);
    const std::string args = "model.name_or_path=" + (d / "model").string() +
                             " model.quantization_config.load_in_4bit=" + base +
                             " lora.use_dora=true training.optim=adamw training.max_steps=3 training.save_steps=0";
    auto one = run(train_cmd(write_config(run_dir / "one"), args + " training.per_device_train_batch_size=3"), 600);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    auto full = run(launch_cmd(3, write_config(run_dir / "full"),
                               args + " training.per_device_train_batch_size=1 distributed.sharding=full"),
                    600);
    ASSERT_EQ(full.exit_code, 0) << full.output;
    EXPECT_NE(full.output.find("[rank 0] DoRA: 28 magnitudes from the row norms of their weights' owners"),
              std::string::npos) << full.output;
    expect_same_losses(step_losses(run_dir / "one/out"), step_losses(run_dir / "full/out"), 1e-5);
    expect_same_tensors(run_dir / "one/out/adapter/adapter_model.safetensors",
                        run_dir / "full/out/adapter/adapter_model.safetensors", 1e-5);
  }
}

// What each level keeps per rank, measured: a full fine-tune of tiny-llama with SGD (its
// buffer sharded alike at every level) on 3 ranks, 2 micro-batches a step, every layer
// checkpointed (as `full` must), 1 MiB buckets; rank 0's step peaks:
//   gradients (ZeRO-2): each bucket goes to its owner as backward completes it, so no rank
//     holds every gradient: lower than `optimizer` (every gradient all-reduced, held whole,
//     with the all-reduce's flat copy) by the other ranks' share of the gradients and the
//     copy, less what may be in flight (a bucket and the tensor that completes it);
//   full (ZeRO-3): the layers' weights too, 1/W of them kept: lower than `gradients` by the
//     other ranks' share of the layers' weights, less the layer gathered.
// The losses and weights are the same at every level, and the memory model's per-rank peaks
// are what was measured.
TEST(ShardedLevels, EachLevelKeepsLessPerRank) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  const std::string args = "training.finetune=full model.quantization_config.load_in_4bit=false training.optim=sgd "
                           "training.learning_rate=0.05 training.per_device_train_batch_size=1 "
                           "training.gradient_accumulation_steps=2 training.gradient_checkpointing=true "
                           "distributed.bucket_size_mb=1 training.save_steps=0";
  const std::vector<std::string> levels = {"optimizer", "gradients", "full"};
  for (const auto& level : levels) {
    auto r = run(launch_cmd(3, write_config(d / level), args + " distributed.sharding=" + level), 600);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  for (const std::string level : {"gradients", "full"}) {
    expect_same_losses(step_losses(d / "optimizer/out"), step_losses(d / level / "out"), 1e-6);
    expect_same_tensors(d / "optimizer/out/model/model.safetensors", d / level / "out/model/model.safetensors", 1e-6);
  }

  auto est = run(memtune_bin() + " estimate " + write_config(d / "est").string() + " --nproc 3 --json " + args +
                 " distributed.sharding=gradients");
  ASSERT_EQ(est.exit_code, 0) << est.output;
  const json e = json::parse(est.output);
  std::map<std::string, json> by;
  for (const auto& l : e["sharding_levels"]) by[l["level"].get<std::string>()] = l;
  const int64_t grads = by["none"]["gradients"].get<int64_t>();
  const int64_t layers = by["full"]["layers_sharded_from"].get<int64_t>();  // the 4 layers' weights, fp32
  const int64_t layer = by["full"]["gathered_layer"].get<int64_t>();
  ASSERT_GT(layers, 0) << e.dump();
  const int64_t largest = int64_t{1024} * 128 * 4;  // the embedding or the head (vocab x hidden fp32), the largest
  auto peaks = [&](const std::string& level) {
    std::vector<int64_t> p;
    for (const auto& row : read_jsonl(d / level / "out/metrics.jsonl", "loss")) p.push_back(row["memory"]["cpu"]["peak"]);
    EXPECT_EQ(p.size(), 4u) << level;
    return p;
  };
  const auto p1 = peaks("optimizer"), p2 = peaks("gradients"), p3 = peaks("full");
  for (size_t i = 0; i < p1.size() && i < p2.size() && i < p3.size(); ++i) {
    // From the second step on, `optimizer` also keeps its all-reduce's flat copy of the
    // gradients (ProcessGroup::allreduce_sum).
    if (i > 0) {
      EXPECT_GE(p1[i] - p2[i], grads + grads * 2 / 3 - (int64_t{1} << 20) - largest) << "step " << i;
    }
    EXPECT_GE(p2[i] - p3[i], layers * 2 / 3 - 2 * layer) << "step " << i;
    // The per-rank estimate bounds each step's peak (it plans for the longest sample; these
    // are shorter), and comes within 20 % of it.
    for (const auto& [level, peak] : {std::pair{"optimizer", p1[i]}, std::pair{"gradients", p2[i]}, std::pair{"full", p3[i]}}) {
      const int64_t predicted = by[level]["peak_bytes"].get<int64_t>();
      EXPECT_LE(peak, predicted) << level << " step " << i;
      EXPECT_GE(peak, predicted * 8 / 10) << level << " step " << i;
    }
  }
}

// Rows written so far (a line being written is skipped).
size_t rows_so_far(const fs::path& metrics) {
  size_t n = 0;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) n += !line.empty() && line.back() == '}' && line.find("\"loss\"") != std::string::npos;
  return n;
}

class ShardedResume : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedResume, AStopMidRunResumedEqualsTheStraightRun) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  const std::string args = "training.max_steps=30 training.optim=adamw distributed.sharding=" + GetParam();
  auto straight = run(launch_cmd(2, write_config(d / "straight"), args), 600);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  const fs::path cfg = write_config(d / "stopped");
  {
    Background launcher(launch_cmd(2, cfg, args), d / "stopped/log");
    auto deadline = Clock::now() + std::chrono::seconds(300);
    while (Clock::now() < deadline && rows_so_far(d / "stopped/out/metrics.jsonl") < 3)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    kill(launcher.pid, SIGTERM);
    ASSERT_EQ(launcher.wait(120), 128 + SIGTERM) << read_file(d / "stopped/log");
  }
  const fs::path ck = trainer::latest_checkpoint(d / "stopped/out");
  ASSERT_FALSE(ck.empty()) << read_file(d / "stopped/log");
  const int64_t stopped_at = std::stoll(ck.filename().string().substr(5));
  ASSERT_LT(stopped_at, 30) << "the stop landed after the run's end: nothing to resume";
  EXPECT_TRUE(fs::exists(ck / "optimizer.safetensors.index.json"));
  auto resumed = run(launch_cmd(2, cfg, args + " training.resume_from_checkpoint=latest"), 600);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find(str_cat("resumed from ", ck.string(), " at step ", stopped_at)), std::string::npos)
      << resumed.output;
  expect_same_losses(step_losses(d / "straight/out"), step_losses(d / "stopped/out"), 1e-5);
  expect_same_tensors(d / "straight/out/adapter/adapter_model.safetensors",
                      d / "stopped/out/adapter/adapter_model.safetensors", 1e-5);
}

// The checkpoint a run of `from` ranks wrote at step 2 continues under `to` ranks (one: a
// plain process), the global batch kept (6 samples), and ends where the `from` run ended.
struct Reshard {
  std::string level;
  int from, to;
  std::string finetune = "lora";  // or full: a dense model, every weight trained
};

void PrintTo(const Reshard& k, std::ostream* os) {
  *os << k.level << " " << k.from << " -> " << k.to << " ranks, " << k.finetune;
}

class ShardedReshard : public ::testing::TestWithParam<Reshard> {};

TEST_P(ShardedReshard, AResumeUnderAnotherWorldSizeEqualsTheRunThatKeptIt) {
  MEMTUNE_REQUIRE_GLOO();
  const Reshard k = GetParam();
  fs::path d = temp_dir();
  std::string args = "training.optim=adamw training.save_steps=2 distributed.sharding=" + k.level;
  if (k.finetune == "full") args += " training.finetune=full model.quantization_config.load_in_4bit=false";
  auto straight = run(launch_cmd(k.from, write_config(d / "straight"),
                                 args + " training.per_device_train_batch_size=" + std::to_string(6 / k.from)),
                      600);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  const fs::path cfg = write_config(d / "moved");
  fs::create_directories(d / "moved/out/checkpoints");
  fs::copy(d / "straight/out/checkpoints/step-2", d / "moved/out/checkpoints/step-2", fs::copy_options::recursive);
  auto cmd = [&](int per_device) {
    const std::string o = args + " training.resume_from_checkpoint=latest training.per_device_train_batch_size=" +
                          std::to_string(per_device);
    return k.to == 1 ? train_cmd(cfg, o) : launch_cmd(k.to, cfg, o);
  };
  // The same per-rank batch on another number of ranks would change the step's samples: refused.
  auto refused = run(cmd(6 / k.from), 600);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("the samples of a step over all ranks must stay the same"), std::string::npos)
      << refused.output;
  auto moved = run(cmd(6 / k.to), 600);
  ASSERT_EQ(moved.exit_code, 0) << moved.output;
  EXPECT_NE(moved.output.find("resumed from"), std::string::npos) << moved.output;
  const auto a = step_losses(d / "straight/out"), b = step_losses(d / "moved/out");
  ASSERT_EQ(a.size(), 4u);
  expect_same_losses(std::vector<double>(a.begin() + 2, a.end()), b, 1e-5);
  const std::string trained = k.finetune == "lora" ? "adapter/adapter_model.safetensors" : "model/model.safetensors";
  expect_same_tensors(d / "straight/out" / trained, d / "moved/out" / trained, 1e-5);
  const fs::path ck = d / "moved/out/checkpoints/step-4";
  if (k.to > 1) {
    const json index = json::parse(read_file(ck / "optimizer.safetensors.index.json"));
    EXPECT_EQ(index["metadata"]["world_size"], std::to_string(k.to));
  } else {
    EXPECT_TRUE(fs::exists(ck / "optimizer.safetensors"));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShardedResume, ::testing::Values("optimizer", "gradients", "full"));
INSTANTIATE_TEST_SUITE_P(Worlds, ShardedReshard,
                         ::testing::Values(Reshard{"optimizer", 3, 2}, Reshard{"gradients", 2, 3},
                                           Reshard{"gradients", 3, 1}, Reshard{"full", 3, 2},
                                           // a full fine-tune's layers sharded: the checkpoint's weights
                                           // are whole, read by the new owners, or one process
                                           Reshard{"full", 2, 3, "full"}, Reshard{"full", 3, 1, "full"}),
                         [](const auto& info) {
                           return str_cat(info.param.level, "_", info.param.from, "_to_", info.param.to,
                                          info.param.finetune == "full" ? "_full_finetune" : "");
                         });

}  // namespace
}  // namespace memtune::testing
