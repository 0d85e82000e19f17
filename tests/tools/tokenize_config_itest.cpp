// `memtune tokenize --config CONFIG --out data.bin`: a training set pre-tokenized to an llm.c
// token file trains exactly as its source does, or the command refuses to write it.
#include <gtest/gtest.h>

#include "test_util.h"

namespace memtune::testing {
namespace {

// The first rows of the bundled instruction tasks, and a config that trains on them.
fs::path write_config(const fs::path& dir) {
  std::string rows;
  std::istringstream all(read_file(source_dir() / "examples/data/tasks_train.jsonl"));
  std::string line;
  for (int i = 0; i < 40 && std::getline(all, line); ++i) rows += line + "\n";
  write_file(dir / "tasks.jsonl", rows);
  write_file(dir / "c.yaml", "model:\n  name_or_path: tiny-llama\n  tokenizer: " +
                                 (source_dir() / "examples/tiny-tokenizer").string() +
                                 "\nlora:\n  lora_dropout: 0.0\ntraining:\n  max_steps: 3\n  learning_rate: 1.0e-3\n"
                                 "  per_device_train_batch_size: 2\n  output_dir: " + (dir / "run").string() +
                                 "\ndata:\n  train_file: " + (dir / "tasks.jsonl").string() +
                                 "\n  format: instruction\n  template_name: alpaca\n  max_seq_length: 128\n"
                                 "  pack_sequences: true\n  shuffle: false\n");
  return dir / "c.yaml";
}

TEST(TokenizeConfig, RefusesDataWhosePromptsAreOutOfTheLoss) {
  const fs::path dir = temp_dir();
  const fs::path config = write_config(dir);
  const auto r = run(memtune_bin() + " tokenize --config " + config.string() + " --out " + (dir / "t.bin").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("data.train_on_prompt is false"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data.train_on_prompt=true"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "t.bin"));
}

// The .bin run sees the same rows (samples, target tokens) and computes the same losses as
// the run from the JSONL it was written from (to fp32 rounding: the .bin's rows also hold each
// document's end-of-text separator, outside the loss, so the matmuls have other shapes).
TEST(TokenizeConfig, TheTokenFileTrainsAsItsSource) {
  const fs::path dir = temp_dir();
  const fs::path config = write_config(dir);
  auto r = run(memtune_bin() + " tokenize --config " + config.string() + " --out " + (dir / "t.bin").string() +
               " data.train_on_prompt=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto source = run(memtune_bin() + " train " + config.string() + " data.train_on_prompt=true " +
                          "training.output_dir=" + (dir / "from_jsonl").string());
  ASSERT_EQ(source.exit_code, 0) << source.output;
  const auto bin = run(memtune_bin() + " train " + config.string() + " data.train_on_prompt=true data.format=tokens " +
                       "data.train_file=" + (dir / "t.bin").string() + " training.output_dir=" +
                       (dir / "from_bin").string());
  ASSERT_EQ(bin.exit_code, 0) << bin.output;
  // "data: FILE (FORMAT format): 40 documents, 14 samples, 1503 target tokens; ..." -> from the counts on.
  auto data_line = [](const std::string& out) {
    const size_t line = out.find(" format): ");
    return line == std::string::npos ? std::string() : out.substr(line, out.find(';', line) - line);
  };
  EXPECT_FALSE(data_line(source.output).empty()) << source.output;
  EXPECT_EQ(data_line(source.output), data_line(bin.output));
  const auto a = read_jsonl(dir / "from_jsonl/metrics.jsonl", "loss");
  const auto b = read_jsonl(dir / "from_bin/metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["tokens"], b[i]["tokens"]) << "step " << i + 1;
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5 * a[i]["loss"].get<double>())
        << "step " << i + 1;
  }
}

}  // namespace
}  // namespace memtune::testing
