// memtune train CONFIG [key=value ...]
#include <iostream>

#include <CLI/CLI.hpp>

#include "trainer/config.h"
#include "trainer/trainer.h"
#include "tools/commands.h"

namespace memtune::cli {

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "fine-tune a model as a YAML config says");
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool help_config = false;
    std::string log_level;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("config", a->config, "the YAML config (see configs/)");
  cmd->add_option("overrides", a->overrides, "key=value overrides, e.g. training.learning_rate=1e-4");
  cmd->add_flag("--help-config", a->help_config, "print every config key with its type, default and help");
  cmd->add_option("--log-level", a->log_level, "trace, debug, info, warn, error");
  cmd->callback([a] {
    if (a->help_config) {
      std::cout << trainer::config_help();
      return;
    }
    if (a->config.empty()) throw CLI::RequiredError("config");
    std::vector<std::string> overrides = a->overrides;
    if (!a->log_level.empty()) overrides.push_back("runtime.log_level=" + a->log_level);
    trainer::Config config = trainer::load_config(a->config, overrides);
    g_exit_code = trainer::train(config).exit_code;
  });
}

}  // namespace memtune::cli
