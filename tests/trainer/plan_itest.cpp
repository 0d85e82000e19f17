// `memtune estimate --plan` against the real training binary: under three device budgets,
// the first plan it prints, pasted onto the config, trains with no out-of-memory error, and
// the plan it rejected for not fitting (the next faster one) does run out of memory there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "runtime/units.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/plan.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

// Tiny Llama, dense LoRA, 8 packed rows of 256 tokens a step as 4 x 2: activations outweigh
// the weights, so the plans' peaks spread over 3x.
std::string config_yaml(const fs::path& dir) {
  const fs::path src = source_dir();
  return "model:\n"
         "  name_or_path: tiny-llama\n"
         "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
         "lora: {r: 4, lora_alpha: 8}\n"
         "runtime: {device: cpu}\n"  // CPU budgets, on a GPU machine too
         "training:\n"
         "  output_dir: " + (dir / "out").string() + "\n"
         "  per_device_train_batch_size: 4\n"
         "  gradient_accumulation_steps: 2\n"
         "  max_steps: 2\n"
         "data:\n"
         "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
         "  format: instruction\n"
         "  max_seq_length: 256\n"
         "  pack_sequences: true\n"
         "  cache_dir: " + (dir / "cache").string() + "\n"
         "memory:\n"
         "  supervise: true\n"
         "  grow_after_steps: 1000\n";  // no growing back: an OOM here is the plan's own
}

std::string words(const std::vector<std::string>& overrides) {
  std::string s;
  for (const auto& o : overrides) s += " \"" + o + "\"";
  return s;
}

bool same(const trainer::Plan& a, const trainer::Plan& b) {
  return a.micro_batch == b.micro_batch && a.checkpointing.policy == b.checkpointing.policy &&
         a.checkpointing.n == b.checkpointing.n && a.activation_offload == b.activation_offload &&
         a.optimizer_offload == b.optimizer_offload;
}

struct Budget {
  int64_t bytes;
  trainer::Plan first;     // the fastest that fits
  trainer::Plan rejected;  // the candidate just before it by predicted time: does not fit
};

// A training run's out-of-memory events (metrics.jsonl), or -1 when it stopped out of memory
// (exit 3: the pre-load check, or the supervisor out of rungs). `peak`: the largest step
// peak the budget allocator logged.
int oom_events(const fs::path& config, const fs::path& out, const std::vector<std::string>& overrides, int64_t budget,
               std::string* log, int64_t* peak) {
  const auto r = run(memtune_bin() + " train " + config.string() + words(overrides) + " training.output_dir=" +
                         out.string() + " memory.device_limit=" + std::to_string(budget),
                     300);
  *log = r.output;
  if (r.exit_code == 3) return -1;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  int ooms = 0;
  *peak = 0;
  for (const auto& row : read_jsonl(out / "metrics.jsonl")) {
    if (row.contains("events"))
      for (const auto& e : row["events"]) ooms += e["kind"] == "oom";
    if (row.contains("memory")) *peak = std::max(*peak, row["memory"]["cpu"]["peak"].get<int64_t>());
  }
  return ooms;
}

TEST(PlanCommand, TheFirstPlanTrainsWithoutOomAndTheFasterRejectedOneRunsOut) {
  const fs::path d = temp_dir();
  write_file(d / "c.yaml", config_yaml(d));
  const trainer::Config c = trainer::load_config(d / "c.yaml");
  const std::vector<trainer::Plan> all = trainer::candidate_plans(c, trainer::model_spec(c));

  // Budgets where the first plan fits with room and the rejected one exceeds by as much, so
  // the estimate's error (within 10 % of the allocator's peak, EstimateVsModel) decides nothing.
  const double margin = 1.12;
  std::vector<Budget> candidates;
  for (const trainer::Plan& p : all) {
    const int64_t b = static_cast<int64_t>(static_cast<double>(p.peak_bytes) * margin);
    const std::vector<trainer::Plan> fit = trainer::fitting_plans(all, b);
    ASSERT_FALSE(fit.empty());
    size_t j = 0;
    while (!same(all[j], fit.front())) ++j;
    if (j == 0 || static_cast<double>(all[j - 1].peak_bytes) < static_cast<double>(b) * margin) continue;
    candidates.push_back({b, fit.front(), all[j - 1]});
  }
  std::sort(candidates.begin(), candidates.end(), [](const Budget& a, const Budget& b) { return a.bytes < b.bytes; });
  candidates.erase(std::unique(candidates.begin(), candidates.end(),
                               [](const Budget& a, const Budget& b) { return same(a.first, b.first); }),
                   candidates.end());
  ASSERT_GE(candidates.size(), 3u) << "the tiny config should give three budgets with distinct first plans";
  const std::vector<Budget> budgets = {candidates.front(), candidates[candidates.size() / 2], candidates.back()};

  for (size_t i = 0; i < budgets.size(); ++i) {
    const Budget& b = budgets[i];
    SCOPED_TRACE("budget " + format_bytes(b.bytes) + ": first " + words(trainer::plan_overrides(c, b.first)) +
                 " (" + format_bytes(b.first.peak_bytes) + "), rejected " +
                 words(trainer::plan_overrides(c, b.rejected)) + " (" + format_bytes(b.rejected.peak_bytes) + ")");
    // The command prints that plan first.
    const auto e = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --plan --json --device-memory " +
                           std::to_string(b.bytes),
                       120);
    ASSERT_EQ(e.exit_code, 0) << e.output;
    const json plans = json::parse(e.output.substr(e.output.find('[')));
    ASSERT_FALSE(plans.empty());
    EXPECT_EQ(plans[0]["fits"], true);
    EXPECT_EQ(plans[0]["overrides"].get<std::vector<std::string>>(), trainer::plan_overrides(c, b.first));
    EXPECT_LE(plans[0]["peak_bytes"].get<int64_t>(), b.bytes);

    std::string log;
    int64_t peak = 0, rejected_peak = 0;
    const fs::path run_dir = d / ("budget" + std::to_string(i));
    EXPECT_EQ(oom_events(d / "c.yaml", run_dir / "first", trainer::plan_overrides(c, b.first), b.bytes, &log, &peak), 0)
        << log;
    const int rejected = oom_events(d / "c.yaml", run_dir / "rejected", trainer::plan_overrides(c, b.rejected),
                                    b.bytes, &log, &rejected_peak);
    EXPECT_NE(rejected, 0) << "the rejected plan trained without running out of memory:\n" << log;
    std::printf("budget %s: first plan%s predicted %s, measured %s; rejected%s predicted %s: %s\n",
                format_bytes(b.bytes).c_str(), words(trainer::plan_overrides(c, b.first)).c_str(),
                format_bytes(b.first.peak_bytes).c_str(), format_bytes(peak).c_str(),
                words(trainer::plan_overrides(c, b.rejected)).c_str(), format_bytes(b.rejected.peak_bytes).c_str(),
                rejected < 0 ? "stopped out of memory (exit 3)" : (std::to_string(rejected) + " oom events").c_str());
  }
}

// The text form: the overrides of the best plans, the peak and the relative time; when
// nothing fits, the smallest plan's peak (exit 0, as estimate for a run that does not fit).
TEST(PlanCommand, PrintsPastableOverridesOrTheSmallestPlan) {
  const fs::path d = temp_dir();
  write_file(d / "c.yaml", config_yaml(d));
  const trainer::Config c = trainer::load_config(d / "c.yaml");
  const std::vector<trainer::Plan> all = trainer::candidate_plans(c, trainer::model_spec(c));
  const trainer::Plan& smallest = trainer::smallest_plan(all);

  // A budget whose best plan checkpoints every n-th layer: its map is quoted for the shell.
  int64_t budget = 0;
  for (const trainer::Plan& p : all)
    if (trainer::fitting_plans(all, p.peak_bytes).front().checkpointing.policy == "every_n") budget = p.peak_bytes;
  ASSERT_GT(budget, 0);
  const trainer::Plan first = trainer::fitting_plans(all, budget).front();
  auto r = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --plan --no-data --device-memory " +
                   std::to_string(budget),
               120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  char head[128];
  std::snprintf(head, sizeof head, "1. predicted peak %s, step time %.3fx the configured run's\n   ",
                format_bytes(first.peak_bytes).c_str(), first.relative_time);
  std::string line;
  for (const std::string& o : trainer::plan_overrides(c, first))
    line += (line.empty() ? "" : " ") + (o.find(' ') == std::string::npos ? o : "'" + o + "'");
  EXPECT_NE(r.output.find(head + line + "\n"), std::string::npos) << head << line << "\n" << r.output;
  EXPECT_NE(line.find("'training.gradient_checkpointing={policy: every_n, n: "), std::string::npos) << line;

  auto none = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --plan --no-data --device-memory " +
                      std::to_string(smallest.peak_bytes - 1),
                  120);
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_NE(none.output.find("no plan fits: the smallest needs " + format_bytes(smallest.peak_bytes)),
            std::string::npos)
      << none.output;
  auto j = run(memtune_bin() + " estimate " + (d / "c.yaml").string() + " --plan --json --no-data --device-memory " +
                   std::to_string(smallest.peak_bytes - 1),
               120);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  const json plans = json::parse(j.output.substr(j.output.find('[')));
  ASSERT_EQ(plans.size(), 1u) << j.output;
  EXPECT_EQ(plans[0]["fits"], false);
  EXPECT_EQ(plans[0]["peak_bytes"], smallest.peak_bytes);
}

}  // namespace
}  // namespace memtune::testing
