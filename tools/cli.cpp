#include "tools/cli.h"

#include <iostream>

#include <ATen/Context.h>
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "runtime/compat.h"
#include "runtime/cuda_info.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/supervisor.h"
#include "runtime/threads.h"
#include "tools/commands.h"

#ifndef MEMTUNE_VERSION
#define MEMTUNE_VERSION "dev"
#endif

namespace memtune::cli {

int g_exit_code = 0;

namespace {

std::string version_text() {
  return std::string("memtune ") + MEMTUNE_VERSION + "\nLibTorch " + compat::torch_version() + "\n" +
         describe(cuda_info()) + "\n";
}

}  // namespace

int report_exception(std::exception_ptr error) {
  constexpr const char* kReport =
      "This is a bug in memtune, not in your input: please report it with the command, the config "
      "(config.yaml in the output directory) and this message.";
  try {
    std::rethrow_exception(error);
  } catch (const MemoryExhausted& e) {
    spdlog::error("{}", e.what());
    return kExitMemory;
  } catch (const UserError& e) {
    spdlog::error("{}", e.what());
    return kExitBadInput;
  } catch (const InternalError& e) {
    spdlog::critical("internal error: {}", e.what());
    spdlog::critical("{}", kReport);
    return kExitInternalBug;
  } catch (const c10::Error& e) {
    spdlog::error("{}", e.what_without_backtrace());
    if (compat::is_out_of_memory(e)) {
      spdlog::error("out of memory outside a training step (loading the model, its state or the data): "
                    "raise memory.device_limit, or use load_in_4bit and a smaller model");
      return kExitMemory;
    }
    spdlog::error("memtune did not expect this error from LibTorch; if your input looks valid, this is a bug: {}",
                  kReport);
    return kExitUnexpected;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    spdlog::error("memtune did not expect this error; if your input looks valid, this is a bug: {}", kReport);
    return kExitUnexpected;
  }
}

int memtune_main(int argc, char** argv) {
  reexec_with_passive_omp_wait(argv);
  init_logging({});
  // Every command's intra-op threads from the CPU affinity (`memtune train` then applies
  // runtime.num_threads): LibTorch 1.13's own default is one thread on some machines, which
  // ran eval, generate, merge and quantize at half speed on two cores.
  try {
    spdlog::debug("{}", configure_threads(0));
  } catch (...) {
    return report_exception(std::current_exception());  // ATEN_CPU_CAPABILITY memtune does not know
  }
  CLI::App app{"memtune: fine-tune transformer language models on the memory you have"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "print memtune's version, LibTorch's and the CUDA devices");
  add_train_command(app);
  add_init_model_command(app);
  add_merge_command(app);
  add_quantize_command(app);
  add_generate_command(app);
  add_eval_command(app);
  add_mem_command(app);
  add_tokenize_command(app);
  add_report_command(app);
  add_estimate_command(app);
  add_launch_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version print and succeed; every usage error is bad input: exit 2, as
    // for every other bad input (CLI11's own codes, 105-115, mean nothing to a script).
    return app.exit(e) == 0 ? kExitOk : kExitBadInput;
  } catch (...) {
    return report_exception(std::current_exception());
  }
  if (version) {
    std::cout << version_text();
    return 0;
  }
  if (app.get_subcommands().empty()) {
    std::cout << app.help();
    return 0;
  }
  return g_exit_code;
}

}  // namespace memtune::cli
