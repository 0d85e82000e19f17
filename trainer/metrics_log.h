#pragma once
// output_dir/metrics.jsonl: one JSON object per line (a logged step, an evaluation), each
// flushed as written so a plot follows the run and a kill loses at most the line in flight.
#include <cstdint>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

namespace memtune::trainer {

// The `when` of the final evaluations' rows: written after a run's last checkpoint, so a
// resume at that step drops them and its own finish writes them again.
inline constexpr const char* kFinalEval = "final";
inline constexpr const char* kFinalAccuracy = "after training";

class MetricsLog {
 public:
  // A run from step 0 starts the file afresh. A run resumed at `step` keeps the rows of
  // steps up to it (the steps after it run again and write their rows anew, so a plot never
  // shows a step twice), but not the final evaluations' at `step` (when: final, after
  // training: they come after its checkpoint, and run again when the resumed run finishes),
  // and drops a line a kill cut short. `writer` false (a rank other than 0) opens nothing and
  // writes nothing.
  MetricsLog(const std::filesystem::path& file, int64_t step, bool writer);

  void write(const nlohmann::json& row);

 private:
  std::ofstream out_;
};

// The rewrite a resumed run does; atomic, so a kill here leaves the old file or the new one.
void keep_metrics_through(const std::filesystem::path& file, int64_t step);

}  // namespace memtune::trainer
