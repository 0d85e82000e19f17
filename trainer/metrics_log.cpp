#include "trainer/metrics_log.h"

#include <string>

#include <spdlog/spdlog.h>

#include "runtime/atomic_file.h"
#include "runtime/error.h"

namespace memtune::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

void keep_metrics_through(const fs::path& file, int64_t step) {
  std::ifstream in(file);
  if (!in) return;
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const json row = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!row.is_object()) {
      ++dropped;
      continue;
    }
    const int64_t at = row.contains("step") && row["step"].is_number() ? row["step"].get<int64_t>() : -1;
    const std::string when = row.contains("when") && row["when"].is_string() ? row["when"].get<std::string>() : "";
    if (at <= step && !(at == step && (when == kFinalEval || when == kFinalAccuracy)))
      kept += line + "\n";
    else
      ++dropped;
  }
  if (dropped == 0) return;
  write_file_atomic(file, kept);
  spdlog::info("metrics.jsonl: {} rows after step {} or of its final evaluations dropped (they run again)", dropped,
               step);
}

MetricsLog::MetricsLog(const fs::path& file, int64_t step, bool writer) {
  if (!writer) return;
  if (step > 0) keep_metrics_through(file, step);
  out_.open(file, step > 0 ? std::ios::app : std::ios::trunc);
  MEMTUNE_CHECK(out_.good(), file.string(), ": cannot open for writing");
}

void MetricsLog::write(const json& row) {
  if (!out_.is_open()) return;
  out_ << row.dump() << "\n";
  out_.flush();
}

}  // namespace memtune::trainer
