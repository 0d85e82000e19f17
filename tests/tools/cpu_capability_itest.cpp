// ATEN_CPU_CAPABILITY through the real command: the variable that caps ATen's kernels caps
// memtune's own (runtime/cpu_features.h), the log names both, a whole training run computes the
// same losses under each cap (the portable, AVX2 and AVX-512 kernels are one math in other
// orders), and a value neither library knows is refused by name before anything runs.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>

#include "test_util.h"

namespace memtune::testing {
namespace {

std::vector<double> losses(const fs::path& run_dir) {
  std::vector<double> out;
  for (const auto& row : read_jsonl(run_dir / "metrics.jsonl", "loss")) out.push_back(row["loss"].get<double>());
  return out;
}

TEST(CpuCapability, EachCapRunsTheSameTrainingAndTheLogNamesIt) {
  const fs::path d = temp_dir(), src = source_dir();
  auto init = run(memtune_bin() + " init-model --preset tiny-llama --seed 5 --out " + (d / "base").string() +
                  " --tokenizer " + (src / "examples/tiny-tokenizer").string());
  ASSERT_EQ(init.exit_code, 0) << init.output;
  const std::string args =
      " train " + (src / "configs/quickstart.yaml").string() + " runtime.device=cpu model.name_or_path=" +
      (d / "base").string() + " model.tokenizer=null data.format=text data.train_file=" +
      (src / "examples/data/corpus.jsonl").string() + " data.eval_file=null data.max_seq_length=64" +
      " data.cache_dir=" + (d / "cache").string() +
      " training.max_steps=4 training.eval_steps=0 training.eval_accuracy_rows=0 training.save_steps=0"
      " training.per_device_train_batch_size=4 training.gradient_accumulation_steps=1 training.logging_steps=1"
      " training.learning_rate=0.01 memory.device_limit=null lora.r=4 lora.lora_alpha=8";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  struct Cap {
    std::string value, memtune;
    bool aten_vector;  // ATen names its DEFAULT "NO AVX" (1.13) or "DEFAULT"
  };
  const std::vector<Cap> caps = {{"default", "portable", false}, {"avx2", avx2 ? "AVX2" : "portable", avx2}};
  auto unset = run("env -u ATEN_CPU_CAPABILITY " + memtune_bin() + args + " training.output_dir=" +
                   (d / "unset").string());
  ASSERT_EQ(unset.exit_code, 0) << unset.output;
  const std::vector<double> want = losses(d / "unset");
  ASSERT_EQ(want.size(), 4u) << unset.output;
  const std::string widest = __builtin_cpu_supports("avx512f") ? "AVX-512" : avx2 ? "AVX2" : "portable";
  EXPECT_NE(unset.output.find(", memtune " + widest + "\n"), std::string::npos) << unset.output;

  for (const Cap& cap : caps) {
    SCOPED_TRACE(cap.value);
    auto r = run("ATEN_CPU_CAPABILITY=" + cap.value + " " + memtune_bin() + args + " training.output_dir=" +
                 (d / cap.value).string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const bool aten_avx2 = r.output.find("kernels: ATen AVX2, ") != std::string::npos;
    const bool aten_none = r.output.find("kernels: ATen NO AVX, ") != std::string::npos ||
                           r.output.find("kernels: ATen DEFAULT, ") != std::string::npos;
    EXPECT_TRUE(cap.aten_vector ? aten_avx2 : aten_none) << r.output;
    EXPECT_NE(r.output.find(", memtune " + cap.memtune + " (ATEN_CPU_CAPABILITY=" + cap.value + ")"),
              std::string::npos)
        << r.output;
    // Other kernels sum in other orders (fp32, about 1e-7 a sum); four steps of LoRA at lr 0.01
    // keep the losses within 1e-4 of each other. A cap that changed the math (a kernel that
    // computes something else on one path) moves them by far more.
    const std::vector<double> got = losses(d / cap.value);
    ASSERT_EQ(got.size(), want.size()) << r.output;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-4 * std::abs(want[i])) << "step " << i + 1;
  }
}

TEST(CpuCapability, AValueMemtuneDoesNotKnowIsRefusedByName) {
  // ATen itself would ignore these with a warning and use the widest kernels.
  for (const std::string value : {"AVX2", "avx9"}) {
    auto r = run("ATEN_CPU_CAPABILITY=" + value + " " + memtune_bin() + " --version");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("ATEN_CPU_CAPABILITY='" + value + "' is not a capability"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("default (no vector kernels), avx2 and avx512"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace memtune::testing
