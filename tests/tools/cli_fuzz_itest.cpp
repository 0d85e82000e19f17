// Random command lines for every subcommand (a fixed seed, so a failure replays): every
// exit is 0, 2 (bad input) or 3 (memory); 1 (an uncaught library error), a signal or a
// hang is a failure. Values are chosen to fail fast or finish fast: missing and wrong
// files, bad and huge numbers, unknown flags, empty strings; never a real training run.
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace memtune::testing {
namespace {

struct Option {
  std::string flag;                 // "--model"; "" for a positional
  std::vector<std::string> values;  // empty: a flag without a value
  bool required = false;            // given 4 times in 5
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

TEST(CliFuzz, EveryExitIsZeroTwoOrThree) {
  const fs::path dir = temp_dir();
  const std::string model = (dir / "model").string();
  ASSERT_EQ(run(memtune_bin() + " init-model --out " + model + " --seed 1").exit_code, 0);
  write_file(dir / "garbage.txt", "\x01\xff{[not: any: format\n");
  write_file(dir / "bad.yaml", "model:\n  name: " + model + "\ntraining:\n  learning_rat: 1e-4\n");
  write_file(dir / "data.jsonl", "{\"text\": \"hello world\"}\n{\"text\": \"a b c\"}\n");
  write_file(dir / "empty.txt", "");
  fs::create_directories(dir / "empty_dir");
  int outs = 0;
  auto out = [&] { return (dir / ("out" + std::to_string(outs++))).string(); };

  const std::vector<std::string> in_paths = {model, "", "/nonexistent/x", (dir / "garbage.txt").string(),
                                             (dir / "empty_dir").string(), (dir / "empty.txt").string()};
  const std::vector<std::string> out_paths = {"@out", "", (dir / "garbage.txt").string(), "/proc/memtune-x",
                                              (dir / "garbage.txt/sub").string()};
  const std::vector<std::string> ints = {"0", "-1", "2", "abc", "", "99999999999999999999", "2147483647", "1e3", "0x10"};
  const std::vector<std::string> counts = {"0", "-1", "2", "abc", "", "99999999999999999999", "2147483647"};
  const std::vector<std::string> floats = {"1", "0", "-1", "nan", "inf", "abc", "", "1e308", "0.5"};
  const std::vector<std::string> texts = {"", "bogus", "\xff\xfe", "cpu", "auto", "cuda:7", "--"};
  const std::vector<std::string> configs = {"/nonexistent.yaml", (dir / "bad.yaml").string(),
                                            (dir / "garbage.txt").string(), (dir / "empty.txt").string(),
                                            (dir / "empty_dir").string(), ""};
  const std::vector<std::string> overrides = {"training.learning_rate=abc", "x=y", "=", "model.name=",
                                              "training.max_steps=-1", "noequals"};
  const std::string data = (dir / "data.jsonl").string();
  const std::string tok = (source_dir() / "examples/tiny-tokenizer").string();

  const std::vector<std::pair<std::string, std::vector<Option>>> commands = {
      {"train", {{"", configs}, {"", overrides}, {"--help-config", {}}, {"--log-level", {"debug", "bogus", ""}}}},
      {"eval",
       {{"--model", in_paths, true}, {"--data", {data, "/nonexistent", (dir / "garbage.txt").string(), ""}, true},
        {"--adapter", in_paths}, {"--tokenizer", {tok, "", "/nonexistent"}}, {"--format", {"text", "tokens", "plain", "bogus", ""}},
        {"--max-seq-length", ints}, {"--max-rows", ints}, {"--batch", ints}, {"--json", {}}, {"--device", texts}}},
      {"generate",
       {{"--model", in_paths, true}, {"--prompt", {"hi", "", "\xff"}, true}, {"--adapter", in_paths},
        {"--tokenizer", {tok, "", "/nonexistent"}}, {"--max-new-tokens", counts}, {"--greedy", {}},
        {"--temperature", floats}, {"--top-p", floats}, {"--seed", ints}, {"--device", texts}}},
      {"init-model",
       {{"--out", out_paths, true}, {"--arch", {"llama", "gpt2", "bogus", ""}}, {"--preset", {"tiny", "bogus", ""}},
        {"--config", {(dir / "garbage.txt").string(), "/nonexistent", model + "/config.json", ""}}, {"--seed", ints},
        {"--tokenizer", {tok, "/nonexistent", ""}}}},
      {"merge",
       {{"--model", in_paths, true}, {"--adapter", in_paths, true}, {"--out", out_paths, true},
        {"--dtype", {"fp32", "bf16", "fp8", ""}}}},
      {"quantize",
       {{"--model", in_paths, true}, {"--out", out_paths, true}, {"--blocksize", ints}, {"--no-double-quant", {}}}},
      {"tokenize",
       {{"--tokenizer", {tok, "", "/nonexistent", (dir / "garbage.txt").string()}},
        {"--input", {data, "", "/nonexistent", (dir / "garbage.txt").string(), (dir / "empty_dir").string()}},
        {"--format", {"jsonl", "ids", "text", "bogus", ""}}, {"--add-special-tokens", {}}, {"--stats", {}},
        {"--config", configs}, {"--out", out_paths}, {"", overrides}}},
      {"estimate",
       {{"", configs, true}, {"", overrides}, {"--device-memory", {"6GiB", "abc", "-1", "99999999999PiB", "", "0"}},
        {"--json", {}}}},
      {"report", {{"", {(dir / "empty_dir").string(), "/nonexistent", (dir / "garbage.txt").string(), ""}, true},
                  {"--out", out_paths}}},
      {"mem", {{"--json", {}}}},
      {"launch",
       {{"--nproc-per-node", {"0", "-1", "2", "abc", "", "99999", "2147483647", "99999999999999999999"}},
        {"--nnodes", counts}, {"--node-rank", counts}, {"--master-port", {"0", "-1", "99999", "abc", ""}},
        {"--standalone", {}}, {"--max-restarts", {"0", "-1", "1", "abc", "99999999999999999999"}},
        {"--monitor-interval", {"0", "-1", "nan", "abc", "0.05"}}, {"--stop-timeout", {"0", "-1", "nan", "abc", "1"}},
        {"--log-dir", out_paths}, {"--tee", {}}, {"--rdzv-id", texts}}},
  };

  std::mt19937 rng(20261123);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<std::string> lines;
  for (int round = 0; round < 6; ++round) {
    for (const auto& [name, options] : commands) {
      std::string line = memtune_bin() + " " + name;
      for (const auto& o : options) {
        if (!(o.required ? pick(5) < 4 : pick(3) == 0)) continue;
        if (!o.flag.empty()) line += " " + o.flag;
        if (o.values.empty()) continue;
        std::string v = o.values[pick(o.values.size())];
        if (v == "@out") v = out();
        line += " " + quote(v);
      }
      if (pick(8) == 0) line += " --bogus-flag";
      if (name == "launch") {  // the worker command: fails or ends at once
        const std::vector<std::string> workers = {"mem --json", "train /nonexistent.yaml", "", "bogus-command"};
        line += " -- " + workers[pick(workers.size())];
      }
      lines.push_back(line);
    }
  }

  // Two at a time; each within 60 s (the slowest, a tiny model's quantize or merge, takes 1-2 s).
  std::vector<CommandResult> results(lines.size());
  for (size_t i = 0; i < lines.size(); i += 2) {
    auto second = i + 1 < lines.size() ? std::async(std::launch::async, [&, i] { return run(lines[i + 1], 60); })
                                       : std::future<CommandResult>();
    results[i] = run(lines[i], 60);
    if (second.valid()) results[i + 1] = second.get();
  }
  int counted[256] = {};
  for (size_t i = 0; i < lines.size(); ++i) {
    const int rc = results[i].exit_code;
    counted[rc & 255]++;
    EXPECT_TRUE(rc == 0 || rc == 2 || rc == 3) << "exit " << rc << " from: " << lines[i] << "\n" << results[i].output;
  }
  std::cout << lines.size() << " command lines: exit 0 x" << counted[0] << ", 2 x" << counted[2] << ", 3 x"
            << counted[3] << "\n";
}

// What the random command lines found, kept as plain cases.
TEST(CliFuzz, FoundCasesExitTwo) {
  const fs::path dir = temp_dir();
  // A missing --tokenizer was a raw filesystem_error (exit 1) after the model was written.
  auto r = run(memtune_bin() + " init-model --out " + (dir / "m").string() + " --tokenizer /nonexistent");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--tokenizer '/nonexistent' does not exist"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "m"));
  // 99999 workers were forked one after another until the machine stalled.
  r = run(memtune_bin() + " launch --nproc-per-node 99999 -- mem", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--nproc-per-node 99999 exceeds"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memtune::testing
