#pragma once
// Each subcommand registers itself on the app; its callback stores the exit code.
namespace CLI {
class App;
}

namespace memtune::cli {

extern int g_exit_code;

void add_train_command(CLI::App& app);
void add_init_model_command(CLI::App& app);
void add_merge_command(CLI::App& app);
void add_quantize_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_mem_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_report_command(CLI::App& app);
void add_estimate_command(CLI::App& app);
void add_launch_command(CLI::App& app);  // launch: torchrun-style workers (tools/launcher.h)

}  // namespace memtune::cli
