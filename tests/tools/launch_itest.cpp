// `memtune launch` end to end with 2 and 3 CPU processes on 127.0.0.1 (Gloo): data
// parallel equals one process on the same global batch; a killed worker stops the group
// (or restarts it and the run ends where an uninterrupted one does); an OOM on one rank
// shrinks every rank; SIGTERM to the launcher checkpoints every worker. Each run is tiny
// (tiny-llama, 64 tokens) and bounded by a time limit.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "runtime/error.h"
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
         "runtime: {device: cpu}\n"  // CPU budgets and fp32, on a GPU machine too
         "training:\n"
         "  output_dir: " + out.string() + "\n"
         "  per_device_train_batch_size: 2\n"
         "  gradient_accumulation_steps: 1\n"
         "  learning_rate: 1.0e-3\n"
         "  max_steps: 4\n"
         "  logging_steps: 1\n"
         "  lr_scheduler_type: linear\n"
         "  warmup_steps: 1\n"
         "  seed: 7\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 64\n"
         "  cache_dir: " + (out.parent_path() / "cache").string() + "\n"
         "distributed: {timeout: 60}\n";
}

fs::path write_config(const fs::path& dir) {
  fs::create_directories(dir);
  write_file(dir / "config.yaml.in", base_config(dir / "out"));
  return dir / "config.yaml.in";
}

std::string launch_cmd(const std::string& flags, const fs::path& config, const std::string& overrides) {
  return memtune_bin() + " launch --standalone --stop-timeout 5 " + flags + " -- train " + config.string() + " " +
         overrides;
}

std::vector<json> metrics(const fs::path& out) {
  std::vector<json> rows;
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line.back() == '}') rows.push_back(json::parse(line));
  return rows;
}

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

bool wait_for(const std::function<bool()>& cond, double limit_s) {
  auto deadline = Clock::now() + std::chrono::duration<double>(limit_s);
  while (Clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

TEST(Launch, TwoProcessesEqualOneProcessOnTheGlobalBatch) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path one_cfg = write_config(d / "one"), two_cfg = write_config(d / "two");
  auto one = run(memtune_bin() + " train " + one_cfg.string() + " training.per_device_train_batch_size=4", 300);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = run(launch_cmd("--nproc-per-node 2 --tee --log-dir " + (d / "logs").string(), two_cfg, ""), 300);
  ASSERT_EQ(two.exit_code, 0) << two.output;
  auto a = step_losses(d / "one/out"), b = step_losses(d / "two/out");
  ASSERT_EQ(a.size(), 4u);
  expect_same_losses(a, b, 1e-5);
  expect_same_tensors(d / "one/out/adapter/adapter_model.safetensors", d / "two/out/adapter/adapter_model.safetensors",
                      1e-5);
  // Both ranks logged, with their prefix; only rank 0 wrote the run's files.
  EXPECT_NE(two.output.find("[rank 1]"), std::string::npos) << two.output;
  EXPECT_NE(two.output.find("distributed: rank 1 of 2"), std::string::npos) << two.output;
  EXPECT_NE(read_file(d / "logs/attempt_0/rank_1.log").find("distributed: rank 1 of 2"), std::string::npos);
  EXPECT_NE(read_file(d / "logs/attempt_0/rank_0.log").find("adapter (PEFT format)"), std::string::npos);
  EXPECT_EQ(read_file(d / "logs/attempt_0/rank_1.log").find("adapter (PEFT format)"), std::string::npos);
}

TEST(Launch, ThreeProcessesEqualOneProcessOnTheGlobalBatch) {
  MEMTUNE_REQUIRE_GLOO();
  // 1 sample per rank and step, 3 ranks, against 3 per step in one process.
  fs::path d = temp_dir();
  fs::path one_cfg = write_config(d / "one"), three_cfg = write_config(d / "three");
  auto one = run(memtune_bin() + " train " + one_cfg.string() + " training.per_device_train_batch_size=3", 300);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto three = run(launch_cmd("--nproc-per-node 3", three_cfg, "training.per_device_train_batch_size=1"), 300);
  ASSERT_EQ(three.exit_code, 0) << three.output;
  expect_same_losses(step_losses(d / "one/out"), step_losses(d / "three/out"), 1e-5);
  expect_same_tensors(d / "one/out/adapter/adapter_model.safetensors",
                      d / "three/out/adapter/adapter_model.safetensors", 1e-5);
}

// DoRA's magnitudes are trainable tensors like A and B: their gradients are reduced over the
// ranks and, under sharding: gradients (ZeRO 2), their AdamW states and updates are split
// between them; two ranks train the one-process run's losses and adapter.
TEST(Launch, DoraWithShardedStatesTrainsAsOneProcess) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path one_cfg = write_config(d / "one"), two_cfg = write_config(d / "two");
  const std::string dora = " lora.use_dora=true lora.target_modules=all-linear";
  auto one = run(memtune_bin() + " train " + one_cfg.string() + " training.per_device_train_batch_size=4" + dora, 300);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = run(launch_cmd("--nproc-per-node 2", two_cfg, "distributed.sharding=gradients" + dora), 300);
  ASSERT_EQ(two.exit_code, 0) << two.output;
  expect_same_losses(step_losses(d / "one/out"), step_losses(d / "two/out"), 1e-5);
  expect_same_tensors(d / "one/out/adapter/adapter_model.safetensors", d / "two/out/adapter/adapter_model.safetensors",
                      1e-5);
  EXPECT_NE(read_file(d / "two/out/adapter/adapter_config.json").find("\"use_dora\": true"), std::string::npos);
}

// bitsandbytes' 8-bit AdamW state, on the device and paged, in a full fine-tune (every tensor
// of 4096 elements or more is in 8 bits): each rank quantizes the same reduced gradients into
// its own copy of the state, so the copies stay identical. A rank whose state (or weights)
// drifted would forward other logits, and the losses, summed over both ranks, would leave the
// one-process run's; the trained weights are rank 0's. The two sum the gradients in other
// orders, so a code on the edge of two 8-bit values can take the other one, which moves that
// element by a good part of the learning rate (1e-3): rank 0's weights agree with the one
// process's to 1e-5 but for one element in 1000 at most, each within 3e-4 (measured: 6.4e-5 at
// most on a Zen 4; on a Zen 5, 99 of 988,288 elements beyond 1e-5, the largest 1.5e-4, the
// median difference 1e-9). A drifted state would move most elements.
TEST(Launch, EightBitAndPagedStatesTrainAsOneProcessOnTheGlobalBatch) {
  MEMTUNE_REQUIRE_GLOO();
  for (const char* optim : {"adamw_8bit", "paged_adamw_8bit"}) {
    SCOPED_TRACE(optim);
    fs::path d = temp_dir();
    fs::path one_cfg = write_config(d / "one"), two_cfg = write_config(d / "two");
    const std::string full = std::string("training.finetune=full model.quantization_config.load_in_4bit=false "
                                         "training.max_steps=6 training.optim=") + optim;
    auto one = run(memtune_bin() + " train " + one_cfg.string() + " " + full + " training.per_device_train_batch_size=4",
                   300);
    ASSERT_EQ(one.exit_code, 0) << one.output;
    auto two = run(launch_cmd("--nproc-per-node 2", two_cfg, full), 300);
    ASSERT_EQ(two.exit_code, 0) << two.output;
    auto a = step_losses(d / "one/out"), b = step_losses(d / "two/out");
    ASSERT_EQ(a.size(), 6u);
    expect_same_losses(a, b, 1e-5);
    expect_same_tensors(d / "one/out/model/model.safetensors", d / "two/out/model/model.safetensors", 1e-5, 3e-4,
                        1000);
  }
}

TEST(Launch, KilledWorkerStopsTheOthersAndIsNamed) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path cfg = write_config(d);
  Background launcher(launch_cmd("--nproc-per-node 2", cfg, "training.max_steps=100000"), d / "log");
  ASSERT_TRUE(wait_for([&] { return metrics(d / "out").size() >= 2; }, 120)) << read_file(d / "log");
  pid_t victim = launcher.worker(1);
  ASSERT_GT(victim, 0);
  auto t0 = Clock::now();
  kill(victim, SIGKILL);
  int code = launcher.wait(5 + 10);  // --stop-timeout 5, plus a few seconds
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  std::string log = read_file(d / "log");
  ASSERT_NE(code, -1) << "the launcher did not stop within 15 s\n" << log;
  EXPECT_EQ(code, 1) << log;
  EXPECT_LT(took, 15.0);
  EXPECT_NE(log.find("rank 1 (local rank 1"), std::string::npos) << log;
  EXPECT_NE(log.find("killed by signal 9 (SIGKILL)"), std::string::npos) << log;
  EXPECT_NE(log.find("Last lines of"), std::string::npos) << log;
  EXPECT_EQ(launcher.worker(0), -1) << "rank 0 still runs";
}

TEST(Launch, StoppedWorkerIsNamedAsTheCauseNotTheRankThatTimedOut) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path cfg = write_config(d);
  Background launcher(launch_cmd("--nproc-per-node 2", cfg, "training.max_steps=100000 distributed.timeout=5"),
                      d / "log");
  ASSERT_TRUE(wait_for([&] { return metrics(d / "out").size() >= 2; }, 120)) << read_file(d / "log");
  pid_t victim = launcher.worker(1);
  ASSERT_GT(victim, 0);
  kill(victim, SIGSTOP);  // rank 1 hangs; rank 0 times out in its next collective and exits 1
  int code = launcher.wait(5 + 5 + 20);  // distributed.timeout, --stop-timeout, slack
  std::string log = read_file(d / "log");
  ASSERT_NE(code, -1) << "the launcher did not stop\n" << log;
  EXPECT_EQ(code, 1) << log;
  EXPECT_NE(log.find("rank 1 (local rank 1, pid " + std::to_string(victim) + ") was stopped by signal 19 (SIGSTOP)"),
            std::string::npos) << log;
  EXPECT_NE(log.find("(rank 0: exit code"), std::string::npos) << log;
  EXPECT_EQ(launcher.worker(1), -1) << "the stopped worker was left behind";
}

TEST(Launch, RestartAfterAKilledWorkerEndsWithTheUninterruptedAdapter) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  const std::string steps = "training.max_steps=40 training.save_steps=3";
  fs::path straight_cfg = write_config(d / "straight"), cfg = write_config(d / "killed");
  auto straight = run(launch_cmd("--nproc-per-node 2", straight_cfg, steps), 300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  Background launcher(launch_cmd("--nproc-per-node 2 --max-restarts 1", cfg, steps), d / "killed/log");
  ASSERT_TRUE(wait_for([&] { return fs::exists(d / "killed/out/checkpoints/step-3"); }, 120))
      << read_file(d / "killed/log");
  pid_t victim = launcher.worker(1);
  ASSERT_GT(victim, 0);
  kill(victim, SIGKILL);
  int code = launcher.wait(300);
  std::string log = read_file(d / "killed/log");
  ASSERT_EQ(code, 0) << log;
  EXPECT_NE(log.find("restarting the workers (restart 1 of 1)"), std::string::npos) << log;
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  expect_same_tensors(d / "straight/out/adapter/adapter_model.safetensors",
                      d / "killed/out/adapter/adapter_model.safetensors", 1e-5);
}

TEST(Launch, OomOnOneRankShrinksEveryRank) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path clean_cfg = write_config(d / "clean"), cfg = write_config(d / "oom");
  auto clean = run(launch_cmd("--nproc-per-node 2", clean_cfg, ""), 300);
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  auto r = run(launch_cmd("--nproc-per-node 2", cfg, "memory.inject_oom=2:backward:1"), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rows = metrics(d / "oom/out");
  ASSERT_EQ(rows.size(), 4u);
  // Rank 0 writes the metrics and never ran out of memory itself: it shrank by agreement.
  EXPECT_EQ(rows[1]["micro_batch"], 2);
  EXPECT_EQ(rows[2]["micro_batch"], 1) << rows[2].dump();
  EXPECT_NE(r.output.find("[rank 1]"), std::string::npos);
  // Shrinking changes the split, not the math.
  expect_same_losses(step_losses(d / "clean/out"), step_losses(d / "oom/out"), 1e-5);
}

TEST(Launch, SigtermCheckpointsEveryWorkerAndARelaunchResumes) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path cfg = write_config(d);
  const std::string steps = "training.max_steps=100000";
  Background launcher(launch_cmd("--nproc-per-node 2", cfg, steps), d / "log");
  ASSERT_TRUE(wait_for([&] { return metrics(d / "out").size() >= 3; }, 120)) << read_file(d / "log");
  pid_t w0 = launcher.worker(0), w1 = launcher.worker(1);
  ASSERT_GT(w0, 0);
  ASSERT_GT(w1, 0);
  kill(launcher.pid, SIGTERM);
  int code = launcher.wait(60);
  std::string log = read_file(d / "log");
  ASSERT_EQ(code, 128 + SIGTERM) << log;
  EXPECT_NE(log.find("[rank 0]: "), std::string::npos);
  // Both workers stopped by the signal, after one checkpoint written by rank 0.
  EXPECT_NE(kill(w0, 0), 0);
  EXPECT_NE(kill(w1, 0), 0);
  fs::path ck = trainer::latest_checkpoint(d / "out");
  ASSERT_FALSE(ck.empty()) << log;
  const int64_t stopped_at = std::stoll(ck.filename().string().substr(5));
  EXPECT_GE(stopped_at, 3);
  // A relaunch continues from it and runs a few more steps.
  auto r = run(launch_cmd("--nproc-per-node 2", cfg,
                          str_cat("training.max_steps=", stopped_at + 2, " training.resume_from_checkpoint=latest")),
               300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(d / "out/adapter/adapter_model.safetensors"));
}

// SIGTERM to rank 0 alone, in the periodic evaluation after step 2 (the training file as
// evaluation data: seconds of it): the ranks agree to stop at step 2, not at step 3's
// reduction, and the checkpoint says the evaluation is due; the relaunch runs it first, so
// the evaluations are at steps 2, 4 and 6 as in an uninterrupted run.
TEST(Launch, ASignalToOneRankInAnEvaluationStopsEveryRankAtItsStep) {
  MEMTUNE_REQUIRE_GLOO();
  fs::path d = temp_dir();
  fs::path cfg = write_config(d);
  const std::string eval = "training.max_steps=6 training.eval_steps=2 data.eval_file=" +
                           (source_dir() / "examples/data/tasks_train.jsonl").string();
  Background launcher(launch_cmd("--nproc-per-node 2", cfg, eval), d / "log");
  ASSERT_TRUE(wait_for([&] { return read_file(d / "log").find("[rank 0]: ") != std::string::npos &&
                                    read_file(d / "log").find("step 2/6") != std::string::npos; }, 120))
      << read_file(d / "log");
  const pid_t w0 = launcher.worker(0);
  ASSERT_GT(w0, 0);
  kill(w0, SIGTERM);
  launcher.wait(60);
  const std::string log = read_file(d / "log");
  ASSERT_NE(log.find("[rank 0] eval (periodic): stopped by signal 15"), std::string::npos) << "missed it:\n" << log;
  EXPECT_NE(log.find("[rank 1] stopped by signal 15 at step 2"), std::string::npos) << log;
  const fs::path ck = trainer::latest_checkpoint(d / "out");
  ASSERT_EQ(ck.filename(), "step-2") << log;
  EXPECT_TRUE(trainer::load_training_checkpoint(ck).state.eval_due) << log;
  auto r = run(launch_cmd("--nproc-per-node 2", cfg, eval + " training.resume_from_checkpoint=latest"), 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<int64_t> periodic;
  for (const auto& m : metrics(d / "out"))
    if (m.contains("eval_loss") && m.value("when", "") == "periodic") periodic.push_back(m["step"].get<int64_t>());
  EXPECT_EQ(periodic, (std::vector<int64_t>{2, 4, 6})) << r.output;
}

}  // namespace
}  // namespace memtune::testing
