// The quickstart's promise, with the real command and the real configs: a base trained from
// random weights on the bundled corpus (configs/quickstart-base.yaml as it is), then QLoRA on
// the bundled tasks (configs/quickstart.yaml as it is, 300 steps) answers held-out tasks that
// the base could not. Exact match is judged against the eval file's answers, which
// BundledData.TaskFilesLoadAndTheirAnswersAreRight checks on their own.
#include <gtest/gtest.h>

#include <regex>

#include "test_util.h"

namespace memtune::testing {
namespace {

TEST(Quickstart, QloraLearnsHeldOutTasksTheBaseCannotDo) {
  const fs::path d = temp_dir(), src = source_dir();
  // From the repository root, as the configs' relative paths expect.
  const std::string in_root = "cd '" + src.string() + "' && " + memtune_bin();
  const std::string cache = " data.cache_dir=" + (d / "cache").string();
  auto base = run(in_root + " train configs/quickstart-base.yaml training.output_dir=" + (d / "base").string() + cache);
  ASSERT_EQ(base.exit_code, 0) << base.output;
  auto tune = run(in_root + " train configs/quickstart.yaml model.name_or_path=" + (d / "base/model").string() +
                  " training.output_dir=" + (d / "run").string() +
                  " training.eval_steps=0 training.save_steps=0" + cache);
  ASSERT_EQ(tune.exit_code, 0) << tune.output;

  const auto rows = read_jsonl(d / "run/metrics.jsonl", "accuracy");
  ASSERT_EQ(rows.size(), 2u) << "accuracy before and after training";
  EXPECT_EQ(rows[0]["step"], 0);
  EXPECT_EQ(rows[1]["step"], 300);
  EXPECT_EQ(rows[1]["accuracy_rows"], 100);
  EXPECT_LE(rows[0]["accuracy"].get<double>(), 0.02) << "the base answers with its corpus";
  // Chance is about 18 % over the four tasks (parity 1/2, length 1/7, a letter 1/26). Measured
  // 2026-11-25 on bases trained with seeds 42, 1 and 2: 54 %, 64 % and 55 %. Half the steps
  // were too few to hold on every base: 28-40 % (the base's last bits, from one change of
  // RMSNorm's rounding order, moved it from 40 to 28 %).
  EXPECT_GE(rows[1]["accuracy"].get<double>(), 0.4) << tune.output;

  // Per task, from the log: parity, learned first, is far above its chance of 50 % (100 % on
  // each of the three bases; length 52-84 %, last 21-46 %, first 21-25 %).
  std::smatch m;
  const std::regex after(R"(accuracy \(after training\): [^;]*; first ([0-9.]+)%, last ([0-9.]+)%, )"
                         R"(length ([0-9.]+)%, parity ([0-9.]+)%)");
  ASSERT_TRUE(std::regex_search(tune.output, m, after)) << tune.output;
  EXPECT_GE(std::stod(m[4]), 90.0) << m[0];
}

}  // namespace
}  // namespace memtune::testing
