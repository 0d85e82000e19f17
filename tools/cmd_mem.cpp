// memtune mem [--json]: every device's allocated / reserved / peak / total / free, and the
// host's RSS and available memory.
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/memory.h"
#include "tools/commands.h"

namespace memtune::cli {

void add_mem_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("mem", "print memory statistics of every visible device and the host");
  auto json_out = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json_out, "one JSON object instead of a table");
  cmd->callback([json_out] {
    if (*json_out)
      std::cout << memory_report_json().dump(2) << "\n";
    else
      std::cout << memory_report_text();
  });
}

}  // namespace memtune::cli
