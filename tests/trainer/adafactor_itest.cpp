// `memtune train` with training.optim: adafactor end to end (a full fine-tune of tiny-llama): the
// checkpoint holds transformers' state names and shapes (a matrix's row and column second
// moments, a vector's whole one, no first moment), resume is bitwise exact, and the optimizer's
// state is a small fraction of AdamW's 8 bytes per parameter. The update's arithmetic against a
// reference: tests/trainer/adafactor_test.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

std::string config(const fs::path& out) {
  fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "runtime: {device: cpu}\n"
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  finetune: full\n"
         "  optim: adafactor\n"
         "  per_device_train_batch_size: 4\n"
         "  gradient_accumulation_steps: 2\n"
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

struct TrainRun {
  int exit_code;
  std::string output;
  fs::path out;
};

TrainRun train(const fs::path& dir, const std::string& overrides = "") {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", config(dir / "out"));
  auto r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string() + " " + overrides, 600);
  return {r.exit_code, r.output, dir / "out"};
}

std::vector<double> losses(const fs::path& out) {
  std::vector<double> v;
  for (const auto& m : read_jsonl(out / "metrics.jsonl"))
    if (m.contains("loss")) v.push_back(m["loss"].get<double>());
  return v;
}

TEST(AdafactorTrain, CheckpointHoldsFactoredStatesAndResumeIsBitwise) {
  fs::path d = temp_dir();
  TrainRun straight = train(d / "straight");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto params = load_all_tensors(straight.out / "checkpoints/step-3/trainable.safetensors");
  const auto states = load_all_tensors(straight.out / "checkpoints/step-3/optimizer.safetensors");
  ASSERT_FALSE(params.empty());
  int64_t numel = 0, state_numel = 0, matrices = 0;
  for (const auto& [name, p] : params) {
    SCOPED_TRACE(name);
    numel += p.numel();
    EXPECT_EQ(states.count(name + ".exp_avg"), 0u);
    if (p.dim() >= 2) {
      ++matrices;
      ASSERT_TRUE(states.count(name + ".exp_avg_sq_row") && states.count(name + ".exp_avg_sq_col"));
      EXPECT_EQ(states.at(name + ".exp_avg_sq_row").sizes(), p.sizes().slice(0, 1));
      EXPECT_EQ(states.at(name + ".exp_avg_sq_col").sizes(), p.sizes().slice(1, 1));
      EXPECT_EQ(states.count(name + ".exp_avg_sq"), 0u);
    } else {
      ASSERT_TRUE(states.count(name + ".exp_avg_sq"));
      EXPECT_EQ(states.at(name + ".exp_avg_sq").sizes(), p.sizes());
    }
  }
  for (const auto& [k, t] : states) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << k;
    EXPECT_TRUE((t >= 0).all().item<bool>()) << k << ": second moments are never negative";
    state_numel += t.numel();
  }
  EXPECT_GT(matrices, 0);
  EXPECT_LT(state_numel * 4, numel * 8 / 10) << "under a tenth of AdamW's states";

  // Resume from step 3: the same last three losses and final weights, bit for bit.
  fs::create_directories(d / "resumed/out/checkpoints");
  fs::copy(straight.out / "checkpoints/step-3", d / "resumed/out/checkpoints/step-3", fs::copy_options::recursive);
  TrainRun resumed = train(d / "resumed", "training.resume_from_checkpoint=latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = losses(straight.out), b = losses(resumed.out);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[3 + i], b[i]) << i;
  EXPECT_LT(a.back(), a.front()) << "it trains";
  expect_same_tensors(straight.out / "checkpoints/step-6/optimizer.safetensors",
                      resumed.out / "checkpoints/step-6/optimizer.safetensors", 0.0);
  expect_same_tensors(straight.out / "checkpoints/step-6/trainable.safetensors",
                      resumed.out / "checkpoints/step-6/trainable.safetensors", 0.0);
}

}  // namespace
}  // namespace memtune::testing
