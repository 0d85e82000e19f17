// The planner behind `memtune estimate --plan`: every candidate keeps the effective batch,
// candidates come by predicted time, the plans listed for a budget fit it, a larger budget
// never gives a slower best plan, and the overrides it prints are read back by the config
// parser into the plan they name.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <set>

#include "runtime/error.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/plan.h"

namespace memtune::trainer {
namespace {

Config config(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"model.name_or_path=tiny-llama", "data.max_seq_length=256"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return parse_config("runtime: {device: cpu}", "test", all);
}

struct Case {
  std::string name;
  std::vector<std::string> overrides;
};

class PlanCandidates : public ::testing::TestWithParam<Case> {};

TEST_P(PlanCandidates, EveryCandidateKeepsTheEffectiveBatch) {
  const Config c = config(GetParam().overrides);
  const models::ModelSpec spec = model_spec(c);
  const int64_t effective = int64_t{c.training.per_device_train_batch_size} * c.training.gradient_accumulation_steps;
  std::set<int64_t> micro_batches;
  for (const Plan& p : candidate_plans(c, spec)) {
    EXPECT_GE(p.micro_batch, 1);
    EXPECT_EQ(p.micro_batch * p.accumulation, effective) << p.micro_batch << " x " << p.accumulation;
    micro_batches.insert(p.micro_batch);
  }
  std::set<int64_t> divisors;
  for (int64_t m = 1; m <= effective; ++m)
    if (effective % m == 0) divisors.insert(m);
  EXPECT_EQ(micro_batches, divisors);
}

TEST_P(PlanCandidates, CandidatesComeByPredictedTimeThenPeak) {
  const Config c = config(GetParam().overrides);
  const std::vector<Plan> plans = candidate_plans(c, model_spec(c));
  ASSERT_GT(plans.size(), 4u);
  for (size_t i = 1; i < plans.size(); ++i) {
    EXPECT_LE(plans[i - 1].relative_time, plans[i].relative_time) << i;
    if (plans[i - 1].relative_time == plans[i].relative_time) {
      EXPECT_LE(plans[i - 1].peak_bytes, plans[i].peak_bytes) << i;
    }
  }
}

// Budgets from below the smallest peak to above the largest, and every candidate's own peak.
std::vector<int64_t> budgets(const std::vector<Plan>& plans) {
  int64_t lo = plans.front().peak_bytes, hi = lo;
  std::vector<int64_t> out;
  for (const Plan& p : plans) {
    lo = std::min(lo, p.peak_bytes);
    hi = std::max(hi, p.peak_bytes);
    out.push_back(p.peak_bytes);
    out.push_back(p.peak_bytes - 1);
  }
  for (int i = 0; i <= 200; ++i) out.push_back(lo - 1024 + (hi + 2048 - lo) * i / 200);
  std::sort(out.begin(), out.end());
  return out;
}

TEST_P(PlanCandidates, EveryListedPlanFitsAndEachSlowerOneSavesMemory) {
  const Config c = config(GetParam().overrides);
  const std::vector<Plan> plans = candidate_plans(c, model_spec(c));
  for (int64_t budget : budgets(plans)) {
    const std::vector<Plan> fit = fitting_plans(plans, budget);
    const bool any = std::any_of(plans.begin(), plans.end(), [&](const Plan& p) { return p.peak_bytes <= budget; });
    EXPECT_EQ(fit.empty(), !any) << budget;
    for (size_t i = 0; i < fit.size(); ++i) {
      EXPECT_LE(fit[i].peak_bytes, budget);
      if (i > 0) {
        EXPECT_LE(fit[i - 1].relative_time, fit[i].relative_time);
        EXPECT_LT(fit[i].peak_bytes, fit[i - 1].peak_bytes);
      }
    }
    // The first is the fastest candidate that fits.
    if (!fit.empty())
      for (const Plan& p : plans)
        if (p.peak_bytes <= budget) { EXPECT_GE(p.relative_time, fit.front().relative_time); }
  }
}

TEST_P(PlanCandidates, ALargerBudgetNeverGivesASlowerBestPlan) {
  const Config c = config(GetParam().overrides);
  const std::vector<Plan> plans = candidate_plans(c, model_spec(c));
  double previous = std::numeric_limits<double>::infinity();
  int changes = 0;
  for (int64_t budget : budgets(plans)) {
    const std::vector<Plan> fit = fitting_plans(plans, budget);
    if (fit.empty()) continue;
    EXPECT_LE(fit.front().relative_time, previous) << budget;
    changes += fit.front().relative_time < previous;
    previous = fit.front().relative_time;
  }
  EXPECT_GE(changes, 3) << "the best plan should change over the budgets";
}

// The overrides printed for a plan, applied to the config, give the plan's settings: the
// spellings are those the parser accepts, and keys equal to the config's are left out.
TEST_P(PlanCandidates, OverridesReadBackAsThePlan) {
  const Config c = config(GetParam().overrides);
  const models::ModelSpec spec = model_spec(c);
  int configured = 0;
  for (const Plan& p : candidate_plans(c, spec)) {
    std::vector<std::string> o = GetParam().overrides;
    const std::vector<std::string> extra = plan_overrides(c, p);
    EXPECT_EQ(extra.empty(), p.configured);
    configured += p.configured;
    if (p.configured) { EXPECT_DOUBLE_EQ(p.relative_time, 1.0); }
    o.insert(o.end(), extra.begin(), extra.end());
    const Config planned = config(o);
    EXPECT_EQ(planned.training.per_device_train_batch_size, p.micro_batch);
    EXPECT_EQ(planned.training.gradient_accumulation_steps, p.accumulation);
    EXPECT_EQ(planned.training.gradient_checkpointing.policy, p.checkpointing.policy);
    if (p.checkpointing.policy == "every_n") {
      EXPECT_EQ(planned.training.gradient_checkpointing.n, p.checkpointing.n);
    }
    EXPECT_EQ(planned.training.activation_offload == "checkpoints", p.activation_offload);
    EXPECT_EQ(planned.memory.optimizer_offload == "cpu", p.optimizer_offload);
    // The estimate of the planned config is the plan's peak.
    EXPECT_EQ(estimate_peak(estimate_input(planned, spec)), p.peak_bytes)
        << ::testing::PrintToString(extra);
  }
  EXPECT_EQ(configured, 1) << "the configured run is a candidate";
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PlanCandidates,
    ::testing::Values(
        Case{"lora_4x2", {"training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=2"}},
        Case{"qlora_3x2_every2", {"model.quantization_config.load_in_4bit=true", "training.per_device_train_batch_size=3",
                                  "training.gradient_accumulation_steps=2",
                                  "training.gradient_checkpointing={policy: every_n, n: 2}"}},
        Case{"full_8x1_offloaded", {"training.finetune=full", "training.per_device_train_batch_size=8",
                                    "training.gradient_checkpointing=true", "training.activation_offload=checkpoints",
                                    "memory.optimizer_offload=cpu"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(Plan, EnumeratesThePoliciesThatExist) {
  // 4 layers: every_n for n = 3 and 2 (n below the layer count); activation offload only
  // with checkpointing.
  const Config c = config({"training.per_device_train_batch_size=2"});
  std::set<std::string> seen;
  for (const Plan& p : candidate_plans(c, model_spec(c))) {
    seen.insert(p.checkpointing.policy == "every_n" ? "every_n " + std::to_string(p.checkpointing.n)
                                                    : p.checkpointing.policy);
    if (p.activation_offload) { EXPECT_NE(p.checkpointing.policy, "none"); }
  }
  EXPECT_EQ(seen, (std::set<std::string>{"none", "every_n 3", "every_n 2", "all"}));
  // 2 micro-batch sizes x (none + 3 policies x 2 activation offloads) x 2 optimizer offloads.
  EXPECT_EQ(candidate_plans(c, model_spec(c)).size(), 2u * 7 * 2);
}

TEST(Plan, APagedOptimizerHasNoOptimizerOffloadToAdd) {
  const Config c = config({"training.optim=paged_adamw_32bit", "training.per_device_train_batch_size=2"});
  for (const Plan& p : candidate_plans(c, model_spec(c))) {
    EXPECT_FALSE(p.optimizer_offload);
    EXPECT_EQ(plan_overrides(c, p).size() > 0, !p.configured);
  }
}

TEST(Plan, TheCostModelChargesRecomputeAndSmallMicroBatches) {
  const Config c = config({"training.per_device_train_batch_size=4"});
  const std::vector<Plan> plans = candidate_plans(c, model_spec(c));
  auto time_of = [&](int64_t m, const std::string& policy, int n = 2) {
    for (const Plan& p : plans)
      if (p.micro_batch == m && p.checkpointing.policy == policy && (policy != "every_n" || p.checkpointing.n == n) &&
          !p.activation_offload && !p.optimizer_offload)
        return p.relative_time;
    ADD_FAILURE() << m << " " << policy;
    return 0.0;
  };
  EXPECT_DOUBLE_EQ(time_of(4, "none"), 1.0);
  EXPECT_LT(time_of(4, "none"), time_of(2, "none"));
  EXPECT_LT(time_of(2, "none"), time_of(1, "none"));
  EXPECT_LT(time_of(4, "none"), time_of(4, "every_n", 3));
  // 4 layers: n = 3 checkpoints layers 0 and 3, n = 2 layers 0 and 2: the same work.
  EXPECT_DOUBLE_EQ(time_of(4, "every_n", 3), time_of(4, "every_n", 2));
  EXPECT_LT(time_of(4, "every_n", 2), time_of(4, "all"));
  // Recomputing every layer's forward: at most a third more than the step.
  EXPECT_LT(time_of(4, "all"), 4.0 / 3.0);
  EXPECT_GT(time_of(4, "all"), 1.2);
}

// On a GPU the copies cross PCIe: each offload costs time; on the CPU the optimizer's
// offloaded states are updated where they are (docs/performance.md measured no cost).
TEST(Plan, OffloadCostsTimeByTheBytesItMoves) {
  const Config c = config({"training.finetune=full", "training.per_device_train_batch_size=2"});
  for (const std::string kind : {"cpu", "gpu"}) {
    const std::vector<Plan> plans = candidate_plans(c, model_spec(c), 1, plan_cost_model(kind));
    auto time_of = [&](bool act, bool opt) {
      for (const Plan& p : plans)
        if (p.micro_batch == 2 && p.checkpointing.policy == "all" && p.activation_offload == act &&
            p.optimizer_offload == opt)
          return p.relative_time;
      ADD_FAILURE() << act << " " << opt;
      return 0.0;
    };
    EXPECT_LT(time_of(false, false), time_of(true, false)) << kind;
    if (kind == "gpu") {
      EXPECT_LT(time_of(false, false), time_of(false, true));
    } else {
      EXPECT_EQ(time_of(false, false), time_of(false, true));
    }
  }
}

TEST(Plan, AutoMicroBatchIsRefused) {
  const Config c = config({"training.per_device_train_batch_size=auto"});
  try {
    candidate_plans(c, model_spec(c));
    ADD_FAILURE() << "accepted auto";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("set per_device_train_batch_size to a number"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memtune::trainer
