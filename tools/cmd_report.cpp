// memtune report RUN_DIR [--out DIR] [--compare OTHER_RUN...]: plots (PNG) and a
// self-contained report.html of a training run's metrics.jsonl, config.yaml and
// memory_report.txt, with other runs' losses beside its own.
#include <iostream>

#include <CLI/CLI.hpp>

#include "trainer/report.h"
#include "tools/commands.h"

namespace memtune::cli {

void add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("report", "plot a training run's metrics and write a self-contained report.html");
  struct Args {
    std::string run_dir;
    std::string out;
    std::vector<std::string> compare;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("run_dir", a->run_dir, "a run's training.output_dir (holds metrics.jsonl)")->required();
  cmd->add_option("--out", a->out, "where report.html and the PNGs go (default: RUN_DIR)");
  cmd->add_option("--compare", a->compare,
                  "other runs' output_dirs: their losses drawn beside this run's and tabled against it");
  cmd->callback([a] {
    trainer::ReportOptions o;
    o.out_dir = a->out;
    o.compare.assign(a->compare.begin(), a->compare.end());
    const trainer::ReportFiles f = trainer::write_report(a->run_dir, o);
    std::cout << f.html.string() << "\n";
    for (const auto& p : f.plots) std::cout << p.string() << "\n";
    std::cout << f.script.string() << "\n";
  });
}

}  // namespace memtune::cli
