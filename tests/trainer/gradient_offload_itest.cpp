// Gradient offload through the real command (memory.optimizer_offload: cpu takes the
// gradients to host memory as backward produces them, trainer/gradient_offload.h): a full
// fine-tune with accumulation and clipping equals the run whose gradients stay on the
// device bit for bit, its peak is lower by the gradients' bytes (parameter count x 4), and
// the supervisor's ladder reaches it after injected OOMs and keeps it across a resume.
#include <gtest/gtest.h>

#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "trainer/train_state.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

// tiny-llama (models/model_spec.cpp): vocab 1024, hidden 128, MLP 344, 4 layers, 4 heads of
// 32 with 2 key/value heads, untied head. Its parameters, counted from those shapes.
constexpr int64_t kV = 1024, kC = 128, kI = 344, kL = 4, kKv = 2 * 32;
constexpr int64_t kLayer = kC * kC + 2 * kC * kKv + kC * kC + 3 * kC * kI + 2 * kC;
constexpr int64_t kParams = kV * kC + kL * kLayer + kC + kV * kC;  // 988288
constexpr int64_t kGradientBytes = kParams * 4;

std::string config(const fs::path& out, const std::string& model = "tiny-llama") {
  const fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: " + model + "\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "  quantization_config: {load_in_4bit: false}\n"
         "runtime: {device: cpu}\n"
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  finetune: full\n"
         "  per_device_train_batch_size: 2\n"
         "  gradient_accumulation_steps: 3\n"
         "  learning_rate: 1.0e-3\n"
         "  lr_scheduler_type: constant\n"
         "  max_grad_norm: 0.05\n"  // every step's norm is above it: clipping on
         "  max_steps: 4\n"
         "  save_steps: 0\n"
         "  seed: 3\n"
         "memory: {grow_after_steps: 1000}\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 64\n"
         "  cache_dir: " + (out.parent_path().parent_path() / "cache").string() + "\n";
}

struct TrainRun {
  int exit_code;
  std::string output;
  fs::path out;
};

TrainRun train(const fs::path& dir, const std::string& overrides, const std::string& model = "tiny-llama") {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", config(dir / "out", model));
  auto r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides, 600);
  return {r.exit_code, r.output, dir / "out"};
}

std::vector<json> rows(const fs::path& out) { return read_jsonl(out / "metrics.jsonl", "loss"); }

// Bit for bit: every step's loss, norm and loss scale as written, and every final weight.
void expect_identical(const fs::path& a, const fs::path& b) {
  const auto ra = rows(a), rb = rows(b);
  ASSERT_EQ(ra.size(), rb.size());
  ASSERT_FALSE(ra.empty());
  for (size_t i = 0; i < ra.size(); ++i)
    for (const char* key : {"loss", "grad_norm", "loss_scale", "tokens"}) EXPECT_EQ(ra[i][key], rb[i][key]) << key << " at step " << i;
  const auto ta = load_all_tensors(a / "model/model.safetensors"), tb = load_all_tensors(b / "model/model.safetensors");
  ASSERT_EQ(ta.size(), tb.size());
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << name;
    EXPECT_TRUE(at::equal(t, tb.at(name))) << name;
  }
}

int64_t phase_peak(const fs::path& out, const std::string& phase) {
  const std::string report = read_file(out / "memory_report.txt");
  const std::string key = "peak in " + phase + ":";
  const size_t at = report.find(key);
  EXPECT_NE(at, std::string::npos) << report;
  std::istringstream in(report.substr(at + key.size()));
  double value = 0;
  std::string unit;
  in >> value >> unit;
  const double scale = unit == "KiB" ? 1024.0 : unit == "MiB" ? 1048576.0 : unit == "GiB" ? 1073741824.0 : 1.0;
  return static_cast<int64_t>(value * scale);
}

// paged_adamw_32bit keeps its state in host memory either way, so the two runs differ in
// where the gradients are and nothing else: the step's peak drops by the gradients' bytes.
TEST(GradientOffload, FullFineTuneWithAccumulationAndClippingIsBitIdenticalAndDropsTheGradientBytes) {
  const fs::path d = temp_dir();
  const TrainRun kept = train(d / "kept", "training.optim=paged_adamw_32bit");
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  const TrainRun off = train(d / "off", "training.optim=paged_adamw_32bit memory.optimizer_offload=cpu");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(off.output.find("gradients ("), std::string::npos) << off.output;
  expect_identical(kept.out, off.out);
  for (const auto& r : rows(off.out)) EXPECT_GT(r["grad_norm"].get<double>(), 0.05) << "clipping was not exercised";
  const auto rk = rows(kept.out), ro = rows(off.out);
  for (size_t i = 0; i < rk.size(); ++i) {
    const int64_t drop = rk[i]["memory"]["cpu"]["peak"].get<int64_t>() - ro[i]["memory"]["cpu"]["peak"].get<int64_t>();
    EXPECT_NEAR(static_cast<double>(drop), static_cast<double>(kGradientBytes), 0.02 * kGradientBytes) << "step " << i;
  }
  // The update held every gradient on the device; offloaded, none (the report's 2 decimals).
  EXPECT_NEAR(static_cast<double>(phase_peak(kept.out, "optimizer") - phase_peak(off.out, "optimizer")),
              static_cast<double>(kGradientBytes), 0.02 * kGradientBytes);
}

// tiny-gpt2's shape (models/model_spec.cpp: hidden 128, 4 layers of 4 heads, the head tied to
// the embedding) with a vocabulary of 8192, so that one (V,C) fp32 tensor (4 MiB) stands above
// a layer's work; written by `memtune init-model --config`. Its parameters, from those shapes.
constexpr int64_t kTiedV = 8192, kTiedPositions = 1024;
constexpr int64_t kTiedLayer = 12 * kC * kC + 13 * kC;  // c_attn, c_proj, c_fc, mlp c_proj with biases; two LayerNorms
constexpr int64_t kTiedParams = kTiedV * kC + kTiedPositions * kC + kL * kTiedLayer + 2 * kC;
constexpr int64_t kTiedVC = kTiedV * kC * 4;

// Offloaded, the tied head's gradient goes to the host as the loss's backward makes it
// (GradientOffload::tap) and meets the embedding's there: the same bits as autograd's sum on
// the device, over three micro-batches a step and clipping. On the device the end of backward
// holds every gradient and three (V,C) tensors: the head's, waiting in autograd's input buffer
// since the loss's backward, the embedding's and their sum; offloaded, the embedding's alone.
TEST(GradientOffload, TiedHeadFullFineTuneIsBitIdenticalAndItsBackwardHoldsOneVocabularyTensor) {
  const fs::path d = temp_dir();
  fs::create_directories(d);
  write_file(d / "config.json", "{\"model_type\": \"gpt2\", \"vocab_size\": 8192, \"n_embd\": 128, \"n_layer\": 4, "
                                "\"n_head\": 4, \"n_positions\": 1024}");
  const auto init = run(memtune_bin() + " init-model --config " + (d / "config.json").string() + " --out " +
                        (d / "model").string() + " --seed 5");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const std::string model = (d / "model").string();
  // Every layer checkpointed, its input in host memory: the (V,C) tensors stand out.
  const std::string shape = "training.optim=paged_adamw_32bit training.gradient_checkpointing=true "
                            "training.activation_offload=checkpoints";
  const TrainRun kept = train(d / "kept", shape, model);
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  const TrainRun off = train(d / "off", shape + " memory.optimizer_offload=cpu", model);
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(off.output.find("gradients ("), std::string::npos) << off.output;
  expect_identical(kept.out, off.out);
  for (const auto& r : rows(off.out)) EXPECT_GT(r["grad_norm"].get<double>(), 0.05) << "clipping was not exercised";

  // The report's peaks have two decimals of a MiB; the state is paged (host) in both runs, so
  // offloaded, the update holds the weights alone.
  const double weights = static_cast<double>(kTiedParams * 4);
  EXPECT_NEAR(static_cast<double>(phase_peak(off.out, "optimizer")), weights, 0.01 * weights);
  const double drop = static_cast<double>(phase_peak(kept.out, "backward") - phase_peak(off.out, "backward"));
  EXPECT_NEAR(drop, weights + 2.0 * kTiedVC, 0.02 * (weights + 2.0 * kTiedVC)) << "gradients + 2 x (V,C) expected";
  // Offloaded, one (V,C) above the weights: the loss's dW (scaled in place) at the start, the
  // embedding's gradient at the end; and a layer's work (under a tenth of it here).
  EXPECT_NEAR(static_cast<double>(phase_peak(off.out, "backward")) - weights, static_cast<double>(kTiedVC),
              0.1 * kTiedVC);
}

// torch's AdamW with its state on the device against both halves offloaded; and fp16's
// GradScaler: a scale so large the first steps overflow, skipped alike (the inf check reads
// the host gradients).
class GradientOffloadSame : public ::testing::TestWithParam<std::string> {};

TEST_P(GradientOffloadSame, AsTheRunWithEverythingOnTheDevice) {
  const fs::path d = temp_dir();
  const TrainRun kept = train(d / "kept", GetParam());
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  const TrainRun off = train(d / "off", GetParam() + " memory.optimizer_offload=cpu");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(off.output.find("optimizer state ("), std::string::npos) << off.output;
  EXPECT_NE(off.output.find("gradients ("), std::string::npos) << off.output;
  expect_identical(kept.out, off.out);
  if (GetParam().find("fp16") != std::string::npos) {
    int skipped = 0;
    for (const auto& r : rows(off.out))
      for (const auto& e : r["events"]) skipped += e["kind"] == "skip";
    EXPECT_GE(skipped, 1) << "no step overflowed";
  }
}

INSTANTIATE_TEST_SUITE_P(Updates, GradientOffloadSame,
                         ::testing::Values("training.optim=adamw_torch training.weight_decay=0.01",
                                           "training.optim=adamw_torch training.fp16=true training.fp16_init_scale=1e39"));

// OOMs injected at step 0 in backward, then in the optimizer's preparation: the ladder
// [optimizer_offload, checkpointing] offloads the state and the gradients, then checkpoints
// layer 0; the run equals one configured with both from the start, and its checkpoint keeps
// the plan, so a run resumed from step 2 offloads the gradients again and ends the same.
TEST(GradientOffload, LadderAfterOomsInBackwardAndOptimizerEqualsTheSettledPlanAndSurvivesAResume) {
  const fs::path d = temp_dir();
  const TrainRun ref = train(d / "ref", "memory.optimizer_offload=cpu "
                                   "\"training.gradient_checkpointing={policy: layers, layers: [0]}\"");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const TrainRun ladder = train(d / "ladder", "training.save_steps=2 memory.inject_oom=0:backward,0:optimizer "
                                         "\"memory.on_oom.ladder=[optimizer_offload, checkpointing]\"");
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  std::vector<std::string> rungs;
  for (const auto& r : rows(ladder.out))
    for (const auto& e : r["events"])
      if (e["kind"] == "ladder") rungs.push_back(e["detail"].get<std::string>());
  ASSERT_EQ(rungs.size(), 2u) << ladder.output;
  EXPECT_NE(rungs[0].find("gradients ("), std::string::npos) << rungs[0];
  EXPECT_NE(rungs[1].find("checkpointing layer 0"), std::string::npos) << rungs[1];
  expect_identical(ref.out, ladder.out);
  const auto ref_rows = rows(ref.out), ladder_rows = rows(ladder.out);
  for (size_t i = 0; i < ref_rows.size(); ++i)
    EXPECT_EQ(ladder_rows[i]["memory"]["cpu"]["peak"], ref_rows[i]["memory"]["cpu"]["peak"]) << "step " << i;

  const fs::path step2 = ladder.out / "checkpoints/step-2";
  ASSERT_TRUE(trainer::load_training_checkpoint(step2).state.optimizer_offload);
  const TrainRun resumed = train(d / "resumed", "\"memory.on_oom.ladder=[optimizer_offload, checkpointing]\" "
                                           "training.resume_from_checkpoint=" + step2.string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("gradients ("), std::string::npos) << resumed.output;
  const auto tr = load_all_tensors(resumed.out / "model/model.safetensors"),
             tl = load_all_tensors(ladder.out / "model/model.safetensors");
  ASSERT_EQ(tr.size(), tl.size());
  for (const auto& [name, t] : tl) EXPECT_TRUE(at::equal(t, tr.at(name))) << name;
  const auto rr = rows(resumed.out);
  ASSERT_EQ(rr.size(), 2u);
  for (size_t i = 0; i < rr.size(); ++i) {
    EXPECT_EQ(rr[i]["loss"], ladder_rows[i + 2]["loss"]) << "step " << i + 2;
    EXPECT_EQ(rr[i]["memory"]["cpu"]["peak"], ladder_rows[i + 2]["memory"]["cpu"]["peak"]) << "step " << i + 2;
  }
}

// The estimate counts offloaded gradients as off the device, so the pre-flight check and the
// ladder choose by it: under an 8,000,000-byte budget (the estimate at micro-batch 1 with every
// layer checkpointed is 8.9 MB with the gradients on the device, 5.7 MB without) a run whose
// ladder lacks optimizer_offload is refused before loading, and one whose ladder has it
// settles under the budget with gradient offload, with the losses of the unconstrained run.
TEST(GradientOffload, ABudgetBelowTheHeldGradientsIsRefusedWithoutTheRungAndFitsWithIt) {
  const fs::path d = temp_dir();
  const std::string shape = "training.optim=paged_adamw_32bit memory.device_limit=8000000 ";
  const TrainRun refused = train(d / "refused", shape + "\"memory.on_oom.ladder=[micro_batch, checkpointing]\"");
  EXPECT_EQ(refused.exit_code, 3) << refused.output;
  EXPECT_FALSE(fs::exists(refused.out / "metrics.jsonl")) << "refused before training, not stopped in it";
  const TrainRun fits = train(d / "fits", shape);
  ASSERT_EQ(fits.exit_code, 0) << fits.output;
  bool offloaded = false;
  for (const auto& r : rows(fits.out)) {
    EXPECT_LE(r["memory"]["cpu"]["peak"].get<int64_t>(), 8000000) << r.dump();
    for (const auto& e : r["events"])
      offloaded = offloaded || (e["kind"] == "ladder" && e["detail"].get<std::string>().find("gradients (") != std::string::npos);
  }
  EXPECT_TRUE(offloaded) << fits.output;
  const TrainRun free = train(d / "free", "training.optim=paged_adamw_32bit");
  ASSERT_EQ(free.exit_code, 0) << free.output;
  const auto rf = rows(free.out), rb = rows(fits.out);
  ASSERT_EQ(rf.size(), rb.size());
  for (size_t i = 0; i < rf.size(); ++i)
    EXPECT_NEAR(rf[i]["loss"].get<double>(), rb[i]["loss"].get<double>(), 1e-5) << "step " << i;
}

}  // namespace
}  // namespace memtune::testing
