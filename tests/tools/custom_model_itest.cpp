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
}

}  // namespace
}  // namespace memtune::testing
