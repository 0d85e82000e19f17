// The memory supervisor through the real command: out-of-memory errors injected at exact
// points (forward, backward, optimizer) and real ones from a device budget. The math must
// not change: per-step losses and the final adapter equal a run that used the smaller
// micro-batch from the start, and every step sees the same samples.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "test_util.h"
#include "trainer/train_state.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

std::string config(const fs::path& out, int seq = 64) {
  fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "  quantization_config: {load_in_4bit: true}\n"
         "lora: {r: 4, lora_alpha: 8, target_modules: all-linear}\n"
         "runtime: {device: cpu}\n"  // CPU budgets and fp32, on a GPU machine too
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  per_device_train_batch_size: 4\n"
         "  gradient_accumulation_steps: 2\n"
         "  learning_rate: 1.0e-3\n"
         "  max_steps: 6\n"
         "  seed: 3\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: " + std::to_string(seq) + "\n"
         "  cache_dir: " + (out.parent_path() / "cache").string() + "\n";
}

struct TrainRun {
  int exit_code;
  std::string output;
  fs::path out;
};

TrainRun train(const fs::path& dir, const std::string& overrides, int seq = 64) {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", config(dir / "out", seq));
  auto r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides, 600);
  return {r.exit_code, r.output, dir / "out"};
}

std::vector<json> rows(const fs::path& out) { return read_jsonl(out / "metrics.jsonl", "loss"); }

std::vector<std::string> event_kinds(const fs::path& out) {
  std::vector<std::string> kinds;
  for (const auto& r : rows(out))
    for (const auto& e : r["events"]) kinds.push_back(e["kind"].get<std::string>());
  return kinds;
}

// The details of the ladder events in metrics.jsonl, in order ("offload layers: offloaded layer 3").
std::vector<std::string> ladder_events(const fs::path& out) {
  std::vector<std::string> details;
  for (const auto& r : rows(out))
    for (const auto& e : r["events"])
      if (e["kind"] == "ladder") details.push_back(e["detail"].get<std::string>());
  return details;
}

// The same per-step losses and samples, and the same trained tensors (the adapter, or the
// whole model of a full fine-tune).
// Losses within `tol`, and the trained weights within `weight_tol` (default `tol`): Adam
// moves a weight whose gradient is near its eps (1e-8) by up to the learning rate on
// summation-order noise, so a run split differently can differ there by ~1e-5 after a few
// steps of 1e-3 (measured: 1.3e-5 on GPT-2's full fine-tune without dropout; 1.45e-5 for one
// element of an adapter's 36,992 on a Zen 5, the others within 1e-7). Such elements are rare:
// with a `weight_tol` above `tol`, at most one trained element in 1000 may differ by more than
// `tol` (GPT-2's: 3 of 1,055,488). A mask drawn differently moves the losses by more than
// 3e-5 (each dropout test checks its run without dropout), and the weights nearly everywhere.
void expect_same_run(const fs::path& a, const fs::path& b, double tol, double weight_tol = -1) {
  if (weight_tol < 0) weight_tol = tol;
  auto ra = rows(a), rb = rows(b);
  ASSERT_EQ(ra.size(), rb.size());
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_NEAR(ra[i]["loss"].get<double>(), rb[i]["loss"].get<double>(), tol) << "step " << i;
    EXPECT_EQ(ra[i]["tokens"], rb[i]["tokens"]) << "step " << i << ": not the same samples";
  }
  const fs::path trained = fs::exists(a / "adapter") ? "adapter/adapter_model.safetensors" : "model/model.safetensors";
  models::SafetensorsFile fa(a / trained), fb(b / trained);
  ASSERT_EQ(fa.names().size(), fb.names().size());
  int64_t elements = 0, beyond = 0;
  for (const auto& n : fa.names()) {
    const at::Tensor diff = (fa.load(n) - fb.load(n)).abs();
    EXPECT_LE(diff.max().item<double>(), weight_tol) << n;
    elements += diff.numel();
    beyond += (diff > tol).sum().item<int64_t>();
  }
  if (weight_tol > tol) {
    EXPECT_LE(beyond * 1000, elements) << beyond << " trained elements differ by more than " << tol;
  }
}

// memory.inject_oom's value for `n` out-of-memory errors in step 0's forward, one per attempt.
std::string ooms_in_step0_forward(int n) {
  std::string points;
  for (int i = 0; i < n; ++i) points += std::string(i ? "," : "") + "0:forward";
  return points;
}

class InjectedOom : public ::testing::TestWithParam<std::string> {};

TEST_P(InjectedOom, RunCompletesAndEqualsTheSmallerMicroBatchFromTheStart) {
  fs::path d = temp_dir();
  TrainRun ref = train(d / "ref", "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=4");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun oom = train(d / "oom", "memory.inject_oom=0:" + GetParam() + " memory.grow_after_steps=1000");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  auto kinds = event_kinds(oom.out);
  ASSERT_GE(kinds.size(), 2u) << oom.output;
  EXPECT_EQ(kinds[0], "oom");
  EXPECT_EQ(kinds[1], "shrink");
  EXPECT_EQ(rows(oom.out).front()["micro_batch"], 2);
  expect_same_run(oom.out, ref.out, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Phases, InjectedOom, ::testing::Values("forward", "backward", "optimizer"));

// A step's row names the micro-batch it ran at, not the one the supervisor chose after it:
// step 1 runs out of memory at 4 and completes at 2 x 4, then the supervisor grows back to 4
// (one step with headroom under a roomy budget), and step 2 runs at 4 x 2.
TEST(Supervisor, AStepsRowNamesTheMicroBatchItRanAt) {
  fs::path d = temp_dir();
  TrainRun r = train(d, "training.max_steps=2 memory.inject_oom=0:forward memory.device_limit=8GiB "
                        "memory.grow_after_steps=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = rows(r.out);
  ASSERT_EQ(steps.size(), 2u);
  std::vector<std::string> kinds;
  for (const auto& e : steps[0]["events"]) kinds.push_back(e["kind"].get<std::string>());
  EXPECT_EQ(kinds, (std::vector<std::string>{"oom", "shrink", "grow"})) << r.output;
  EXPECT_EQ(steps[0]["micro_batch"], 2);
  EXPECT_EQ(steps[0]["accumulation"], 4);
  EXPECT_EQ(steps[1]["micro_batch"], 4);
  EXPECT_EQ(steps[1]["accumulation"], 2);
}

// The peaks a step reports (metrics.jsonl, the memory report) are those of the attempt that
// completed: the failed micro-batch-4 attempt's forward does not count, so the OOM run's
// peaks equal those of the run that used micro-batch 2 from the start.
TEST(Supervisor, ReportedPeaksAreThoseOfTheAttemptThatCompleted) {
  fs::path d = temp_dir();
  TrainRun ref = train(d / "ref", "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=4 "
                                  "training.max_steps=2");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun oom = train(d / "oom", "memory.inject_oom=0:backward memory.grow_after_steps=1000 training.max_steps=2");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  EXPECT_EQ(rows(oom.out).front()["memory"]["cpu"]["peak"], rows(ref.out).front()["memory"]["cpu"]["peak"]);
  auto phase_lines = [](const fs::path& out) {
    std::string lines;
    std::istringstream in(read_file(out / "memory_report.txt"));
    for (std::string l; std::getline(in, l);)
      if (l.rfind("peak in", 0) == 0) lines += l + "\n";
    return lines;
  };
  EXPECT_FALSE(phase_lines(ref.out).empty());
  EXPECT_EQ(phase_lines(oom.out), phase_lines(ref.out));
}

// With LoRA dropout (the recipes' 0.05), an OOM run equals the run configured with the
// micro-batch it started from, not only the one it ended at: each sample's masks follow the
// sample (runtime/keyed_dropout.h), so splitting the step differently draws the same ones.
// Plain dropout drew from one stream in batch order (step 2 differed by 4e-4 here).
TEST(Supervisor, WithDropoutTheSplitDoesNotChangeTheMath) {
  fs::path d = temp_dir();
  const std::string dropout = "lora.lora_dropout=0.1 training.max_steps=4 ";
  TrainRun as_configured = train(d / "configured", dropout);
  ASSERT_EQ(as_configured.exit_code, 0) << as_configured.output;
  TrainRun oom = train(d / "oom", dropout + "memory.inject_oom=0:backward memory.grow_after_steps=1000");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  EXPECT_EQ(rows(oom.out).front()["micro_batch"], 2);
  expect_same_run(oom.out, as_configured.out, 1e-5, 5e-5);  // Adam near its eps: see expect_same_run
  // Recomputed under checkpointing, the masks are drawn again the same.
  TrainRun ckpt = train(d / "ckpt", dropout + "training.gradient_checkpointing=true");
  ASSERT_EQ(ckpt.exit_code, 0) << ckpt.output;
  expect_same_run(ckpt.out, as_configured.out, 1e-6);
  // And dropout is on: without it the run differs, by several times the tolerance above.
  TrainRun none = train(d / "none", "training.max_steps=4");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_GT(std::abs(rows(none.out).back()["loss"].get<double>() - rows(as_configured.out).back()["loss"].get<double>()),
            3e-5);
}

// NEFTune (training.neftune_noise_alpha) draws each sample's noise from its key, scaled by
// the length of its micro-batch as configured: a retry at a smaller micro-batch and a
// checkpointed run equal the configured run; the noise is on (the run without differs),
// and evaluation has none (its loss before training is the plain run's).
TEST(Supervisor, WithNeftuneTheSplitDoesNotChangeTheMath) {
  fs::path d = temp_dir();
  // Unpacked rows of very different lengths: a micro-batch of 2 pads to another length than
  // the configured 4 around it.
  std::string text;
  for (int i = 0; i < 24; ++i) {
    std::string t = "sample";
    for (int w = 0; w < (i * 11) % 40; ++w) t += " w" + std::to_string(w);
    text += json{{"text", t}}.dump() + "\n";
  }
  write_file(d / "mixed.jsonl", text);
  const std::string eval = "data.format=text data.max_seq_length=256 data.pack_sequences=false data.train_file=" +
                           (d / "mixed.jsonl").string() + " data.eval_file=" + (d / "mixed.jsonl").string() + " ";
  const std::string neftune = eval + "training.neftune_noise_alpha=5 training.max_steps=4 ";
  TrainRun as_configured = train(d / "configured", neftune);
  ASSERT_EQ(as_configured.exit_code, 0) << as_configured.output;
  TrainRun oom = train(d / "oom", neftune + "memory.inject_oom=0:backward memory.grow_after_steps=1000");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  EXPECT_EQ(rows(oom.out).front()["micro_batch"], 2);
  expect_same_run(oom.out, as_configured.out, 1e-5, 5e-5);
  TrainRun ckpt = train(d / "ckpt", neftune + "training.gradient_checkpointing=true");
  ASSERT_EQ(ckpt.exit_code, 0) << ckpt.output;
  expect_same_run(ckpt.out, as_configured.out, 1e-6);
  TrainRun none = train(d / "none", eval + "training.max_steps=4");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  auto first_loss = [](const fs::path& out) {
    for (const auto& r : rows(out))
      if (r.contains("loss")) return r["loss"].get<double>();
    return 0.0;
  };
  EXPECT_GT(std::abs(first_loss(none.out) - first_loss(as_configured.out)), 1e-4);
  auto eval_before = [](const fs::path& out) {
    for (const auto& r : read_jsonl(out / "metrics.jsonl"))
      if (r.contains("when") && r["when"] == "before training") return r["eval_loss"].get<double>();
    return -1.0;
  };
  EXPECT_EQ(eval_before(none.out), eval_before(as_configured.out));
}

// GPT-2's own dropout, as transformers applies it in training (embd_pdrop on the embeddings,
// attn_pdrop on the attention probabilities, resid_pdrop on each sublayer's output), follows
// each sample as LoRA's does: a retry at a smaller micro-batch and a checkpointed run equal
// the configured run, and the dropout is on (the run without it differs).
TEST(Supervisor, WithGpt2DropoutTheSplitDoesNotChangeTheMath) {
  fs::path d = temp_dir();
  const std::string tokenizer = (source_dir() / "examples/tiny-tokenizer").string();
  for (const char* name : {"dropped", "plain"}) {
    auto init = run(memtune_bin() + " init-model --preset tiny-gpt2 --tokenizer " + tokenizer + " --out " +
                    (d / name).string());
    ASSERT_EQ(init.exit_code, 0) << init.output;
  }
  json c = json::parse(read_file(d / "dropped/config.json"));
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) c[key] = 0.1;
  write_file(d / "dropped/config.json", c.dump(2));
  auto gpt2 = [&](const char* model) {
    return "model.name_or_path=" + (d / model).string() + " model.tokenizer=" + tokenizer +
           " model.quantization_config.load_in_4bit=false training.finetune=full training.max_steps=4 ";
  };
  TrainRun as_configured = train(d / "configured", gpt2("dropped"));
  ASSERT_EQ(as_configured.exit_code, 0) << as_configured.output;
  EXPECT_NE(as_configured.output.find("dropout in training, from config.json: resid_pdrop 0.1, embd_pdrop 0.1, "
                                      "attn_pdrop 0.1"),
            std::string::npos)
      << as_configured.output;
  TrainRun oom = train(d / "oom", gpt2("dropped") + "memory.inject_oom=0:backward memory.grow_after_steps=1000");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  EXPECT_EQ(rows(oom.out).front()["micro_batch"], 2);
  expect_same_run(oom.out, as_configured.out, 1e-5, 5e-5);  // every weight trained: see expect_same_run
  TrainRun ckpt = train(d / "ckpt", gpt2("dropped") + "training.gradient_checkpointing=true");
  ASSERT_EQ(ckpt.exit_code, 0) << ckpt.output;
  expect_same_run(ckpt.out, as_configured.out, 1e-6);
  TrainRun none = train(d / "none", gpt2("plain"));
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_EQ(none.output.find("dropout in training"), std::string::npos) << none.output;
  EXPECT_GT(std::abs(rows(none.out).back()["loss"].get<double>() - rows(as_configured.out).back()["loss"].get<double>()),
            3e-5);
}

// The same on a GPU: a retry after an out-of-memory error, at a smaller micro-batch, draws
// the masks the configured run drew there (fp32 compute; cuBLAS sums in another order at
// another batch shape, hence 1e-5).
TEST(Supervisor, OnTheGpuWithDropoutARetryDoesNotChangeTheMath_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  fs::path d = temp_dir();
  const std::string dropout = "lora.lora_dropout=0.1 training.max_steps=4 runtime.device=cuda:0 "
                              "model.quantization_config.bnb_4bit_compute_dtype=float32 ";
  TrainRun as_configured = train(d / "configured", dropout);
  ASSERT_EQ(as_configured.exit_code, 0) << as_configured.output;
  TrainRun oom = train(d / "oom", dropout + "memory.inject_oom=0:backward,2:forward memory.grow_after_steps=1000");
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  EXPECT_EQ(rows(oom.out).front()["micro_batch"], 2);
  expect_same_run(oom.out, as_configured.out, 1e-5);
  TrainRun none = train(d / "none", "training.max_steps=4 runtime.device=cuda:0 "
                                    "model.quantization_config.bnb_4bit_compute_dtype=float32");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_GT(std::abs(rows(none.out).back()["loss"].get<double>() - rows(as_configured.out).back()["loss"].get<double>()),
            3e-5) << "dropout is on";
}

TEST(Supervisor, GrowsBackAndUndoesAFailedGrow) {
  // A roomy budget so steps count as headroom; OOM at step 0 shrinks 4 -> 2; after 2 good
  // steps it grows to 4; an OOM injected at that step sends it back to 2, waiting longer.
  TrainRun r = train(temp_dir(), "memory.device_limit=8GiB memory.inject_oom=0:forward,2:forward memory.grow_after_steps=2 "
                            "memory.grow_threshold=0.9");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto kinds = event_kinds(r.out);
  std::vector<std::string> want = {"oom", "shrink", "grow", "oom", "grow_failed"};
  ASSERT_GE(kinds.size(), want.size()) << r.output;
  EXPECT_EQ(std::vector<std::string>(kinds.begin(), kinds.begin() + 5), want) << r.output;
}

TEST(Supervisor, RealBudgetSettlesOnAMicroBatchThatFitsWithTheSameLosses) {
  fs::path d = temp_dir();
  // Evaluation asks for 16 rows at once too. Before the first step (the supervisor has not
  // settled yet) that runs out of memory, and it halves its micro-batch and runs the same rows
  // again; the final one takes at most the micro-batch training settled on. Both losses (sums
  // over tokens) are the reference's.
  const std::string shape = "training.per_device_train_batch_size=16 training.gradient_accumulation_steps=1 "
                            "data.max_seq_length=256 training.max_steps=3 training.per_device_eval_batch_size=16 "
                            "data.eval_file=" + (source_dir() / "examples/data/tasks_eval.jsonl").string();
  TrainRun ref = train(d / "ref", shape + " training.per_device_train_batch_size=1 training.gradient_accumulation_steps=16");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  // The budget: the micro-batch-1 run's peak plus a little; 16 rows at once cannot fit.
  int64_t peak1 = 0;
  for (const auto& r : rows(ref.out)) peak1 = std::max<int64_t>(peak1, r["memory"]["cpu"]["peak"].get<int64_t>());
  ASSERT_GT(peak1, 0);
  const int64_t limit = peak1 + peak1 / 4;
  TrainRun fit = train(d / "fit", shape + " memory.device_limit=" + std::to_string(limit) + " memory.grow_after_steps=1000");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  auto r = rows(fit.out);
  EXPECT_LT(r.back()["micro_batch"].get<int64_t>(), 16);
  for (const auto& row : r) {
    EXPECT_LE(row["memory"]["cpu"]["peak"].get<int64_t>(), limit);
    // A step that met an out-of-memory error says what it cost; the others say nothing.
    bool oom = false;
    for (const auto& e : row["events"]) oom = oom || e["kind"] == "oom";
    EXPECT_EQ(row.contains("oom_recovery_s"), oom) << row.dump();
    if (oom) {
      EXPECT_GT(row["oom_recovery_s"].get<double>(), 0.0) << row.dump();
    }
  }
  EXPECT_TRUE(r.front().contains("oom_recovery_s")) << "the first step ran out of memory at 16 rows";
  expect_same_run(fit.out, ref.out, 1e-5);
  const auto eval_fit = read_jsonl(fit.out / "metrics.jsonl", "eval_loss");
  const auto eval_ref = read_jsonl(ref.out / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(eval_fit.size(), 2u);
  ASSERT_EQ(eval_ref.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(eval_fit[i]["eval_loss"].get<double>(), eval_ref[i]["eval_loss"].get<double>(), 1e-5) << i;
    EXPECT_EQ(eval_fit[i]["eval_tokens"], eval_ref[i]["eval_tokens"]) << i;
  }
  EXPECT_NE(fit.output.find("eval (before training): out of memory at 16 samples at once"), std::string::npos)
      << fit.output;
}

// On a GPU, real CUDA out-of-memory errors, no injection: under memory.device_limit, and a
// micro-batch of 8192 rows of 1024 tokens (about 300 GB by the estimate) on the GPU's own
// memory. Both shrink, continue and equal a run at a micro-batch that fits from the start;
// the time from the error to the end of its step is in metrics.jsonl and printed.
TEST(Supervisor, RealCudaOutOfMemoryShrinksAndKeepsTheMath_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  fs::path d = temp_dir();
  const std::string gpu = " runtime.device=cuda:0 model.quantization_config.bnb_4bit_compute_dtype=float32 ";
  {
    // Rows of 1024 tokens, so that a row's activations (about 40 MB) outweigh the margin below.
    const std::string shape =
        gpu + "training.gradient_accumulation_steps=1 data.max_seq_length=1024 data.pack_sequences=true "
              "training.max_steps=3";
    TrainRun ref = train(d / "ref", shape + " training.per_device_train_batch_size=1 training.gradient_accumulation_steps=16");
    ASSERT_EQ(ref.exit_code, 0) << ref.output;
    int64_t peak1 = 0;
    for (const auto& r : rows(ref.out)) peak1 = std::max<int64_t>(peak1, r["memory"]["cuda:0"]["peak"].get<int64_t>());
    ASSERT_GT(peak1, 0);
    // The limit caps what the caching allocator reserves, which rounds segments up (2 and
    // 20 MiB) beyond the allocated peak measured: a fixed margin over it.
    const int64_t limit = peak1 + peak1 / 4 + (int64_t{64} << 20);
    TrainRun fit = train(d / "fit", shape + " training.per_device_train_batch_size=16 memory.device_limit=" +
                                        std::to_string(limit) + " memory.grow_after_steps=1000");
    ASSERT_EQ(fit.exit_code, 0) << fit.output;
    auto r = rows(fit.out);
    EXPECT_LT(r.back()["micro_batch"].get<int64_t>(), 16);
    ASSERT_TRUE(r.front().contains("oom_recovery_s")) << r.front().dump();
    std::printf("device_limit %lld: out of memory to the end of the step in %.3f s\n", static_cast<long long>(limit),
                r.front()["oom_recovery_s"].get<double>());
    expect_same_run(fit.out, ref.out, 1e-4);
  }
  const std::string big = gpu + "data.max_seq_length=1024 data.pack_sequences=true training.max_steps=2";
  TrainRun ref = train(d / "big_ref", big + " training.per_device_train_batch_size=1024 training.gradient_accumulation_steps=8");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  // 8192 rows a step on both sides (the config's accumulation of 2 would make it 16384 here).
  TrainRun all = train(d / "big", big + " training.per_device_train_batch_size=8192 training.gradient_accumulation_steps=1 "
                                        "memory.grow_after_steps=1000");
  ASSERT_EQ(all.exit_code, 0) << all.output;
  auto r = rows(all.out);
  ASSERT_FALSE(r.empty());
  EXPECT_LT(r.front()["micro_batch"].get<int64_t>(), 8192);
  ASSERT_TRUE(r.front().contains("oom_recovery_s")) << r.front().dump();
  std::printf("8192 x 1024 tokens on the whole GPU: settled at micro-batch %lld, out of memory to the end of the step "
              "in %.3f s\n", static_cast<long long>(r.front()["micro_batch"].get<int64_t>()),
              r.front()["oom_recovery_s"].get<double>());
  const auto want = rows(ref.out);
  ASSERT_EQ(r.size(), want.size());
  for (size_t i = 0; i < r.size(); ++i) {
    const double w = want[i]["loss"].get<double>();
    EXPECT_NEAR(r[i]["loss"].get<double>(), w, 1e-4 * w) << "step " << i;
    EXPECT_EQ(r[i]["tokens"], want[i]["tokens"]) << "step " << i;
  }
}

// Past micro-batch 1 the ladder checkpoints every layer, offloads the checkpointed layers'
// inputs, then the optimizer's state, to host memory: seven injected OOMs at step 0 take it
// through shrink (2 -> 1), four layers checkpointed, activation offload and optimizer
// offload; the run then equals one configured with all of them from the start (dropout
// included), and the rungs are in metrics.jsonl.
TEST(Supervisor, LadderReachesActivationAndOptimizerOffloadAndKeepsTheMath) {
  fs::path d = temp_dir();
  const std::string shape = "training.per_device_train_batch_size=2 training.max_steps=4 lora.lora_dropout=0.1 ";
  TrainRun ref = train(d / "ref", shape + "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4 "
                                          "training.gradient_checkpointing=true training.activation_offload=checkpoints "
                                          "memory.optimizer_offload=cpu");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun ladder = train(d / "ladder", shape + "memory.grow_after_steps=1000 memory.inject_oom=" + ooms_in_step0_forward(7));
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  const std::vector<std::string> rungs = ladder_events(ladder.out);
  ASSERT_EQ(rungs.size(), 6u) << ladder.output;
  for (int layer = 0; layer < 4; ++layer) EXPECT_NE(rungs[layer].find("checkpointing layer " + std::to_string(layer)),
                                                    std::string::npos) << rungs[layer];
  EXPECT_NE(rungs[4].find("activation offload"), std::string::npos) << rungs[4];
  EXPECT_NE(rungs[5].find("optimizer state"), std::string::npos) << rungs[5];
  expect_same_run(ladder.out, ref.out, 1e-6);
  // The settled plan is part of the checkpoint: a resume keeps it.
  const auto state = trainer::load_training_checkpoint(trainer::latest_checkpoint(ladder.out)).state;
  EXPECT_TRUE(state.activation_offload);
  EXPECT_TRUE(state.optimizer_offload);
}

// An LLM.int8 base (load_in_8bit) on a CPU, in training the product of each dequantized
// weight and so independent of the batch: a shrink, the ladder up to optimizer offload, and
// layer offload (the 8-bit codes moved to host memory, their row absmax left on the device)
// each equal the run configured with them from the start.
TEST(Supervisor, OnAnInt8BaseTheLadderAndLayerOffloadKeepTheMath) {
  fs::path d = temp_dir();
  const std::string shape = "model.quantization_config.load_in_4bit=false model.quantization_config.load_in_8bit=true "
                            "training.per_device_train_batch_size=2 training.max_steps=3 lora.lora_dropout=0.1 ";
  TrainRun ref = train(d / "ref", shape + "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=4 "
                                          "training.gradient_checkpointing=true training.activation_offload=checkpoints "
                                          "memory.optimizer_offload=cpu");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_NE(ref.output.find("LLM.int8 base"), std::string::npos) << ref.output;
  TrainRun ladder = train(d / "ladder", shape + "memory.grow_after_steps=1000 memory.inject_oom=" + ooms_in_step0_forward(7));
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  ASSERT_EQ(ladder_events(ladder.out).size(), 6u) << ladder.output;
  expect_same_run(ladder.out, ref.out, 1e-6);

  const std::string one = shape + "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=2 ";
  TrainRun layers = train(d / "layers", one + "'model.device_map={model.layers.0-2: cpu, model.layers.3: offload}'");
  ASSERT_EQ(layers.exit_code, 0) << layers.output;
  TrainRun rung = train(d / "rung", one + "memory.grow_after_steps=1000 \"memory.on_oom.ladder=[layer_offload]\" "
                                          "memory.inject_oom=1:backward");
  ASSERT_EQ(rung.exit_code, 0) << rung.output;
  const std::vector<std::string> taken = ladder_events(rung.out);
  ASSERT_EQ(taken.size(), 1u) << rung.output;
  EXPECT_NE(taken[0].find("offloaded layer 3"), std::string::npos) << taken[0];
  expect_same_run(rung.out, layers.out, 1e-6);
}

// Each rung that keeps the math, taken after an out-of-memory error in each phase of step 1
// (the micro-batch already 1, the ladder that rung alone): the run equals one configured with
// the rung from the start, and the rung is in metrics.jsonl's events and the report's timeline.
struct RungCase {
  std::string rung, phase, both, configured, event;
};
void PrintTo(const RungCase& c, std::ostream* os) { *os << c.rung << " at " << c.phase; }

class LadderRung : public ::testing::TestWithParam<RungCase> {};

TEST_P(LadderRung, TakenInAnyPhaseEqualsTheRunConfiguredWithIt) {
  const RungCase& c = GetParam();
  fs::path d = temp_dir();
  const std::string shape = "training.per_device_train_batch_size=1 training.gradient_accumulation_steps=2 "
                            "training.max_steps=3 lora.lora_dropout=0.1 " + c.both;
  TrainRun ref = train(d / "ref", shape + " " + c.configured);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun ladder = train(d / "ladder", shape + " memory.grow_after_steps=1000 \"memory.on_oom.ladder=[" + c.rung +
                                            "]\" memory.inject_oom=1:" + c.phase);
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  const std::vector<std::string> taken = ladder_events(ladder.out);
  ASSERT_EQ(taken.size(), 1u) << ladder.output;
  EXPECT_NE(taken[0].find(c.event), std::string::npos) << taken[0];
  EXPECT_NE(read_file(ladder.out / "memory_report.txt").find("step 1: ladder: " + taken[0]), std::string::npos)
      << read_file(ladder.out / "memory_report.txt");
  expect_same_run(ladder.out, ref.out, 1e-6);
}

std::vector<RungCase> rung_cases() {
  const std::vector<RungCase> rungs = {
      {"activation_offload", "", "training.gradient_checkpointing=true", "training.activation_offload=checkpoints",
       "activation offload"},
      {"optimizer_offload", "", "", "memory.optimizer_offload=cpu", "optimizer state"},
      {"layer_offload", "", "", "'model.device_map={model.layers.0-2: cpu, model.layers.3: offload}'",
       "offloaded layer 3"},
  };
  std::vector<RungCase> cases;
  for (const RungCase& r : rungs)
    for (const char* phase : {"forward", "backward", "optimizer"}) {
      cases.push_back(r);
      cases.back().phase = phase;
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EachPhase, LadderRung, ::testing::ValuesIn(rung_cases()),
                         [](const auto& info) { return info.param.rung + "_" + info.param.phase; });

// The cheapest rung that fits is taken alone. A dense LoRA run at micro-batch 1 under a limit
// that checkpointing every layer, activation offload and optimizer offload together cannot
// meet (by the estimate), while offloading the layers' weights alone can: climbing in order
// would have paid for the first three before reaching layer offload; the supervisor takes
// only layer offload, as `memtune estimate` says it will, and the run equals one configured
// with every layer offloaded from the start.
TEST(Supervisor, TheCheapestRungThatFitsIsTakenAlone) {
  fs::path d = temp_dir();
  const std::string shape = "model.quantization_config.load_in_4bit=false training.per_device_train_batch_size=1 "
                            "training.gradient_accumulation_steps=1 training.max_steps=3 memory.grow_after_steps=1000 ";
  fs::create_directories(d / "est");
  write_file(d / "est/c.yaml", config(d / "est/out", 256));
  auto peak = [&](const std::string& args) {
    auto r = run(memtune_bin() + " estimate " + (d / "est/c.yaml").string() + " --json " + shape + args, 120);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const json j = json::parse(r.output.substr(r.output.find('{'), r.output.rfind('}') - r.output.find('{') + 1));
    return j;
  };
  const int64_t in_order = peak("training.gradient_checkpointing=true training.activation_offload=checkpoints "
                                "memory.optimizer_offload=cpu")["peak_bytes"].get<int64_t>();
  const int64_t layers_off = peak("'model.device_map={model.layers.0-3: offload}'")["peak_bytes"].get<int64_t>();
  ASSERT_LT(layers_off, in_order * 0.8) << "no limit separates the two plans here";
  const int64_t limit = (layers_off + in_order) / 2;
  const std::string at = "memory.device_limit=" + std::to_string(limit);
  const json plan = peak(at)["ladder"];
  ASSERT_EQ(plan["steps"].size(), 1u) << plan.dump();
  EXPECT_EQ(plan["steps"][0].get<std::string>().rfind("layer offload (", 0), 0u) << plan.dump();

  TrainRun ladder = train(d / "ladder", shape + at, 256);
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  const std::vector<std::string> taken = ladder_events(ladder.out);
  EXPECT_FALSE(taken.empty()) << ladder.output;
  for (const auto& t : taken) EXPECT_NE(t.find("offload layers: offloaded layer"), std::string::npos) << t;
  TrainRun ref = train(d / "ref", shape + "'model.device_map={model.layers.0-3: offload}'", 256);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_NE(ladder.output.find("layer 3: offload"), std::string::npos) << "layer 3 was not offloaded at load";
  expect_same_run(ladder.out, ref.out, 1e-6);
}

// memory.on_oom.ladder sets the rungs and their order: without micro_batch the micro-batch
// stays at 2 and optimizer offload, listed first, comes before checkpointing. Three injected
// OOMs at step 0 take optimizer offload, then layers 0 and 1 checkpointed; the run equals one
// configured with those from the start.
TEST(Supervisor, TheConfiguredLadderKeepsTheMicroBatchAndItsOrder) {
  fs::path d = temp_dir();
  const std::string shape = "training.per_device_train_batch_size=2 training.max_steps=3 lora.lora_dropout=0.1 ";
  TrainRun ref = train(d / "ref", shape + "memory.optimizer_offload=cpu \"training.gradient_checkpointing={policy: layers, layers: [0, 1]}\"");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun ladder = train(d / "ladder", shape + "memory.grow_after_steps=1000 memory.inject_oom=0:forward,0:forward,0:backward "
                                                "\"memory.on_oom.ladder=[optimizer_offload, checkpointing]\"");
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  std::vector<std::string> rungs;
  for (const auto& r : rows(ladder.out)) {
    EXPECT_EQ(r["micro_batch"], 2) << r.dump();
    for (const auto& e : r["events"]) {
      EXPECT_NE(e["kind"], "shrink") << r.dump();
      if (e["kind"] == "ladder") rungs.push_back(e["detail"].get<std::string>());
    }
  }
  ASSERT_EQ(rungs.size(), 3u) << ladder.output;
  EXPECT_NE(rungs[0].find("optimizer state"), std::string::npos) << rungs[0];
  EXPECT_NE(rungs[1].find("checkpointing layer 0"), std::string::npos) << rungs[1];
  EXPECT_NE(rungs[2].find("checkpointing layer 1"), std::string::npos) << rungs[2];
  expect_same_run(ladder.out, ref.out, 1e-6);
}

// With headroom (a roomy budget), the supervisor grows back: it undoes the ladder in the
// reverse order it was climbed, two good steps per undo, then grows the micro-batch; the run
// keeps the math of the plain run all along.
TEST(Supervisor, GrowBackUndoesTheLadderInReverseAndKeepsTheMath) {
  fs::path d = temp_dir();
  const std::string shape = "training.per_device_train_batch_size=2 training.max_steps=16 lora.lora_dropout=0.1 "
                            "memory.device_limit=8GiB ";
  TrainRun plain = train(d / "plain", shape);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  TrainRun back = train(d / "back", shape + "memory.grow_after_steps=2 memory.inject_oom=" + ooms_in_step0_forward(7));
  ASSERT_EQ(back.exit_code, 0) << back.output;
  std::vector<std::string> grows;
  for (const auto& r : rows(back.out))
    for (const auto& e : r["events"])
      if (e["kind"] == "grow") grows.push_back(e["detail"].get<std::string>());
  ASSERT_EQ(grows.size(), 7u) << back.output;
  EXPECT_NE(grows[0].find("offload optimizer state: undid optimizer offload"), std::string::npos) << grows[0];
  EXPECT_NE(grows[1].find("offload activations: undid activation offload"), std::string::npos) << grows[1];
  for (int k = 0; k < 4; ++k)
    EXPECT_NE(grows[2 + k].find("undid checkpointing layer " + std::to_string(3 - k)), std::string::npos) << grows[2 + k];
  EXPECT_NE(grows[6].find("micro-batch 1 -> 2"), std::string::npos) << grows[6];
  EXPECT_EQ(rows(back.out).back()["micro_batch"], 2);
  expect_same_run(back.out, plain.out, 1e-5, 3e-5);  // 16 steps at two micro-batch sizes
}

// A plain full fine-tune (no saving configured) under a limit that cannot hold its AdamW
// state on the device, even with every other rung: tiny-llama's 3.8 MiB of weights take
// 3.8 MiB of gradients and 7.5 MiB of state, over 12 MiB with any activations, and about
// 7 MiB with the state and gradients in host memory. The ladder's optimizer offload is then
// taken before the first step (the state made in host memory: made on the device it would
// not fit), said as the run's first ladder event, and never grown back although every step
// has headroom. The run equals one configured with memory.optimizer_offload: cpu, and
// resumes to the same end.
TEST(Supervisor, AStateTheLimitCannotHoldIsMadeInHostMemoryBeforeTheFirstStep) {
  fs::path d = temp_dir();
  const std::string full = "training.finetune=full model.quantization_config.load_in_4bit=false "
                           "training.per_device_train_batch_size=2 training.max_steps=4 training.save_steps=2 ";
  const int64_t limit = 12 << 20;
  TrainRun ref = train(d / "ref", full + "memory.optimizer_offload=cpu");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  TrainRun plain = train(d / "plain", full + "memory.grow_after_steps=1 memory.device_limit=" + std::to_string(limit));
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const auto r = rows(plain.out);
  ASSERT_FALSE(r.empty());
  ASSERT_FALSE(r[0]["events"].empty()) << r[0].dump();
  const json& first = r[0]["events"][0];
  EXPECT_EQ(first["kind"], "ladder");
  EXPECT_EQ(first["step"], 0);
  EXPECT_NE(first["detail"].get<std::string>().find("offload optimizer state: optimizer state"), std::string::npos)
      << first.dump();
  EXPECT_NE(first["detail"].get<std::string>().find("before the first step"), std::string::npos) << first.dump();
  for (const auto& row : r) {
    EXPECT_LT(row["memory"]["cpu"]["peak"].get<int64_t>(), limit * 6 / 10) << "no headroom for grow-back to act on";
    for (const auto& e : row["events"]) EXPECT_NE(e["kind"], "grow") << e.dump();
  }
  expect_same_run(plain.out, ref.out, 1e-6);
  EXPECT_NE(read_file(plain.out / "memory_report.txt").find("step 0: ladder: offload optimizer state"),
            std::string::npos);
  EXPECT_TRUE(trainer::load_training_checkpoint(trainer::latest_checkpoint(plain.out)).state.optimizer_offload);
  // Resumed from step 2 under the same limit, it ends where the uninterrupted run did.
  fs::remove_all(plain.out / "checkpoints/step-4");
  auto resumed = run(memtune_bin() + " train " + (d / "plain/config.yaml.in").string() + " " + full +
                     "memory.device_limit=" + std::to_string(limit) + " training.resume_from_checkpoint=" +
                     (plain.out / "checkpoints/step-2").string() + " training.output_dir=" + (d / "resumed").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto rr = rows(d / "resumed");
  ASSERT_EQ(rr.size(), 2u);
  EXPECT_NEAR(rr.back()["loss"].get<double>(), r.back()["loss"].get<double>(), 1e-6);
}

// memory.on_oom.ladder: optimizer_8bit, which changes the numerics and so is taken only where
// listed. A full fine-tune of tiny-llama with AdamW, an out-of-memory error injected in step
// 2's update and the ladder holding only that rung: AdamW's state becomes bitsandbytes' 8-bit
// form and step 2 runs again with the 8-bit update. The steps before equal the plain run's,
// the ones after differ from it; the step's peak falls by at least 4 B per trained element
// (the state is 2 in place of 8 for every tensor of 4096 elements or more); the checkpoint
// holds the 8-bit state, and a resume from it ends where the run did.
TEST(Supervisor, TheEightBitRungQuantizesTheStateWhereListed) {
  fs::path d = temp_dir();
  const std::string full = "training.finetune=full model.quantization_config.load_in_4bit=false "
                           "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=1 "
                           "training.max_steps=5 training.save_steps=1 memory.grow_after_steps=1000 ";
  TrainRun plain = train(d / "plain", full);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const std::string ladder_args = full + "\"memory.on_oom.ladder=[optimizer_8bit]\"";
  TrainRun ladder = train(d / "ladder", ladder_args + " memory.inject_oom=2:optimizer");
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  const auto p = rows(plain.out), l = rows(ladder.out);
  ASSERT_EQ(p.size(), 5u);
  ASSERT_EQ(l.size(), 5u);
  ASSERT_EQ(l[2]["events"].size(), 2u) << l[2].dump();
  EXPECT_EQ(l[2]["events"][1]["kind"], "ladder");
  EXPECT_NE(l[2]["events"][1]["detail"].get<std::string>().find("8-bit optimizer state: AdamW's state in "
                                                                "bitsandbytes' 8-bit form"),
            std::string::npos) << l[2].dump();
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(l[i]["loss"].get<double>(), p[i]["loss"].get<double>(), 1e-6) << "step " << i;
  EXPECT_NE(l[4]["loss"].get<double>(), p[4]["loss"].get<double>()) << "the 8-bit update changed nothing";
  const int64_t trained = 988288;  // tiny-llama's elements, every one trained
  EXPECT_LE(l[4]["memory"]["cpu"]["peak"].get<int64_t>(), p[4]["memory"]["cpu"]["peak"].get<int64_t>() - 4 * trained);
  const auto ck = trainer::load_training_checkpoint(trainer::latest_checkpoint(ladder.out));
  EXPECT_EQ(ck.state.optimizer["kind"], "adamw_8bit");
  EXPECT_TRUE(ck.optimizer.count("model.embed_tokens.weight.absmax1"));
  EXPECT_EQ(ck.optimizer.at("model.embed_tokens.weight.exp_avg").scalar_type(), at::kByte);
  // Resumed from step 3 (after the rung), it ends where the run did.
  auto resumed = run(memtune_bin() + " train " + (d / "ladder/config.yaml.in").string() + " " + ladder_args +
                     " training.resume_from_checkpoint=" + (ladder.out / "checkpoints/step-3").string() +
                     " training.output_dir=" + (d / "resumed").string(), 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto r = rows(d / "resumed");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r.back()["loss"].get<double>(), l.back()["loss"].get<double>());
  // The plain run's checkpoint of step 2 (fp32 state) resumed under a limit its fp32 state
  // cannot hold, the ladder listing the rung: the state is made 8-bit before the first step and
  // quantized from the file, and the run is the one whose rung was taken in step 2.
  auto tight = run(memtune_bin() + " train " + (d / "plain/config.yaml.in").string() + " " + ladder_args +
                       " memory.device_limit=12000000 training.resume_from_checkpoint=" +
                       (plain.out / "checkpoints/step-2").string() + " training.output_dir=" + (d / "tight").string(),
                   300);
  ASSERT_EQ(tight.exit_code, 0) << tight.output;
  const auto t = rows(d / "tight");
  ASSERT_EQ(t.size(), 3u);
  for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t[i]["loss"].get<double>(), l[2 + i]["loss"].get<double>()) << i;
  // Without the rung in the ladder, that checkpoint's 8-bit state is refused by name.
  auto refused = run(memtune_bin() + " train " + (d / "ladder/config.yaml.in").string() + " " + full +
                     " training.resume_from_checkpoint=" + (ladder.out / "checkpoints/step-3").string() +
                     " training.output_dir=" + (d / "refused").string(), 300);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("memory.on_oom.ladder does not list optimizer_8bit now"), std::string::npos)
      << refused.output;
}

// The same rung under a real limit: a full fine-tune with AdamW whose fp32 state (7.5 MiB
// beside 3.8 of weights) that limit cannot hold, the memory model saying the 8-bit state fits.
// The rung is taken before the first step (the state made in 8 bits: made in fp32 it would not
// fit), and the run is the one configured with adamw_8bit from the start, to the bit.
TEST(Supervisor, TheEightBitRungUnderALimitEqualsEightBitFromTheStart) {
  fs::path d = temp_dir();
  const std::string full = "training.finetune=full model.quantization_config.load_in_4bit=false "
                           "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=1 "
                           "training.max_steps=4 memory.grow_after_steps=1000 ";
  TrainRun eight = train(d / "eight", full + "training.optim=adamw_8bit");
  ASSERT_EQ(eight.exit_code, 0) << eight.output;
  TrainRun ladder = train(d / "ladder", full + "\"memory.on_oom.ladder=[optimizer_8bit]\" memory.device_limit=12000000");
  ASSERT_EQ(ladder.exit_code, 0) << ladder.output;
  EXPECT_NE(ladder.output.find("the supervisor will settle, by the estimate: 8-bit optimizer state, before the "
                               "first step"),
            std::string::npos) << ladder.output;
  const auto l = rows(ladder.out);
  ASSERT_FALSE(l.empty());
  ASSERT_FALSE(l[0]["events"].empty()) << l[0].dump();
  EXPECT_EQ(l[0]["events"][0]["kind"], "ladder");
  EXPECT_NE(l[0]["events"][0]["detail"].get<std::string>().find("8-bit optimizer state: AdamW's state made in "
                                                                "bitsandbytes' 8-bit form before the first step"),
            std::string::npos) << l[0].dump();
  for (const auto& row : l) EXPECT_EQ(row["events"].dump().find("\"oom\""), std::string::npos) << row.dump();
  expect_same_run(ladder.out, eight.out, 0.0);
}

// memory.supervise: false: a real out-of-memory error in a step ends the run with the step
// named (exit code 3), not as an error while loading.
TEST(Supervisor, UnsupervisedARealOomEndsTheRunAtItsStep) {
  fs::path d = temp_dir();
  TrainRun r = train(d, "training.finetune=full model.quantization_config.load_in_4bit=false "
                        "memory.supervise=false memory.optimizer_offload=cpu memory.device_limit=6MiB");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("out of memory in step 0 at micro-batch 4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("memory.supervise is false"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("outside a training step"), std::string::npos) << r.output;
}

TEST(Supervisor, NothingFitsAtMicroBatchOneStopsWithAReportAndKeepsTheCheckpoint) {
  fs::path d = temp_dir();
  const std::string shape = "data.max_seq_length=256 training.per_device_train_batch_size=1 "
                            "training.gradient_accumulation_steps=4 training.gradient_checkpointing=true";
  TrainRun first = train(d, shape + " training.max_steps=2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto first_checkpoint_kept = [&] {
    fs::path ck = trainer::latest_checkpoint(first.out);
    ASSERT_EQ(ck.filename(), "step-2") << "the first run's checkpoint was replaced";
    EXPECT_EQ(trainer::load_training_checkpoint(ck).state.step, 2);
  };
  // 1. A budget between what stays allocated across steps (weights, optimizer) and one row's
  // peak with every layer checkpointed: the estimate refuses it before loading anything.
  auto last = rows(first.out).back()["memory"]["cpu"];
  const int64_t base = last["allocated"].get<int64_t>(), peak = last["peak"].get<int64_t>();
  ASSERT_GT(peak, base);
  auto r = run(memtune_bin() + " train " + (d / "config.yaml.in").string() + " " + shape +
               " training.max_steps=4 memory.device_limit=" + std::to_string(base + (peak - base) / 2));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("What was tried: the estimate before loading the model"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("training: "), std::string::npos) << "it started training:\n" << r.output;
  first_checkpoint_kept();
  // 2. The supervisor's own stop: the resumed run's step 2 runs out of memory at micro-batch
  // 1 on every try (injected), so it climbs every rung of the ladder (offloading the 4 layers
  // one by one; checkpointing is already complete), then stops with what it tried.
  std::string every_try;
  for (int i = 0; i < 8; ++i) every_try += std::string(i ? "," : "") + "2:forward";
  r = run(memtune_bin() + " train " + (d / "config.yaml.in").string() + " " + shape +
          " training.max_steps=4 training.resume_from_checkpoint=latest memory.inject_oom=" + every_try);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("out of memory at micro-batch 1 with every saving enabled that memory.on_oom.ladder allows "
                          "(step 2)"),
            std::string::npos)
      << r.output;
  const size_t tried = r.output.find("What was tried:\n  step 2: oom:");
  EXPECT_NE(tried, std::string::npos) << r.output;
  for (int layer = 3; layer >= 0; --layer)
    EXPECT_NE(r.output.find("step 2: ladder: offload layers: offloaded layer " + std::to_string(layer), tried),
              std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("the estimate before loading the model"), std::string::npos) << r.output;
  // The errors were injected: the estimate of the plan reached says it fits the machine.
  EXPECT_NE(r.output.find("The estimate of the plan reached (micro-batch 1 and the rungs above): "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("which says it fits: what ran out is outside the memory model"), std::string::npos)
      << r.output;
  first_checkpoint_kept();
}

}  // namespace
}  // namespace memtune::testing
