// A user's own architecture, registered from its own source file (examples/custom_model/),
// is built into its own memtune binary, initialised, and trained with LoRA on an NF4 base.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace memtune::testing {
namespace {

std::string custom_bin() { return (fs::path(MEMTUNE_BUILD_DIR) / "examples/custom_model/memtune-custom").string(); }

TEST(CustomModel, RegisteredArchitectureInitialisesAndTrains) {
  ASSERT_TRUE(fs::exists(custom_bin())) << custom_bin();
  fs::path d = temp_dir();
  auto init = run(custom_bin() + " init-model --arch ParallelBlockForCausalLM --preset tiny-llama --tokenizer " +
                  (source_dir() / "examples/tiny-tokenizer").string() + " --out " + (d / "model").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  auto config = nlohmann::json::parse(read_file(d / "model/config.json"));
  EXPECT_EQ(config["architectures"][0], "ParallelBlockForCausalLM");

  auto train = run(custom_bin() + " train " + (source_dir() / "configs/quickstart.yaml").string() +
                   " runtime.device=cpu model.name_or_path=" + (d / "model").string() + " model.tokenizer=" + (d / "model").string() +
                   " training.output_dir=" + (d / "run").string() + " training.max_steps=6 training.eval_accuracy_rows=0 "
                   "training.eval_steps=0 data.train_file=" + (source_dir() / "examples/data/tasks_train.jsonl").string() +
                   " data.eval_file=" + (source_dir() / "examples/data/tasks_eval.jsonl").string() +
                   " data.max_seq_length=64 data.cache_dir=" + (d / "cache").string());
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_NE(train.output.find("LoRA on 16 projections"), std::string::npos) << train.output;
  EXPECT_TRUE(fs::exists(d / "run/adapter/adapter_model.safetensors"));

  // memtune itself does not know the architecture, and says what it knows.
  auto plain = run(memtune_bin() + " train " + (source_dir() / "configs/quickstart.yaml").string() +
                   " runtime.device=cpu model.name_or_path=" + (d / "model").string() +
                   " training.output_dir=" + (d / "run2").string());
  EXPECT_EQ(plain.exit_code, 2) << plain.output;
  EXPECT_NE(plain.output.find("is not registered"), std::string::npos) << plain.output;
  EXPECT_NE(plain.output.find("examples/custom_model"), std::string::npos) << plain.output;

  // A model type PEFT has no default targets for needs target_modules, as PEFT asks for them.
  config["model_type"] = "parallel_block";
  write_file(d / "model/config.json", config.dump(2));
  // One training step of the quickstart config on the custom model, with `overrides`.
  auto one_step = [&](const std::string& out, const std::string& overrides) {
    return run(custom_bin() + " train " + (source_dir() / "configs/quickstart.yaml").string() +
               " runtime.device=cpu model.name_or_path=" + (d / "model").string() + " model.tokenizer=" +
               (d / "model").string() + " training.output_dir=" + (d / out).string() +
               " training.max_steps=1 data.train_file=" + (source_dir() / "examples/data/tasks_train.jsonl").string() +
               " data.eval_file=" + (source_dir() / "examples/data/tasks_eval.jsonl").string() +
               " data.max_seq_length=64 data.cache_dir=" + (d / "cache").string() + " " + overrides);
  };
  // Refused with exit code 2 and `message` in the output.
  auto expect_refused = [](const auto& r, const std::string& message) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
  };
  expect_refused(one_step("run3", "lora.target_modules=[]"),
                 "lora.target_modules is not set, and PEFT has no default for model_type 'parallel_block'");

  // Dropout config.json asks for, which this architecture's layer() does not apply: refused,
  // not trained without.
  config["attention_dropout"] = 0.1;
  write_file(d / "model/config.json", config.dump(2));
  expect_refused(one_step("run4", ""), "asks for dropout in training (attention_dropout), which architecture "
                                       "'ParallelBlockForCausalLM' does not apply");
}

// The architecture states its layers' memory beside its forward (CausalLM::layer_memory),
// and the estimate of the real binary agrees with the peak its own training run measures.
TEST(CustomModel, TheEstimateOfARegisteredArchitectureAgreesWithItsTrainingPeak) {
  ASSERT_TRUE(fs::exists(custom_bin())) << custom_bin();
  fs::path d = temp_dir();
  auto init = run(custom_bin() + " init-model --arch ParallelBlockForCausalLM --preset tiny-llama --tokenizer " +
                  (source_dir() / "examples/tiny-tokenizer").string() + " --out " + (d / "model").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  for (const std::string shape : {"training.per_device_train_batch_size=2 data.max_seq_length=128",
                                  "training.per_device_train_batch_size=4 data.max_seq_length=256"}) {
    const std::string args = " " + (source_dir() / "configs/quickstart.yaml").string() +
                             " runtime.device=cpu model.name_or_path=" + (d / "model").string() +
                             " model.tokenizer=" + (d / "model").string() +
                             " training.max_steps=2 training.logging_steps=1 training.eval_accuracy_rows=0 "
                             "training.eval_steps=0 training.gradient_accumulation_steps=1 data.train_file=" +
                             (source_dir() / "examples/data/tasks_train.jsonl").string() + " data.eval_file=" +
                             (source_dir() / "examples/data/tasks_eval.jsonl").string() + " data.cache_dir=" +
                             (d / "cache").string() + " " + shape;
    auto est = run(custom_bin() + " estimate" + args + " --json");
    ASSERT_EQ(est.exit_code, 0) << est.output;
    const auto j = nlohmann::json::parse(est.output.substr(est.output.find('{')));
    EXPECT_EQ(est.output.find("states no layer accounting"), std::string::npos) << est.output;
    fs::remove_all(d / "run");
    auto train = run(custom_bin() + " train" + args + " training.output_dir=" + (d / "run").string());
    ASSERT_EQ(train.exit_code, 0) << train.output;
    int64_t measured = 0;
    for (const auto& row : read_jsonl(d / "run/metrics.jsonl"))
      if (row.contains("memory")) measured = std::max(measured, row["memory"]["cpu"]["peak"].get<int64_t>());
    const double predicted = j["peak_bytes"].get<double>();
    ASSERT_GT(measured, 0);
    EXPECT_NEAR(predicted / static_cast<double>(measured), 1.0, 0.10)
        << shape << ": estimated " << predicted << ", measured " << measured;
  }
}

}  // namespace
}  // namespace memtune::testing
