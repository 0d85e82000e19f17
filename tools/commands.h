#pragma once
// Each subcommand registers itself on the app; its callback stores the exit code.
namespace CLI {
class App;
}

namespace memtune::cli {

extern int g_exit_code;

void add_train_command(CLI::App& app);
void add_model_commands(CLI::App& app);  // init-model, merge, quantize, generate, eval
void add_mem_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);

}  // namespace memtune::cli
