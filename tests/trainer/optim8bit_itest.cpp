// `memtune train` with bitsandbytes' 8-bit and paged AdamW end to end: the checkpoint holds
// the 8-bit state as it is (uint8 codes and fp32 absmax) and resume is bitwise exact; a
// checkpoint is refused under another training.optim; paged states leave the budget (the
// step's allocated bytes and peak lower by exactly the state's bytes) and train bit for bit
// as the unpaged ones; `memtune estimate` counts those bytes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

// Tiny QLoRA with r = 32: adapter matrices of 4096 elements and more (32 x 128 and up) get
// 8-bit states; k/v projections' B (64 x 32 = 2048) stay fp32.
std::string config(const fs::path& out, const std::string& optim) {
  fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "  quantization_config: {load_in_4bit: true, bnb_4bit_compute_dtype: auto}\n"
         "lora: {r: 32, lora_alpha: 32, target_modules: all-linear}\n"
         "runtime: {device: cpu}\n"
         "memory: {device_limit: 2GiB}\n"
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  optim: " + optim + "\n"
         "  per_device_train_batch_size: 4\n"
         "  learning_rate: 1.0e-3\n"
         "  weight_decay: 0.01\n"
         "  max_steps: 6\n"
         "  save_steps: 3\n"
         "  seed: 7\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 64\n"
         "  cache_dir: " + (out.parent_path() / "cache").string() + "\n";
}

struct OptimRun {
  int exit_code;
  std::string output;
  fs::path out;
};

OptimRun train(const fs::path& dir, const std::string& optim, const std::string& overrides = "") {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", config(dir / "out", optim));
  auto r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides, 600);
  return {r.exit_code, r.output, dir / "out"};
}

std::vector<json> step_metrics(const fs::path& out) {
  std::vector<json> v;
  for (const auto& m : read_jsonl(out / "metrics.jsonl"))
    if (m.contains("loss")) v.push_back(m);
  return v;
}

int64_t file_tensor_bytes(const std::map<std::string, at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& [k, t] : ts) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

TEST(Optim8bit, CheckpointHoldsCodesAndResumeIsBitwise) {
  fs::path d = temp_dir();
  OptimRun straight = train(d / "straight", "adamw_bnb_8bit");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto st = load_all_tensors(straight.out / "checkpoints/step-3/optimizer.safetensors");
  int codes = 0, fp32 = 0;
  for (const auto& [k, t] : st) {
    if (k.size() > 8 && k.compare(k.size() - 8, 8, ".exp_avg") == 0) {
      if (t.scalar_type() == at::kByte) {
        ++codes;
        EXPECT_GE(t.numel(), 4096) << k;
        const std::string base = k.substr(0, k.size() - 8);
        ASSERT_TRUE(st.count(base + ".absmax1") && st.count(base + ".absmax2")) << k;
        EXPECT_EQ(st.at(base + ".exp_avg_sq").scalar_type(), at::kByte);
        EXPECT_EQ(st.at(base + ".absmax1").numel(), (t.numel() + 255) / 256);
        EXPECT_EQ(st.at(base + ".absmax1").scalar_type(), at::kFloat);
      } else {
        ++fp32;
        EXPECT_EQ(t.scalar_type(), at::kFloat);
        EXPECT_LT(t.numel(), 4096) << k;
      }
    }
  }
  EXPECT_GT(codes, 0);
  EXPECT_GT(fp32, 0);
  // Resume from step 3: the same last three losses and final state, bit for bit.
  fs::create_directories(d / "resumed/out/checkpoints");
  fs::copy(straight.out / "checkpoints/step-3", d / "resumed/out/checkpoints/step-3", fs::copy_options::recursive);
  OptimRun resumed = train(d / "resumed", "adamw_bnb_8bit", "training.resume_from_checkpoint=latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto a = step_metrics(straight.out), b = step_metrics(resumed.out);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[3 + i]["loss"].get<double>(), b[i]["loss"].get<double>()) << i;
  expect_same_tensors(straight.out / "checkpoints/step-6/optimizer.safetensors",
                      resumed.out / "checkpoints/step-6/optimizer.safetensors", 0.0);
  expect_same_tensors(straight.out / "checkpoints/step-6/trainable.safetensors",
                      resumed.out / "checkpoints/step-6/trainable.safetensors", 0.0);
  // Another optimizer cannot continue this state.
  auto r = run(memtune_bin() + " train " + (d / "resumed/config.yaml.in").string() +
               " training.max_steps=8 training.resume_from_checkpoint=latest training.optim=adamw_torch");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("training.optim changed"), std::string::npos) << r.output;
}

TEST(Optim8bit, PagedStateLeavesTheBudgetAndTrainsTheSame) {
  fs::path d = temp_dir();
  for (const char* bits : {"8", "32"}) {
    SCOPED_TRACE(bits);
    const std::string tag = bits;
    OptimRun plain = train(d / ("plain" + tag), tag == "8" ? "adamw_8bit" : "adamw_torch", "training.save_steps=0");
    OptimRun paged = train(d / ("paged" + tag), "paged_adamw_" + tag + "bit", "training.save_steps=0");
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    ASSERT_EQ(paged.exit_code, 0) << paged.output;
    auto a = step_metrics(plain.out), b = step_metrics(paged.out);
    ASSERT_EQ(a.size(), b.size());
    // The state's bytes, from the checkpoint file (fp32 m and v, or codes and absmax).
    const int64_t state = file_tensor_bytes(load_all_tensors(paged.out / "checkpoints/step-6/optimizer.safetensors"));
    EXPECT_GT(state, 0);
    for (size_t i = 0; i < a.size(); ++i) {
      const json& ma = a[i]["memory"]["cpu"];
      const json& mb = b[i]["memory"]["cpu"];
      if (tag == "8") {
        EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << i;
      }
      // adamw_torch also keeps a workspace (its largest tensor, fp32) that bitsandbytes' kernel does not
      if (tag == "8") {
        EXPECT_EQ(ma["allocated"].get<int64_t>() - mb["allocated"].get<int64_t>(), state) << i;
      } else {
        EXPECT_GE(ma["allocated"].get<int64_t>() - mb["allocated"].get<int64_t>(), state) << i;
      }
      EXPECT_GE(ma["peak"].get<int64_t>() - mb["peak"].get<int64_t>(), state) << i;
    }
    // `memtune estimate` counts the same state bytes on the device: all of them unpaged, none paged.
    for (bool is_paged : {false, true}) {
      const std::string optim = is_paged ? "paged_adamw_" + tag + "bit" : tag == "8" ? "adamw_8bit" : "";
      if (optim.empty()) continue;
      auto r = run(memtune_bin() + " estimate " + ((is_paged ? paged : plain).out.parent_path() / "config.yaml.in").string() +
                       " --json",
                   120);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const size_t at = r.output.find('{');
      ASSERT_NE(at, std::string::npos) << r.output;
      json j = json::parse(r.output.substr(at, r.output.rfind('}') - at + 1));
      int64_t est = -1;
      for (const auto& k : j["components"])
        if (k["name"] == "optimizer states") est = k["bytes"].get<int64_t>();
      EXPECT_EQ(est, is_paged ? 0 : state) << optim;
    }
    if (tag == "8")
      expect_same_tensors(plain.out / "checkpoints/step-6/trainable.safetensors",
                          paged.out / "checkpoints/step-6/trainable.safetensors", 0.0);
  }
}

TEST(Optim8bit, OptimizerPhaseOomLeavesNoHalfUpdate) {
  // An out-of-memory error at the optimizer phase of step 0: the supervisor halves the
  // micro-batch and redoes the step; the run equals one at the smaller micro-batch throughout.
  fs::path d = temp_dir();
  OptimRun ref = train(d / "ref", "paged_adamw_8bit",
                       "training.per_device_train_batch_size=2 training.gradient_accumulation_steps=2");
  OptimRun oom = train(d / "oom", "paged_adamw_8bit", "memory.inject_oom=0:optimizer memory.grow_after_steps=1000");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(oom.exit_code, 0) << oom.output;
  auto a = step_metrics(ref.out), b = step_metrics(oom.out);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(b.empty());
  ASSERT_FALSE(b[0]["events"].empty()) << oom.output;
  EXPECT_EQ(b[0]["events"][0]["kind"], "oom");
  EXPECT_EQ(b[0]["micro_batch"], 2);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5) << i;
  expect_same_tensors(ref.out / "checkpoints/step-6/trainable.safetensors",
                      oom.out / "checkpoints/step-6/trainable.safetensors", 1e-5);
}

}  // namespace
}  // namespace memtune::testing
