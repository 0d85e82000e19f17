// memtune launch [torchrun's flags] -- train CONFIG [key=value ...]
#include <random>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <CLI/CLI.hpp>
#include <unistd.h>

#include "runtime/dist_env.h"
#include "runtime/error.h"
#include "tools/commands.h"
#include "tools/launcher.h"

namespace memtune::cli {

void add_launch_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "launch", "start this node's workers with torchrun's environment: memtune launch --nproc-per-node 2 -- train CONFIG");
  struct Args {
    tools::LaunchOptions options;
    std::string nproc = "1";
    bool standalone = false;
    std::vector<std::string> command;
  };
  auto a = std::make_shared<Args>();
  auto& o = a->options;
  cmd->add_option("--nnodes", o.nnodes, "nodes in the job (one launcher per node)")->capture_default_str();
  cmd->add_option("--nproc-per-node,--nproc_per_node", a->nproc,
                  "workers on this node: a number, or auto (one per GPU, else one per CPU core)")
      ->capture_default_str();
  cmd->add_option("--node-rank,--node_rank", o.node_rank, "this node's rank in [0, nnodes)")->capture_default_str();
  cmd->add_option("--master-addr,--master_addr", o.master_addr, "address of node 0 (where rank 0 hosts the store)")
      ->capture_default_str();
  cmd->add_option("--master-port,--master_port", o.master_port, "port of rank 0's store")->capture_default_str();
  cmd->add_flag("--standalone", a->standalone, "single node: 127.0.0.1 and a free port");
  cmd->add_option("--max-restarts,--max_restarts", o.max_restarts,
                  "restarts of the whole group after a worker fails (it resumes from the latest checkpoint)")
      ->capture_default_str();
  cmd->add_option("--monitor-interval,--monitor_interval", o.monitor_interval, "seconds between checks of the workers")
      ->capture_default_str();
  cmd->add_option("--stop-timeout", o.stop_timeout, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  cmd->add_option("--log-dir,--log_dir", o.log_dir,
                  "per-rank logs: DIR/attempt_N/rank_R.log (default: a temporary directory, output on the console)");
  cmd->add_flag("--tee", o.tee, "with --log-dir: also print the workers' output, each line prefixed with its rank");
  cmd->add_option("--rdzv-id,--rdzv_id", o.run_id, "the run id (TORCHELASTIC_RUN_ID)")->capture_default_str();
  cmd->add_option("command", a->command, "after '--': the memtune command each worker runs (train CONFIG ...)")
      ->required();
  cmd->callback([a] {
    auto& o = a->options;
    if (a->nproc == "auto") {
      int gpus = at::hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
      o.nproc_per_node = gpus > 0 ? gpus : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
    } else {
      size_t used = 0;
      try {
        o.nproc_per_node = std::stoi(a->nproc, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MEMTUNE_CHECK(used > 0 && used == a->nproc.size(), "--nproc-per-node '", a->nproc, "' is not a number or auto");
    }
    if (a->standalone) {
      MEMTUNE_CHECK(o.nnodes == 1, "--standalone runs on one node, but --nnodes is ", o.nnodes);
      o.master_addr = "127.0.0.1";
      o.master_port = free_tcp_port();
      if (o.run_id == "none") {
        std::random_device rd;
        o.run_id = str_cat(std::hex, rd(), rd());
      }
    }
    o.program = "/proc/self/exe";
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) o.program.assign(exe, n);
    o.args = a->command;
    o.restart_args = {"training.resume_from_checkpoint=latest"};
    g_exit_code = tools::run_launcher(o);
  });
}

}  // namespace memtune::cli
