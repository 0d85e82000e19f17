// The real `memtune train` command end to end on tiny configs: QLoRA, LoRA on a dense
// base, full fine-tuning, fp16 loss scaling, bf16, gradient accumulation equal to the big
// batch, exact resume, SIGTERM and SIGKILL, and the memory supervisor (injected and real
// out-of-memory errors) — each checked against an independent run or an invariant.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "test_util.h"
#include "trainer/train_state.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

// A tiny QLoRA run on the bundled tasks: a few seconds per run.
std::string base_config(const fs::path& out) {
  fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "  quantization_config: {load_in_4bit: true, bnb_4bit_quant_type: nf4, bnb_4bit_compute_dtype: auto}\n"
         "lora: {r: 4, lora_alpha: 8, target_modules: all-linear}\n"
         "runtime: {device: cpu}\n"  // CPU budgets and fp32, on a GPU machine too
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  per_device_train_batch_size: 4\n"
         "  gradient_accumulation_steps: 1\n"
         "  learning_rate: 1.0e-3\n"
         "  max_steps: 6\n"
         "  lr_scheduler_type: linear\n"
         "  warmup_steps: 2\n"
         "  seed: 7\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 64\n"
         "  cache_dir: " + (out.parent_path() / "cache").string() + "\n";
}

struct TrainRun {
  int exit_code;
  std::string output;
  fs::path dir;
};

TrainRun train(const fs::path& dir, const std::string& overrides = "", const std::string& config_text = "") {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", config_text.empty() ? base_config(dir / "out") : config_text);
  auto r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides, 600);
  return {r.exit_code, r.output, dir / "out"};
}

std::vector<json> metrics(const fs::path& out) { return read_jsonl(out / "metrics.jsonl"); }

std::vector<double> step_losses(const fs::path& out) {
  std::vector<double> l;
  for (const auto& m : metrics(out))
    if (m.contains("loss")) l.push_back(m["loss"].get<double>());
  return l;
}

void expect_same_losses(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol * std::max(1.0, std::abs(b[i]))) << "step " << i;
}

TEST(Train, QLoraRunLearnsAndWritesPeftAdapter) {
  TrainRun r = train(temp_dir(), "training.max_steps=20 training.learning_rate=3e-3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto losses = step_losses(r.dir);
  ASSERT_EQ(losses.size(), 20u);
  double first = (losses[0] + losses[1]) / 2, last = (losses[18] + losses[19]) / 2;
  EXPECT_LT(last, first * 0.95) << "loss did not fall: " << first << " -> " << last;
  // PEFT's files and key names.
  json cfg = json::parse(read_file(r.dir / "adapter/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  auto adapter = load_all_tensors(r.dir / "adapter/adapter_model.safetensors");
  ASSERT_TRUE(adapter.count("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_EQ(adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].sizes(), at::IntArrayRef({4, 128}));
  EXPECT_EQ(adapter["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].sizes(), at::IntArrayRef({128, 4}));
  EXPECT_TRUE(fs::exists(r.dir / "memory_report.txt"));
  EXPECT_TRUE(fs::exists(r.dir / "config.yaml"));
  EXPECT_TRUE(fs::exists(r.dir / "train.log"));
  EXPECT_NE(r.output.find("NF4 base"), std::string::npos) << r.output;
}

// Keys left out of a config take PEFT's and bitsandbytes' defaults: lora_alpha 8, LoRA on the
// model type's default targets (q_proj and v_proj for Llama), FP4 codes, no double quantization.
TEST(Train, KeysLeftOutTakePeftsDefaults) {
  const fs::path dir = temp_dir();
  std::string config = base_config(dir / "out");
  auto replace = [&](const std::string& from, const std::string& to) {
    ASSERT_NE(config.find(from), std::string::npos) << from;
    config.replace(config.find(from), from.size(), to);
  };
  replace("lora: {r: 4, lora_alpha: 8, target_modules: all-linear}\n", "lora: {r: 4}\n");
  replace("bnb_4bit_quant_type: nf4, ", "");
  TrainRun r = train(dir, "training.max_steps=1", config);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lora.target_modules is not set: PEFT's default for llama, [q_proj, v_proj]"),
            std::string::npos) << r.output;
  json cfg = json::parse(read_file(r.dir / "adapter/adapter_config.json"));
  EXPECT_EQ(cfg["lora_alpha"], 8);
  std::vector<std::string> targets = cfg["target_modules"].get<std::vector<std::string>>();
  std::sort(targets.begin(), targets.end());
  EXPECT_EQ(targets, (std::vector<std::string>{"q_proj", "v_proj"}));
  const auto adapter = load_all_tensors(r.dir / "adapter/adapter_model.safetensors");
  for (const auto& [name, t] : adapter)
    EXPECT_TRUE(name.find(".q_proj.lora_") != std::string::npos || name.find(".v_proj.lora_") != std::string::npos)
        << name;
  EXPECT_EQ(adapter.size(), 2u * 2u * 4u);  // q and v, A and B, tiny-llama's 4 layers
  const std::string effective = read_file(r.dir / "config.yaml");
  EXPECT_NE(effective.find("bnb_4bit_use_double_quant: false"), std::string::npos) << effective;
  EXPECT_NE(effective.find("bnb_4bit_quant_type: fp4"), std::string::npos) << effective;
  EXPECT_NE(r.output.find("FP4 base"), std::string::npos) << r.output;
}

TEST(Train, EffectiveConfigRoundTrips) {
  TrainRun r = train(temp_dir(), "training.max_steps=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The written config trains the same way: run it again and compare the first loss.
  auto again = run(memtune_bin() + " train " + (r.dir / "config.yaml").string() + " training.output_dir=" +
                   (r.dir.parent_path() / "again").string());
  ASSERT_EQ(again.exit_code, 0) << again.output;
  expect_same_losses(step_losses(r.dir), step_losses(r.dir.parent_path() / "again"), 1e-9);
}

TEST(Train, AccumulationEqualsTheUnsplitBatch) {
  fs::path d = temp_dir();
  TrainRun big = train(d / "big", "training.per_device_train_batch_size=4 training.gradient_accumulation_steps=1");
  TrainRun split = train(d / "split", "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  ASSERT_EQ(split.exit_code, 0) << split.output;
  expect_same_losses(step_losses(big.dir), step_losses(split.dir), 1e-6);
  expect_same_tensors(big.dir / "adapter/adapter_model.safetensors", split.dir / "adapter/adapter_model.safetensors", 1e-6);
}

// A run resumed from a straight run's step-3 checkpoint equals the straight run from there on
// (`overrides` apply to both).
void expect_resume_equals_straight(const fs::path& d, const std::string& overrides) {
  TrainRun straight = train(d / "straight", "training.save_steps=3 " + overrides);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  fs::create_directories(d / "resumed/out/checkpoints");
  fs::copy(straight.dir / "checkpoints/step-3", d / "resumed/out/checkpoints/step-3", fs::copy_options::recursive);
  TrainRun resumed = train(d / "resumed", "training.resume_from_checkpoint=latest " + overrides);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  auto a = step_losses(straight.dir), b = step_losses(resumed.dir);
  ASSERT_EQ(b.size(), 3u);
  expect_same_losses(std::vector<double>(a.begin() + 3, a.end()), b, 1e-6);
  expect_same_tensors(straight.dir / "adapter/adapter_model.safetensors",
                      resumed.dir / "adapter/adapter_model.safetensors", 1e-6);
}

TEST(Train, ResumeEqualsUninterruptedRun) { expect_resume_equals_straight(temp_dir(), ""); }

// reduce_lr_on_plateau: its state (best loss, bad evaluations, the rate) is in the checkpoint,
// so the resumed run's learning rates and losses are the straight run's. With patience 0 and
// a threshold no evaluation meets (a 90 % drop), each evaluation after the first halves the
// rate: step k > 1 trains at 1e-3 / 2^(k-1).
TEST(Train, PlateauResumeEqualsUninterruptedRun) {
  const fs::path d = temp_dir();
  const std::string plateau =
      "training.lr_scheduler_type=reduce_lr_on_plateau training.warmup_steps=0 training.eval_steps=1 "
      "training.lr_scheduler_kwargs.patience=0 training.lr_scheduler_kwargs.factor=0.5 "
      "training.lr_scheduler_kwargs.threshold=0.9 data.eval_file=" +
      (source_dir() / "examples/data/tasks_eval.jsonl").string();
  expect_resume_equals_straight(d, plateau);
  for (const char* run : {"straight", "resumed"}) {
    for (const json& row : metrics(d / run / "out")) {
      if (!row.contains("loss")) continue;
      const int64_t step = row["step"].get<int64_t>();
      EXPECT_EQ(row["lr"].get<double>(), step <= 2 ? 1e-3 : 1e-3 / static_cast<double>(int64_t{1} << (step - 2)))
          << run << " step " << step;
    }
  }
}

// load_best_model_at_end, ranking the evaluations with greater_is_better: true on the eval
// loss (the worst evaluation ranks best, so the best is not the last step): the saved adapter
// is the best checkpoint's trainable tensors, the final evaluation measures them (the best
// evaluation's loss again), and save_total_limit 1 keeps that checkpoint and the newest, as
// transformers' rotation does.
TEST(Train, LoadBestModelAtEndSavesTheBestCheckpointsAdapter) {
  const fs::path d = temp_dir();
  TrainRun r = train(d, "training.eval_steps=2 training.save_steps=2 training.save_total_limit=1 "
                        "training.load_best_model_at_end=true training.greater_is_better=true data.eval_file=" +
                            (source_dir() / "examples/data/tasks_eval.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  int64_t best_step = 0;
  double best = -1, final_loss = -1;
  for (const json& row : metrics(r.dir)) {
    if (row.value("when", "") == "periodic" && row["eval_loss"].get<double>() > best)
      best = row["eval_loss"].get<double>(), best_step = row["step"].get<int64_t>();
    if (row.value("when", "") == "final") final_loss = row["eval_loss"].get<double>();
  }
  ASSERT_GT(best_step, 0);
  ASSERT_LT(best_step, 6) << "the test needs a best evaluation before the last step";
  EXPECT_NEAR(final_loss, best, 1e-6);
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(r.dir / "checkpoints")) kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step-" + std::to_string(best_step), "step-6"}));
  const auto ck = load_all_tensors(r.dir / "checkpoints" / ("step-" + std::to_string(best_step)) / "trainable.safetensors");
  const auto adapter = load_all_tensors(r.dir / "adapter/adapter_model.safetensors");
  ASSERT_EQ(ck.size(), adapter.size());
  for (const auto& [key, t] : adapter) {
    const std::string name = key.substr(std::string("base_model.model.").size());
    ASSERT_TRUE(ck.count(name)) << name;
    EXPECT_TRUE(at::equal(ck.at(name), t)) << name;
  }
  const json state = json::parse(read_file(r.dir / "checkpoints/step-6/state.json"));
  EXPECT_EQ(state["best"]["checkpoint"], best_step);
  EXPECT_NE(r.output.find("load_best_model_at_end: the trainable tensors of"), std::string::npos) << r.output;
}

// With LoRA dropout: the resumed steps draw the masks the straight run drew (each sample's
// masks are keyed by the step and the sample; the generator's state is saved too).
TEST(Train, ResumeWithDropoutEqualsUninterruptedRun) {
  expect_resume_equals_straight(temp_dir(), "lora.lora_dropout=0.1");
}

// On a GPU the masks are drawn there (keyed dropout reseeds the device's generator per row):
// a resumed run draws what the straight run drew. fp32 compute, so the runs compare at 1e-6.
TEST(Train, OnTheGpuResumeWithDropoutEqualsUninterruptedRun_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  expect_resume_equals_straight(temp_dir(), "lora.lora_dropout=0.1 runtime.device=cuda:0 "
                                            "model.quantization_config.bnb_4bit_compute_dtype=float32");
}

// modules_to_save: the whole modules' weights and AdamW states are in the checkpoint too.
TEST(Train, ResumeWithModulesToSaveEqualsUninterruptedRun) {
  expect_resume_equals_straight(temp_dir(), "lora.modules_to_save=[embed_tokens,model.norm,lm_head]");
}

// DoRA (lora.use_dora) with LoRA dropout: the magnitudes and their AdamW states are in the
// checkpoint (a resume equals the straight run), the micro-batches the supervisor splits a
// batch into give the unsplit batch's losses and adapter, and the adapter holds a magnitude per
// adapted projection.
TEST(Train, DoraResumesExactlyAndItsMicroBatchesEqualTheBatch) {
  const fs::path d = temp_dir();
  const std::string dora = "lora.use_dora=true lora.lora_dropout=0.1 ";
  expect_resume_equals_straight(d / "resume", dora);
  TrainRun big = train(d / "big", dora + "training.per_device_train_batch_size=4 training.gradient_accumulation_steps=1");
  TrainRun split = train(d / "split", dora + "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  ASSERT_EQ(split.exit_code, 0) << split.output;
  expect_same_losses(step_losses(big.dir), step_losses(split.dir), 1e-6);
  expect_same_tensors(big.dir / "adapter/adapter_model.safetensors", split.dir / "adapter/adapter_model.safetensors", 1e-6);
  const auto adapter = load_all_tensors(big.dir / "adapter/adapter_model.safetensors");
  int magnitudes = 0;
  for (const auto& [name, t] : adapter) magnitudes += name.find(".lora_magnitude_vector") != std::string::npos;
  EXPECT_EQ(3 * magnitudes, static_cast<int>(adapter.size()));
  EXPECT_TRUE(json::parse(read_file(big.dir / "adapter/adapter_config.json"))["use_dora"].get<bool>());
}

// DoRA on a GPU: fp32 QDoRA trains as on the CPU (its norms from the weight dequantized on the
// device), with dropout too; under bf16 autocast it trains (PEFT's op-by-op form on the device).
TEST(Train, OnTheGpuDoraTrainsAsOnTheCpu_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const fs::path d = temp_dir();
  for (const std::string dropout : {"0.0", "0.1"}) {
    const std::string dora = "lora.use_dora=true lora.lora_dropout=" + dropout +
                             " model.quantization_config.bnb_4bit_compute_dtype=float32 ";
    TrainRun cpu = train(d / ("cpu" + dropout), dora);
    TrainRun gpu = train(d / ("gpu" + dropout), dora + "runtime.device=cuda:0");
    ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
    ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
    expect_same_losses(step_losses(cpu.dir), step_losses(gpu.dir), 1e-4);
    expect_same_tensors(cpu.dir / "adapter/adapter_model.safetensors", gpu.dir / "adapter/adapter_model.safetensors",
                        1e-3);
  }
  TrainRun bf16 = train(d / "bf16", "lora.use_dora=true training.bf16=true runtime.device=cuda:0");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const auto losses = step_losses(bf16.dir);
  ASSERT_FALSE(losses.empty());
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
}

// A bf16 model (model.torch_dtype: bfloat16, PEFT's fp32 adapters): a resume, and a batch
// split into micro-batches (what the supervisor does after an out-of-memory error), give the
// straight run's losses and adapter.
TEST(Train, Bf16ModelResumeEqualsUninterruptedRun) {
  expect_resume_equals_straight(temp_dir(), "model.torch_dtype=bfloat16 training.bf16=true lora.lora_dropout=0.1");
}

TEST(Train, Bf16ModelAccumulationEqualsTheUnsplitBatch) {
  fs::path d = temp_dir();
  const std::string bf16 = "model.torch_dtype=bfloat16 training.bf16=true training.max_steps=3 ";
  TrainRun big = train(d / "big", bf16 + "training.per_device_train_batch_size=4 training.gradient_accumulation_steps=1");
  TrainRun split = train(d / "split", bf16 + "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  ASSERT_EQ(split.exit_code, 0) << split.output;
  EXPECT_NE(big.output.find("dense weights and activations bfloat16"), std::string::npos) << big.output;
  expect_same_losses(step_losses(big.dir), step_losses(split.dir), 1e-6);
  expect_same_tensors(big.dir / "adapter/adapter_model.safetensors", split.dir / "adapter/adapter_model.safetensors", 1e-6);
}

TEST(Train, ResumeRefusesABreakingConfigChange) {
  fs::path d = temp_dir();
  TrainRun first = train(d, "training.max_steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string written = read_file(first.dir / "config.yaml");
  auto r = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
               " training.max_steps=4 training.resume_from_checkpoint=latest lora.r=8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("lora.r changed"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(first.dir / "config.yaml"), written) << "the refused run's config replaced the one that trained";
  // Every key that shapes a step is compared whole: the data file (never compared before)
  // and which layers carry LoRA (compared by count before, so [0, 1] -> [2, 3] passed).
  const fs::path other = d / "other.jsonl";
  fs::copy_file(source_dir() / "examples/data/tasks_train.jsonl", other);
  for (const auto& [change, key] : std::vector<std::pair<std::string, std::string>>{
           {"data.train_file=" + other.string(), "data.train_file changed"},
           {"lora.layers_to_transform=[2,3]", "lora.layers_to_transform changed since the checkpoint ('[0, 1]' -> '[2, 3]')"},
           {"training.learning_rate=5e-3", "training.learning_rate changed"}}) {
    auto first_layers = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                            " training.max_steps=2 lora.layers_to_transform=[0,1] training.output_dir=" +
                            (d / "layers").string());
    ASSERT_EQ(first_layers.exit_code, 0) << first_layers.output;
    auto changed = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                       " training.max_steps=4 training.resume_from_checkpoint=latest lora.layers_to_transform=[0,1] "
                       "training.output_dir=" + (d / "layers").string() + " " + change);
    EXPECT_EQ(changed.exit_code, 2) << change << "\n" << changed.output;
    EXPECT_NE(changed.output.find(key), std::string::npos) << change << "\n" << changed.output;
    remove_tree(d / "layers");
  }
  // How often the run logs and saves, and how a step is split, may change.
  auto fine = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                  " training.max_steps=4 training.resume_from_checkpoint=latest training.logging_steps=2 "
                  "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=2");
  EXPECT_EQ(fine.exit_code, 0) << fine.output;
  EXPECT_NE(fine.output.find("resumed from"), std::string::npos) << fine.output;
  // Except under NEFTune, whose noise is scaled by the length of each micro-batch.
  const std::string neftune = " training.neftune_noise_alpha=5 training.output_dir=" + (d / "neftune").string();
  auto noisy = run(memtune_bin() + " train " + (d / "config.yaml.in").string() + " training.max_steps=2" + neftune);
  ASSERT_EQ(noisy.exit_code, 0) << noisy.output;
  auto split = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                   " training.max_steps=4 training.resume_from_checkpoint=latest training.per_device_train_batch_size=2 "
                   "training.gradient_accumulation_steps=2" + neftune);
  EXPECT_EQ(split.exit_code, 2) << split.output;
  EXPECT_NE(split.output.find("training.neftune_noise_alpha scales each sample's noise"), std::string::npos)
      << split.output;
}

// num_train_epochs as transformers' Trainer counts it (5.12: set_initial_training_values,
// _run_epoch): 10 samples at 2 x 4 make an epoch of ceil(10 / 2) = 5 micro-batches, so 2
// steps (4 micro-batches, then the 1 left: 8 samples, then 2), 6 steps for 3 epochs; the
// linear schedule without warm-up gives step k (from 0) lr x (6 - k) / 6.
TEST(Train, EpochsAreTheTrainersWithTheLastStepOfEachShorter) {
  fs::path d = temp_dir();
  std::string rows;
  for (int i = 0; i < 10; ++i) rows += "{\"text\": \"sample number " + std::to_string(i) + " of ten\"}\n";
  write_file(d / "ten.jsonl", rows);
  TrainRun r = train(d, "training.max_steps=-1 training.num_train_epochs=3 training.per_device_train_batch_size=2 "
                        "training.gradient_accumulation_steps=4 training.warmup_steps=0 data.format=text "
                        "data.pack_sequences=false data.train_file=" + (d / "ten.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<int64_t> samples, epochs;
  std::vector<double> lrs;
  for (const auto& m : metrics(r.dir))
    if (m.contains("loss")) {
      samples.push_back(m["samples"].get<int64_t>());
      epochs.push_back(m["epoch"].get<int64_t>());
      lrs.push_back(m["lr"].get<double>());
    }
  EXPECT_EQ(samples, (std::vector<int64_t>{8, 2, 8, 2, 8, 2}));
  EXPECT_EQ(epochs, (std::vector<int64_t>{0, 0, 1, 1, 2, 2}));
  ASSERT_EQ(lrs.size(), 6u);
  for (int k = 0; k < 6; ++k) EXPECT_NEAR(lrs[k], 1e-3 * (6 - k) / 6.0, 1e-12) << "step " << k;
}

// training.group_by_length (HF's LengthGroupedSampler) over samples of very different
// lengths, one per row: every epoch still trains each sample once (its target tokens are
// the dataset's), a step pads much less than in the shuffled order (metrics.jsonl's
// padding), and a resumed run equals the uninterrupted one. transformers 5's spelling,
// train_sampling_strategy: group_by_length, trains the same steps; its sequential, those of
// data.shuffle: false.
TEST(Train, GroupByLengthPadsLessAndTrainsEachSampleOncePerEpoch) {
  fs::path d = temp_dir();
  std::string rows;
  for (int i = 0; i < 48; ++i) {
    std::string text = "sample";
    for (int w = 0; w < (i * 7) % 48 * 2; ++w) text += " w" + std::to_string(w);
    rows += json{{"text", text}}.dump() + "\n";
  }
  write_file(d / "mixed.jsonl", rows);
  const std::string common = "training.max_steps=-1 training.num_train_epochs=2 training.per_device_train_batch_size=2 "
                             "training.warmup_steps=0 data.format=text data.pack_sequences=false data.max_seq_length=256 "
                             "data.train_file=" + (d / "mixed.jsonl").string();
  TrainRun shuffled = train(d / "shuffled", common);
  TrainRun grouped = train(d / "grouped", common + " training.group_by_length=true");
  ASSERT_EQ(shuffled.exit_code, 0) << shuffled.output;
  ASSERT_EQ(grouped.exit_code, 0) << grouped.output;
  EXPECT_NE(grouped.output.find("grouped by length"), std::string::npos) << grouped.output;
  auto per_epoch = [](const fs::path& out, std::map<int64_t, int64_t>& tokens, double& padding) {
    int steps = 0;
    padding = 0;
    for (const auto& m : metrics(out))
      if (m.contains("loss")) {
        tokens[m["epoch"].get<int64_t>()] += m["tokens"].get<int64_t>();
        padding += m["padding"].get<double>();
        ++steps;
      }
    padding /= std::max(1, steps);
    return steps;
  };
  std::map<int64_t, int64_t> a, b;
  double pad_a = 0, pad_b = 0;
  EXPECT_EQ(per_epoch(shuffled.dir, a, pad_a), 48);
  EXPECT_EQ(per_epoch(grouped.dir, b, pad_b), 48);
  EXPECT_EQ(a, b);  // each epoch: all the samples' target tokens, once
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0], b[1]);
  EXPECT_LT(pad_b, 0.5 * pad_a) << "mean padding share: shuffled " << pad_a << ", grouped " << pad_b;
  EXPECT_NE(step_losses(shuffled.dir), step_losses(grouped.dir));  // other samples share the steps

  TrainRun v5 = train(d / "v5", common + " training.train_sampling_strategy=group_by_length");
  ASSERT_EQ(v5.exit_code, 0) << v5.output;
  expect_same_losses(step_losses(grouped.dir), step_losses(v5.dir), 1e-9);
  TrainRun sequential = train(d / "sequential", common + " training.train_sampling_strategy=sequential");
  TrainRun unshuffled = train(d / "unshuffled", common + " data.shuffle=false");
  ASSERT_EQ(sequential.exit_code, 0) << sequential.output;
  ASSERT_EQ(unshuffled.exit_code, 0) << unshuffled.output;
  expect_same_losses(step_losses(unshuffled.dir), step_losses(sequential.dir), 1e-9);
  EXPECT_NE(step_losses(shuffled.dir), step_losses(sequential.dir));
  expect_resume_equals_straight(d / "resume", "training.group_by_length=true data.pack_sequences=false "
                                              "data.max_seq_length=256 data.format=text data.train_file=" +
                                                  (d / "mixed.jsonl").string());
}

// data.eval_split holds out documents of the training file: a run with it trains and
// evaluates exactly as a run given the two sides as files of their own, the held-out
// documents picked by the Python reference (tests/reference/eval_split.py: datasets'
// train_test_split count, the documented draw from training.seed).
TEST(Train, EvalSplitEqualsTheHeldOutDocumentsAsAFile) {
  const fs::path d = temp_dir();
  std::vector<std::string> records;
  for (int i = 0; i < 40; ++i) {
    std::string text = "record " + std::to_string(i);
    for (int w = 0; w < i % 5; ++w) text += " and more";
    records.push_back(json{{"text", text}}.dump());
  }
  std::string all, train_part, eval_part;
  const auto r = run(python() + " " + (source_dir() / "tests/reference/eval_split.py").string() + " 40 0.25 7 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::set<int> held;
  std::istringstream in(r.output);
  for (int v; in >> v;) held.insert(v);
  ASSERT_EQ(held.size(), 10u);
  for (int i = 0; i < 40; ++i) {
    all += records[i] + "\n";
    (held.count(i) ? eval_part : train_part) += records[i] + "\n";
  }
  write_file(d / "all.jsonl", all);
  write_file(d / "train_part.jsonl", train_part);
  write_file(d / "eval_part.jsonl", eval_part);
  const std::string common = "training.max_steps=6 training.eval_steps=2 data.format=text ";
  TrainRun split = train(d / "split", common + "data.eval_split=0.25 data.train_file=" + (d / "all.jsonl").string());
  TrainRun files = train(d / "files", common + "data.train_file=" + (d / "train_part.jsonl").string() +
                                          " data.eval_file=" + (d / "eval_part.jsonl").string());
  ASSERT_EQ(split.exit_code, 0) << split.output;
  ASSERT_EQ(files.exit_code, 0) << files.output;
  EXPECT_NE(split.output.find("data.eval_split 0.25 holds out 10 of the 40 documents"), std::string::npos)
      << split.output;
  expect_same_losses(step_losses(files.dir), step_losses(split.dir), 1e-9);
  auto eval_losses = [](const fs::path& out) {
    std::vector<double> l;
    for (const auto& m : metrics(out))
      if (m.contains("eval_loss")) l.push_back(m["eval_loss"].get<double>());
    return l;
  };
  const auto a = eval_losses(split.dir), b = eval_losses(files.dir);
  EXPECT_EQ(a.size(), 5u);  // before, at steps 2, 4 and 6, and final
  expect_same_losses(b, a, 1e-9);
}

// transformers' IntervalStrategy keys over 3 epochs of 3 steps (10 samples, 4 per step:
// 4, 4, 2): epoch writes each epoch's metrics row, checkpoint and evaluation at steps 3, 6
// and 9 (logging_first_step a row at step 1 too); steps without eval_steps evaluates every logging_steps, as transformers; save no
// leaves no checkpoint (the adapter is still written); logging no writes no step rows.
TEST(Train, IntervalStrategiesLogSaveAndEvaluateAsTransformers) {
  fs::path d = temp_dir();
  std::string rows;
  for (int i = 0; i < 10; ++i) rows += "{\"text\": \"sample number " + std::to_string(i) + " of ten\"}\n";
  write_file(d / "ten.jsonl", rows);
  const std::string common = "training.max_steps=-1 training.num_train_epochs=3 training.per_device_train_batch_size=2 "
                             "training.gradient_accumulation_steps=2 training.warmup_steps=0 data.format=text "
                             "data.pack_sequences=false data.train_file=" + (d / "ten.jsonl").string() +
                             " data.eval_file=" + (d / "ten.jsonl").string();
  auto steps_with = [](const fs::path& out, const char* key, const char* when = nullptr) {
    std::vector<int64_t> at;
    for (const auto& m : metrics(out))
      if (m.contains(key) && (!when || (m.contains("when") && m["when"] == when))) at.push_back(m["step"].get<int64_t>());
    return at;
  };
  auto checkpoints = [](const fs::path& out) {
    std::vector<std::string> names;
    if (fs::exists(out / "checkpoints"))
      for (const auto& e : fs::directory_iterator(out / "checkpoints")) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  TrainRun epoch = train(d / "epoch", common + " training.logging_strategy=epoch training.save_strategy=epoch "
                                               "training.eval_strategy=epoch training.logging_first_step=true");
  ASSERT_EQ(epoch.exit_code, 0) << epoch.output;
  EXPECT_EQ(steps_with(epoch.dir, "loss"), (std::vector<int64_t>{1, 3, 6, 9}));  // logging_first_step: 1 too
  EXPECT_EQ(steps_with(epoch.dir, "eval_loss", "periodic"), (std::vector<int64_t>{3, 6, 9}));
  EXPECT_EQ(checkpoints(epoch.dir), (std::vector<std::string>{"step-3", "step-6", "step-9"}));

  TrainRun steps = train(d / "steps", common + " training.logging_steps=4 training.eval_strategy=steps "
                                               "training.save_strategy=no");
  ASSERT_EQ(steps.exit_code, 0) << steps.output;
  EXPECT_EQ(steps_with(steps.dir, "loss"), (std::vector<int64_t>{4, 8, 9}));  // and the last step
  EXPECT_EQ(steps_with(steps.dir, "eval_loss", "periodic"), (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(checkpoints(steps.dir).empty());
  EXPECT_TRUE(fs::exists(steps.dir / "adapter/adapter_model.safetensors"));
  // Where to log, save and evaluate changes no step: the same last loss and adapter.
  EXPECT_EQ(step_losses(epoch.dir).back(), step_losses(steps.dir).back());
  expect_same_tensors(epoch.dir / "adapter/adapter_model.safetensors", steps.dir / "adapter/adapter_model.safetensors",
                      0);

  TrainRun quiet = train(d / "quiet", common + " training.logging_strategy=no");
  ASSERT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_TRUE(steps_with(quiet.dir, "loss").empty());
  EXPECT_NE(quiet.output.find("step 9/9"), std::string::npos) << quiet.output;  // the progress line stays
  EXPECT_EQ(checkpoints(quiet.dir), (std::vector<std::string>{"step-9"}));  // save_strategy steps: the end
}

// training.label_smoothing_factor reaches the training loss and the eval loss (as
// transformers' eval_loss), not the eval perplexity (that of the cross-entropy). The values
// themselves: cross_entropy_test (against ATen's) and the interop group train (against
// transformers' LabelSmoother).
TEST(Train, LabelSmoothingIsInTheTrainingAndEvalLossNotThePerplexity) {
  const fs::path d = temp_dir();
  const std::string eval = " training.max_steps=3 data.eval_file=" +
                           (source_dir() / "examples/data/tasks_eval.jsonl").string();
  TrainRun plain = train(d / "plain", eval);
  TrainRun smooth = train(d / "smooth", eval + " training.label_smoothing_factor=0.2");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(smooth.exit_code, 0) << smooth.output;
  auto before = [](const fs::path& out) {
    for (const auto& m : metrics(out))
      if (m.contains("when") && m["when"] == "before training") return m;
    return json();
  };
  const json a = before(plain.dir), b = before(smooth.dir);
  ASSERT_TRUE(a.contains("eval_loss") && b.contains("eval_loss"));
  EXPECT_NEAR(a["eval_perplexity"].get<double>(), std::exp(a["eval_loss"].get<double>()), 1e-9 * a["eval_perplexity"].get<double>());
  EXPECT_NEAR(b["eval_perplexity"].get<double>(), a["eval_perplexity"].get<double>(), 1e-6 * a["eval_perplexity"].get<double>());
  EXPECT_GT(std::abs(b["eval_loss"].get<double>() - a["eval_loss"].get<double>()), 1e-4);
  const auto la = step_losses(plain.dir), lb = step_losses(smooth.dir);
  ASSERT_EQ(la.size(), 3u);
  ASSERT_EQ(lb.size(), 3u);
  EXPECT_GT(std::abs(la[0] - lb[0]), 1e-4);  // the first step's loss, before any update, is smoothed
}

// A run started afresh in a directory holding another run's checkpoints, or resumed from an
// earlier checkpoint than the newest, would write its checkpoints among the other run's:
// save_total_limit, pruning by step number, would delete its own, and `latest` continue the
// other run. Refused by name before anything is written; every checkpoint is still there.
TEST(Train, ARunDoesNotStartAmongAnotherRunsCheckpoints) {
  fs::path d = temp_dir();
  TrainRun first = train(d, "training.max_steps=4 training.save_steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(fs::exists(first.dir / "checkpoints/step-2/state.json") &&
              fs::exists(first.dir / "checkpoints/step-4/state.json"));
  const std::string config = read_file(first.dir / "config.yaml");
  auto fresh = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                   " training.max_steps=4 training.save_steps=2 training.save_total_limit=1");
  EXPECT_EQ(fresh.exit_code, 2) << fresh.output;
  EXPECT_NE(fresh.output.find("past step 0, where this run starts (step-2, step-4)"), std::string::npos) << fresh.output;
  EXPECT_NE(fresh.output.find("set training.resume_from_checkpoint=latest"), std::string::npos) << fresh.output;
  auto back = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                  " training.max_steps=4 training.save_steps=2 training.resume_from_checkpoint=" +
                  (first.dir / "checkpoints/step-2").string());
  EXPECT_EQ(back.exit_code, 2) << back.output;
  EXPECT_NE(back.output.find("past step 2, where this run starts (step-4)"), std::string::npos) << back.output;
  EXPECT_TRUE(fs::exists(first.dir / "checkpoints/step-2/state.json") &&
              fs::exists(first.dir / "checkpoints/step-4/state.json"));
  EXPECT_EQ(read_file(first.dir / "config.yaml"), config);
  // The newest continues (here: a finished run, nothing left to train).
  auto latest = run(memtune_bin() + " train " + (d / "config.yaml.in").string() +
                    " training.max_steps=4 training.save_steps=2 training.resume_from_checkpoint=latest");
  EXPECT_EQ(latest.exit_code, 0) << latest.output;
}

// The sampler's order is a permutation of the samples the data makes: a resume on data that
// makes another count (the same file name, its content changed) cannot continue it, and is
// refused by name before anything runs; the same data again resumes.
TEST(Train, ResumeRefusesDataThatMakesOtherSamples) {
  const fs::path d = temp_dir();
  const fs::path data = d / "tasks.jsonl";
  fs::copy_file(source_dir() / "examples/data/tasks_train.jsonl", data);
  const std::string original = read_file(data);
  const int64_t records = std::count(original.begin(), original.end(), '\n');
  const std::string on = " data.pack_sequences=false data.train_file=" + data.string();  // a record a sample
  TrainRun first = train(d, "training.max_steps=2" + on);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path state = first.dir / "checkpoints/step-2/state.json";
  EXPECT_EQ(json::parse(read_file(state))["data"]["samples"], records);

  write_file(data, original + original.substr(0, original.find('\n') + 1));  // one record more
  const std::string resume = memtune_bin() + " train " + (d / "config.yaml.in").string() +
                             " training.max_steps=4 training.resume_from_checkpoint=latest" + on;
  auto changed = run(resume);
  EXPECT_EQ(changed.exit_code, 2) << changed.output;
  EXPECT_NE(changed.output.find(str_cat("now makes ", records + 1, " samples")), std::string::npos) << changed.output;
  EXPECT_NE(changed.output.find(str_cat("the checkpoint's run had ", records, " samples (")), std::string::npos)
      << changed.output;
  EXPECT_EQ(trainer::latest_checkpoint(first.dir).filename(), "step-2") << "a step ran";

  // A checkpoint of an earlier version names no count: it resumes as before.
  json old = json::parse(read_file(state));
  old.erase("data");
  write_file(state, old.dump());
  auto unknown = run(resume);
  EXPECT_EQ(unknown.exit_code, 0) << unknown.output;
  EXPECT_NE(unknown.output.find("resumed from"), std::string::npos) << unknown.output;
  EXPECT_NE(unknown.output.find("names no data count"), std::string::npos) << unknown.output;
}

// Chats whose replies are not under the role 'assistant' (ShareGPT's 'human' / 'gpt') train
// no token while data.train_on_prompt is false: such data is refused by name before a step
// (transformers' mean over no labels is NaN; this ran steps of loss 0 and changed nothing);
// data where only some chats lack a reply trains, and the log counts those.
TEST(Train, ChatDataThatTrainsNoTokenIsRefusedAndSomeIsCounted) {
  const fs::path d = temp_dir();
  std::string sharegpt, mixed;
  for (int i = 0; i < 40; ++i) {
    const std::string q = "what is " + std::to_string(i) + " plus " + std::to_string(i) + "?";
    const std::string a = std::to_string(2 * i);
    sharegpt += R"({"messages": [{"role": "human", "content": ")" + q + R"("}, {"role": "gpt", "content": ")" + a +
                "\"}]}\n";
    mixed += R"({"messages": [{"role": "user", "content": ")" + q + "\"}" +
             (i % 4 ? R"(, {"role": "assistant", "content": ")" + a + "\"}" : std::string()) + "]}\n";
  }
  write_file(d / "sharegpt.jsonl", sharegpt);
  write_file(d / "mixed.jsonl", mixed);
  const std::string chat = " data.format=chat data.template_name=chatml data.train_file=";
  TrainRun none = train(d / "none", "training.max_steps=2" + chat + (d / "sharegpt.jsonl").string());
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("samples trains a token (data.train_on_prompt is false, so only messages whose role "
                             "is 'assistant' train"),
            std::string::npos)
      << none.output;
  EXPECT_NE(none.output.find("Hint: name the replying role 'assistant'"), std::string::npos) << none.output;
  EXPECT_FALSE(fs::exists(none.dir / "metrics.jsonl")) << "a step ran";

  TrainRun some = train(d / "some", "training.max_steps=2" + chat + (d / "mixed.jsonl").string());
  ASSERT_EQ(some.exit_code, 0) << some.output;
  EXPECT_NE(some.output.find("10 of its 40 documents train no token"), std::string::npos) << some.output;
  TrainRun prompt = train(d / "prompt", "training.max_steps=1 data.train_on_prompt=true" + chat +
                                            (d / "sharegpt.jsonl").string());
  EXPECT_EQ(prompt.exit_code, 0) << prompt.output;
  EXPECT_EQ(prompt.output.find("train no token"), std::string::npos) << prompt.output;
  EXPECT_NE(prompt.output.find("40 documents, "), std::string::npos) << prompt.output;
  EXPECT_EQ(prompt.output.find(" 0 target tokens"), std::string::npos) << prompt.output;
  // An evaluation over such data would report a loss of 0 over nothing.
  TrainRun eval = train(d / "eval", "training.max_steps=1 data.eval_file=" + (d / "sharegpt.jsonl").string() + chat +
                                        (d / "mixed.jsonl").string());
  EXPECT_EQ(eval.exit_code, 2) << eval.output;
  EXPECT_NE(eval.output.find("data.eval_file " + (d / "sharegpt.jsonl").string() + ": none of its "),
            std::string::npos)
      << eval.output;
  EXPECT_NE(eval.output.find("its loss would be a mean over nothing"), std::string::npos) << eval.output;
}

TEST(Train, DamagedStateJsonIsRefusedByKeyAndNothingRuns) {
  fs::path d = temp_dir();
  TrainRun first = train(d / "first", "training.max_steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path ck = first.dir / "checkpoints/step-2";
  const json good = json::parse(read_file(ck / "state.json"));
  struct Case {
    std::string name;
    std::function<void(json&)> damage;
    std::string expected;
    std::string dir = "step-2";
  };
  const std::vector<Case> cases = {
      {"micro0", [](json& j) { j["supervisor"]["micro_batch"] = 0; }, "supervisor.micro_batch is 0; expected an integer in 1..4"},
      {"negstep", [](json& j) { j["step"] = -5; }, "state.json.step is -5; expected an integer in 0.."},
      {"nosampler", [](json& j) { j.erase("sampler"); }, "key 'sampler' is missing"},
      {"badscale", [](json& j) { j["scaler"]["scale"] = "abc"; }, "scaler.scale is \"abc\"; expected a number"},
      {"nosteps", [](json& j) { j["optimizer"].erase("steps"); }, "optimizer: key 'steps' is missing"},
      {"layers", [](json& j) { j["checkpoint_layers"] = {true}; }, "checkpoint_layers names 1 layers, the model has 4"},
      {"data", [](json& j) { j["data"]["samples"] = 0; }, "state.json.data.samples is 0; expected an integer in 1.."},
      {"moredata", [](json& j) { j["data"]["samples"] = j["data"]["samples"].get<int64_t>() + 1; },
       "cannot continue on it"},
      {"renamed", [](json&) {}, "step is 2 but the directory is step-9", "step-9"},
  };
  for (const auto& c : cases) {
    const fs::path out = d / c.name / "out";
    fs::create_directories(out / "checkpoints");
    fs::copy(ck, out / "checkpoints" / c.dir, fs::copy_options::recursive);
    json j = good;
    c.damage(j);
    write_file(out / "checkpoints" / c.dir / "state.json", j.dump());
    write_file(d / c.name / "config.yaml.in", base_config(out));
    auto r = run(memtune_bin() + " train " + (d / c.name / "config.yaml.in").string() +
                 " training.max_steps=4 training.resume_from_checkpoint=latest");
    EXPECT_EQ(r.exit_code, 2) << c.name << ": " << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.name << ": " << r.output;
    EXPECT_FALSE(fs::exists(out / "metrics.jsonl") && !read_file(out / "metrics.jsonl").empty()) << c.name;
    EXPECT_EQ(trainer::latest_checkpoint(out).filename(), c.dir) << c.name << ": a step ran";
  }
}

TEST(Train, SigtermCheckpointsAndResumeMatchesUninterruptedRun) {
  fs::path d = temp_dir();
  const std::string steps = "training.max_steps=40 training.logging_steps=1";
  TrainRun straight = train(d / "straight", steps);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  fs::create_directories(d / "stopped");
  write_file(d / "stopped/config.yaml.in", base_config(d / "stopped/out"));
  const std::string cmd = memtune_bin() + " train " + (d / "stopped/config.yaml.in").string() + " " + steps;
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > " + (d / "stopped/log").string() + " 2>&1").c_str(), nullptr);
    _exit(127);
  }
  // Wait for a few steps, then SIGTERM.
  for (int i = 0; i < 600 && metrics(d / "stopped/out").size() < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << read_file(d / "stopped/log");
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_file(d / "stopped/log");
  fs::path ck = trainer::latest_checkpoint(d / "stopped/out");
  ASSERT_FALSE(ck.empty());
  auto r = run(cmd + " training.resume_from_checkpoint=latest");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(straight.dir / "adapter/adapter_model.safetensors",
                      d / "stopped/out/adapter/adapter_model.safetensors", 1e-6);
}

// Checkpoint directories as a kill left them: complete ones (step-N with state.json),
// step-N without it (a torn delete), and temporaries of writes or deletes in progress.
struct CheckpointDir {
  int complete = 0, torn = 0, temporaries = 0;
};
CheckpointDir inspect_checkpoints(const fs::path& out) {
  CheckpointDir c;
  if (!fs::exists(out / "checkpoints")) return c;
  for (const auto& e : fs::directory_iterator(out / "checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp-") != std::string::npos) ++c.temporaries;
    else if (fs::exists(e.path() / "state.json")) ++c.complete;
    else ++c.torn;
  }
  return c;
}

// Starts `memtune train` with its output in dir/log; SIGTERM once `ready` holds (polled),
// then returns the exit code and the log.
std::pair<int, std::string> term_when(const fs::path& dir, const std::string& overrides,
                                      const std::function<bool()>& ready) {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", base_config(dir / "out"));
  const std::string cmd = memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides +
                          " > " + (dir / "log").string() + " 2>&1";
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
    _exit(127);
  }
  for (int i = 0; i < 6000 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(dir / "log")};
}

TEST(Train, SigtermDuringEvaluationsIsHonouredAtTheNextRow) {
  const fs::path d = temp_dir();
  const std::string eval = "data.eval_file=" + (source_dir() / "examples/data/tasks_eval.jsonl").string() +
                           " training.eval_accuracy_rows=200 training.logging_steps=1";
  // In the accuracy evaluation before the first step (200 generations: seconds): it ends
  // at the next row and the run stops with nothing to save.
  auto [code, log] = term_when(d / "first", eval, [&] {
    return read_file(d / "first/log").find("accuracy (before training): answering") != std::string::npos;
  });
  EXPECT_EQ(code, 128 + SIGTERM) << log;
  EXPECT_NE(log.find("accuracy (before training): stopped by signal 15"), std::string::npos) << log;
  EXPECT_NE(log.find("before the first step"), std::string::npos) << log;
  EXPECT_TRUE(step_losses(d / "first/out").empty());
  // In the final evaluations: the last checkpoint and the adapter are written, the
  // evaluation is skipped, and the exit code says the run was stopped.
  auto [code2, log2] = term_when(d / "last", eval + " training.max_steps=2", [&] {
    return fs::exists(d / "last/out/checkpoints/step-2/state.json");
  });
  EXPECT_EQ(code2, 128 + SIGTERM) << log2;
  EXPECT_NE(log2.find("during the final evaluation"), std::string::npos) << log2;
  EXPECT_TRUE(fs::exists(d / "last/out/adapter/adapter_model.safetensors")) << log2;
  for (const auto& m : metrics(d / "last/out"))
    EXPECT_FALSE(m.contains("accuracy") && m["step"] == 2) << "an interrupted evaluation was recorded: " << m;
  // Resumed, it runs the final evaluations again, and metrics.jsonl holds each of them once
  // (the first run's final eval_loss row, written before the stop, is not kept twice).
  // The same again on the finished run ("one command starts and restarts a run").
  for (const char* pass : {"stopped", "finished"}) {
    auto again = run(memtune_bin() + " train " + (d / "last/config.yaml.in").string() + " " + eval +
                     " training.max_steps=2 training.resume_from_checkpoint=latest");
    EXPECT_EQ(again.exit_code, 0) << pass << "\n" << again.output;
    int losses = 0, accuracies = 0;
    for (const auto& m : metrics(d / "last/out"))
      if (m.value("step", -1) == 2) {
        losses += m.contains("eval_loss");
        accuracies += m.contains("accuracy");
      }
    EXPECT_EQ(losses, 1) << pass;
    EXPECT_EQ(accuracies, 1) << pass;
  }
}

// A stop in the periodic evaluation after step 1: the checkpoint of step 1 is written once
// and says the evaluation is due; the resumed run evaluates step 1 before step 2, so
// metrics.jsonl has every step's evaluation, as an uninterrupted run's.
TEST(Train, AStopInAPeriodicEvaluationHasItRunOnResume) {
  const fs::path d = temp_dir();
  // The training file as evaluation data: a periodic evaluation of seconds, a step of less.
  const std::string eval = "data.eval_file=" + (source_dir() / "examples/data/tasks_train.jsonl").string() +
                           " training.eval_steps=1 training.max_steps=3 training.save_steps=1";
  auto [code, log] = term_when(d, eval, [&] { return read_file(d / "log").find("step 1/3") != std::string::npos; });
  EXPECT_EQ(code, 128 + SIGTERM) << log;
  ASSERT_NE(log.find("eval (periodic): stopped by signal 15"), std::string::npos) << "the stop missed it:\n" << log;
  size_t saves = 0;
  for (size_t at = log.find("checkpoint: "); at != std::string::npos; at = log.find("checkpoint: ", at + 1)) ++saves;
  EXPECT_EQ(saves, 1u) << log;
  auto again = run(memtune_bin() + " train " + (d / "config.yaml.in").string() + " " + eval +
                   " training.resume_from_checkpoint=latest");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  std::map<int64_t, int> periodic;
  for (const auto& m : metrics(d / "out"))
    if (m.contains("eval_loss") && m.value("when", "") == "periodic") ++periodic[m["step"].get<int64_t>()];
  EXPECT_EQ(periodic, (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 1}})) << again.output;
}

TEST(Train, KillDuringCheckpointWritesAndPruningLeavesALoadableCheckpoint) {
  fs::path d = temp_dir();
  write_file(d / "config.yaml.in", base_config(d / "out"));
  // A full fine-tune writes ~17 MB checkpoints every step and prunes all but two: most of
  // a step's time is spent writing or deleting, so kills land inside both.
  const std::string cmd = memtune_bin() + " train " + (d / "config.yaml.in").string() +
                          " training.max_steps=400 training.save_steps=1 training.save_total_limit=2 "
                          "training.finetune=full model.quantization_config.load_in_4bit=false "
                          "training.resume_from_checkpoint=latest";
  int landed_in_a_write = 0;
  for (int attempt = 0; attempt < 12 && landed_in_a_write < 3; ++attempt) {
    pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > /dev/null 2>&1").c_str(), nullptr);
      _exit(127);
    }
    // Kill once the run has written a checkpoint this time, at a moment that varies. A loaded
    // machine can take seconds to start the run: the wait (60 s at most; it was 6 s, and the
    // test failed once 9 s in, under ctest -j2 with other work beside it) lets the first
    // checkpoint come before the kill, which found none otherwise.
    const fs::path before = trainer::latest_checkpoint(d / "out");
    for (int i = 0; i < 3000 && trainer::latest_checkpoint(d / "out") == before; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * attempt % 150));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the run ended before the kill (exit " << WEXITSTATUS(status) << ")";
    const CheckpointDir c = inspect_checkpoints(d / "out");
    if (c.temporaries > 0) ++landed_in_a_write;  // the kill interrupted a write or a delete
    EXPECT_EQ(c.torn, 0) << "a step-N directory lost its state.json (attempt " << attempt << ")";
    EXPECT_LE(c.complete, 3) << "save_total_limit 2 (+1 being replaced)";
    fs::path ck = trainer::latest_checkpoint(d / "out");
    ASSERT_FALSE(ck.empty());
    EXPECT_NO_THROW(trainer::load_training_checkpoint(ck)) << ck;  // whatever the moment, the latest is whole
  }
  EXPECT_GE(landed_in_a_write, 1) << "no kill landed inside a checkpoint write; the test proved nothing";
  // A final resume finishes, removing what the kills left behind.
  auto r = run(cmd + " training.max_steps=" + std::to_string(
                         std::stoll(trainer::latest_checkpoint(d / "out").filename().string().substr(5)) + 1));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const CheckpointDir c = inspect_checkpoints(d / "out");
  EXPECT_EQ(c.temporaries, 0);
  EXPECT_EQ(c.torn, 0);
  EXPECT_EQ(c.complete, 2);
}

TEST(Train, StartRemovesTornCheckpointsAndDeadWritersTemporaries) {
  fs::path d = temp_dir();
  const fs::path ck = d / "out/checkpoints";
  fs::create_directories(ck / "step-1");  // a delete that an older version was killed in
  write_file(ck / "step-1/trainable.safetensors", "x");
  pid_t dead = fork();  // a pid that no longer runs
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  fs::create_directories(ck / ("step-2.tmp-" + std::to_string(dead)));
  write_file(d / "out/adapter" / ("adapter_model.safetensors.tmp-" + std::to_string(dead)), "partial");
  TrainRun r = train(d, "training.max_steps=3 training.save_steps=1 training.save_total_limit=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ck)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-2", "step-3"}));
  for (const auto& e : fs::directory_iterator(d / "out/adapter"))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST(Train, ResumeKeepsEachStepsMetricsOnce) {
  fs::path d = temp_dir();
  TrainRun straight = train(d / "straight", "training.save_steps=3");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  // A run killed after step 5 (its metrics went further than its last checkpoint, step 3)
  // with the last line cut short by the kill.
  fs::create_directories(d / "killed/out/checkpoints");
  fs::copy(straight.dir / "checkpoints/step-3", d / "killed/out/checkpoints/step-3", fs::copy_options::recursive);
  std::string rows;
  for (const auto& m : metrics(straight.dir))
    if (!m.contains("step") || m["step"].get<int64_t>() <= 5) rows += m.dump() + "\n";
  write_file(d / "killed/out/metrics.jsonl", rows + "{\"step\": 6, \"lo");
  TrainRun resumed = train(d / "killed", "training.resume_from_checkpoint=latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  std::map<int64_t, int> loss_rows;
  for (const auto& m : metrics(resumed.dir))  // every line parses (read_jsonl throws otherwise)
    if (m.contains("loss")) ++loss_rows[m["step"].get<int64_t>()];
  ASSERT_EQ(loss_rows.size(), 6u);
  for (const auto& [step, n] : loss_rows) EXPECT_EQ(n, 1) << "step " << step;
  expect_same_losses(step_losses(straight.dir), step_losses(resumed.dir), 1e-6);
}

TEST(Train, LoraOnDenseBaseAndFullFineTune) {
  fs::path d = temp_dir();
  TrainRun lora = train(d / "lora", "model.quantization_config.load_in_4bit=false training.max_steps=8");
  ASSERT_EQ(lora.exit_code, 0) << lora.output;
  EXPECT_TRUE(fs::exists(lora.dir / "adapter/adapter_model.safetensors"));
  TrainRun full = train(d / "full",
                   "model.name_or_path=tiny-gpt2 model.quantization_config.load_in_4bit=false training.finetune=full "
                   "training.max_steps=8");
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_TRUE(fs::exists(full.dir / "model/config.json"));
  EXPECT_TRUE(fs::exists(full.dir / "model/model.safetensors"));
  auto l = step_losses(full.dir);
  EXPECT_LT(l.back(), l.front());
}

TEST(Train, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  // A scale so large that the scaled loss overflows: the first steps are skipped, each
  // halving the scale, then training proceeds.
  TrainRun r = train(temp_dir(), "training.fp16=true training.fp16_init_scale=1e39 training.max_steps=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto m = metrics(r.dir);
  int skipped = 0;
  double prev_scale = 1e39;
  for (const auto& row : m) {
    if (!row.contains("loss_scale")) continue;
    bool skip = false;
    for (const auto& e : row["events"]) skip = skip || e["kind"] == "skip";
    double s = row["loss_scale"].get<double>();
    if (skip) {
      ++skipped;
      EXPECT_DOUBLE_EQ(s, prev_scale / 2);
    }
    prev_scale = s;
  }
  EXPECT_GE(skipped, 1) << r.output;
  EXPECT_NE(r.output.find("update skipped"), std::string::npos);
}

// bnb_4bit_compute_dtype: float16 runs fp16's dynamic loss scaling, as training.fp16 does (on a
// CPU the matmuls stay fp32 and the scaling runs as it would on a GPU): a scale so large that
// the scaled loss overflows skips the first steps. With float32 the same scale is never applied.
int skipped_steps(const fs::path& out) {
  int skipped = 0;
  for (const auto& row : metrics(out))
    for (const auto& e : row.value("events", json::array())) skipped += e["kind"] == "skip";
  return skipped;
}

TEST(Train, Float16ComputeDtypeScalesTheLossAsFp16Does) {
  const fs::path d = temp_dir();
  const std::string args = "training.fp16_init_scale=1e39 training.max_steps=3 model.quantization_config.";
  TrainRun half = train(d / "half", args + "bnb_4bit_compute_dtype=float16");
  TrainRun single = train(d / "single", args + "bnb_4bit_compute_dtype=float32");
  ASSERT_EQ(half.exit_code, 0) << half.output;
  ASSERT_EQ(single.exit_code, 0) << single.output;
  EXPECT_GE(skipped_steps(half.dir), 1) << half.output;
  EXPECT_EQ(skipped_steps(single.dir), 0) << single.output;
  for (const auto& row : metrics(single.dir))
    if (row.contains("loss_scale")) {
      EXPECT_EQ(row["loss_scale"].get<double>(), 1.0);
    }
}

// PEFT sets fan_in_fan_out from the module (Conv1D: true, Linear: false) and warns when the
// config said otherwise: true on Llama's Linear projections is saved as false.
TEST(Train, FanInFanOutOnLinearProjectionsIsSavedFalseWithAWarning) {
  TrainRun r = train(temp_dir(), "lora.fan_in_fan_out=true training.max_steps=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lora.fan_in_fan_out is true, but this model's projections are Linear layers"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(json::parse(read_file(r.dir / "adapter/adapter_config.json"))["fan_in_fan_out"], false);
}

// model.architecture and model.init_seed shape a preset; with a model directory, whose
// config.json and weights decide, each is refused by name (they changed nothing before).
TEST(Train, PresetKeysBesideAModelDirectoryAreRefused) {
  const fs::path d = temp_dir();
  ASSERT_EQ(run(memtune_bin() + " init-model --preset tiny-llama --out " + (d / "tiny").string()).exit_code, 0);
  const std::string model = " model.name_or_path=" + (d / "tiny").string();
  TrainRun arch = train(d / "a", model + " model.architecture=gpt2");
  EXPECT_EQ(arch.exit_code, 2) << arch.output;
  EXPECT_NE(arch.output.find("model.architecture: 'gpt2' picks a preset's architecture"), std::string::npos)
      << arch.output;
  TrainRun seed = train(d / "s", model + " model.init_seed=5");
  EXPECT_EQ(seed.exit_code, 2) << seed.output;
  EXPECT_NE(seed.output.find("model.init_seed: 5 seeds a preset's random weights"), std::string::npos) << seed.output;
  TrainRun plain = train(d / "p", model + " training.max_steps=1");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;

  // attention_dropout, which transformers applies in training, memtune applies too: the run
  // says so and its loss moves off the plain run's; evaluation has no dropout in either.
  json config = json::parse(read_file(d / "tiny/config.json"));
  config["attention_dropout"] = 0.1;
  write_file(d / "tiny/config.json", config.dump());
  TrainRun dropout = train(d / "dr", model + " training.max_steps=1");
  EXPECT_EQ(dropout.exit_code, 0) << dropout.output;
  EXPECT_NE(dropout.output.find("dropout in training, from config.json: attention_dropout 0.1"), std::string::npos)
      << dropout.output;
  ASSERT_EQ(step_losses(dropout.dir).size(), 1u);
  EXPECT_GT(std::abs(step_losses(dropout.dir)[0] - step_losses(plain.dir)[0]), 1e-5);
  // A rate of 1 loads (nn.Dropout takes it) but would drop everything: training refuses it.
  config["attention_dropout"] = 1.0;
  write_file(d / "tiny/config.json", config.dump());
  TrainRun all = train(d / "all", model + " training.max_steps=1");
  EXPECT_EQ(all.exit_code, 2) << all.output;
  EXPECT_NE(all.output.find("a dropout rate of 1 drops every value in training"), std::string::npos) << all.output;
  config["attention_dropout"] = 0.1;
  write_file(d / "tiny/config.json", config.dump());
  const auto eval = run(memtune_bin() + " eval --model " + (d / "tiny").string() + " --data " +
                        (source_dir() / "examples/data/tasks_eval.jsonl").string() + " --format instruction --tokenizer " +
                        (source_dir() / "examples/tiny-tokenizer").string() + " --max-seq-length 64");
  EXPECT_EQ(eval.exit_code, 0) << eval.output;
}

// Exact-match accuracy renders prompts and reads answers as text: a model without a tokenizer
// (token files) has neither, and the key is refused by name rather than skipped.
TEST(Train, AccuracyRowsWithoutATokenizerAreRefused) {
  const fs::path d = temp_dir();
  std::string tokens(1024, '\0');
  const int32_t header[3] = {20240520, 1, 600};
  std::memcpy(&tokens[0], header, sizeof header);
  for (int i = 0; i < 600; ++i) tokens += std::string{static_cast<char>(i % 97 + 3), '\0'};  // uint16 ids
  write_file(d / "t.bin", tokens);
  const std::string config = "model: {name_or_path: tiny-llama}\nruntime: {device: cpu}\n"
                             "training: {output_dir: " + (d / "out").string() + ", max_steps: 1, eval_accuracy_rows: 4}\n"
                             "data: {train_file: " + (d / "t.bin").string() + ", eval_file: " + (d / "t.bin").string() +
                             ", format: tokens, max_seq_length: 32}\n";
  TrainRun r = train(d / "run", "", config);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("training.eval_accuracy_rows: 4 rows are answered by rendering their prompts"),
            std::string::npos)
      << r.output;
  TrainRun without = train(d / "run2", "training.eval_accuracy_rows=0 training.output_dir=" + (d / "out2").string(), config);
  EXPECT_EQ(without.exit_code, 0) << without.output;
}

TEST(Train, Bf16ComputesInBf16) {
  // The same run in fp32 and in bf16: bf16's 8-bit mantissa changes every loss a little
  // (so it really computed in bf16, not fp32 with a bf16 label), and no more than
  // rounding would (so it is the same computation).
  const fs::path d = temp_dir();
  const std::string run_args = "training.max_steps=3";
  TrainRun fp32 = train(d / "fp32", run_args);
  TrainRun bf16 = train(d / "bf16", run_args + " training.bf16=true");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const auto a = step_losses(fp32.dir), b = step_losses(bf16.dir);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_GT(a[i], 1.0) << "step " << i << ": no target tokens, nothing was compared";
    EXPECT_NE(a[i], b[i]) << "step " << i << ": bf16 gave fp32's loss exactly";
    EXPECT_NEAR(a[i], b[i], 0.02 * a[i]) << "step " << i;
  }
}

}  // namespace
}  // namespace memtune::testing
