#pragma once
// `memtune report RUN_DIR [--compare OTHER...]`: plots of a run's metrics.jsonl (PNG, drawn
// by gnuplot) and a self-contained report.html (plots embedded as base64 data URIs, inline
// CSS, no network) with the run's summary, its events, config.yaml and memory_report.txt;
// other runs' losses drawn beside this one's and tabled against it.
#include <filesystem>
#include <string>
#include <vector>

namespace memtune::trainer {

struct ReportOptions {
  std::filesystem::path out_dir;    // where report.html and the PNGs go; empty: the run dir
  std::string gnuplot = "gnuplot";  // the plotting program, a path or a name on PATH
  int width = 960, height = 480;    // PNG size in pixels
  // Other runs (their output_dirs) whose train and eval losses are drawn on the loss plot and
  // compared in a table (e.g. adamw_8bit against adamw_torch on the same data).
  std::vector<std::filesystem::path> compare;
};

struct ReportFiles {
  std::filesystem::path html;                // report.html
  std::vector<std::filesystem::path> plots;  // loss.png, lr.png, tokens_per_s.png, memory.png
  std::filesystem::path script;              // plots.gnuplot: the script that drew them
};

// Reads run_dir/metrics.jsonl (and config.yaml, memory_report.txt when present; each compared
// run's metrics.jsonl) and writes the report. Throws UserError for a missing run dir, a
// missing or malformed metrics.jsonl (naming file:line and the key), a run without logged
// steps, or gnuplot missing or failing.
ReportFiles write_report(const std::filesystem::path& run_dir, const ReportOptions& options = {});

}  // namespace memtune::trainer
