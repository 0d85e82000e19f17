#pragma once
// `memtune launch`: starts this node's workers with torchrun's environment, watches them,
// stops the rest when one fails, restarts the group while restarts are left, and forwards
// SIGINT/SIGTERM. The process management lives here; cmd_launch.cpp only parses flags.
#include <string>
#include <vector>

namespace memtune::tools {

struct LaunchOptions {
  int nnodes = 1;                          // nodes in the job
  int nproc_per_node = 1;                  // workers on this node (resolved, not "auto")
  int node_rank = 0;                       // this node's rank, [0, nnodes)
  std::string master_addr = "127.0.0.1";   // where rank 0 hosts the store
  int master_port = 29500;
  int max_restarts = 0;                    // group restarts after a failure
  double monitor_interval = 0.1;           // s between checks of the workers
  double stop_timeout = 30;                // s between SIGTERM and SIGKILL
  std::string log_dir;                     // per-rank logs; empty: a fresh temporary directory
  bool tee = false;                        // also to the console, prefixed with the rank
  std::string run_id = "none";             // TORCHELASTIC_RUN_ID
  std::string program;                     // the worker executable (memtune itself)
  std::vector<std::string> args;           // its arguments ("train", CONFIG, key=value...)
  std::vector<std::string> restart_args;   // appended on a restart (resume from checkpoint)
};

// The environment of local worker `local_rank` on top of `base` ("NAME=value" entries;
// RANK, WORLD_SIZE, ... replaced; OMP_NUM_THREADS added when `base` lacks it).
std::vector<std::string> worker_environment(const LaunchOptions& options, int local_rank, int restart_count,
                                            const std::vector<std::string>& base, int cores);

// Runs the workers to completion. Returns 0 when every worker exited 0; otherwise prints
// which rank failed (exit code or signal, the tail of its log) and returns non-zero;
// after SIGINT/SIGTERM returns 128 + the signal.
int run_launcher(const LaunchOptions& options);

}  // namespace memtune::tools
