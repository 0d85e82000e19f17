#pragma once
// Where this process sits among several: read from the variables torchrun (and
// `memtune launch`) set, or from Slurm's when run under srun. One process by default.
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace memtune {

struct DistEnv {
  int rank = 0;               // global rank, [0, world_size)
  int world_size = 1;         // processes in the job
  int local_rank = 0;         // rank on this node: picks the device
  int local_world_size = 1;   // processes on this node
  int node_rank = 0;          // GROUP_RANK / SLURM_NODEID
  std::string master_addr;    // host of rank 0's TCPStore
  int master_port = 0;
  std::string source = "default";  // torchrun | slurm | default, for messages

  bool enabled() const { return world_size > 1; }

  // From a lookup (getenv by default). torchrun's WORLD_SIZE wins over Slurm's variables.
  // Throws UserError on values that are not integers or that contradict each other.
  static DistEnv from_environment(
      const std::function<std::optional<std::string>(const std::string&)>& getenv_fn = {});
};

// Slurm's compressed host list, "node[01-04,07],gpu5" -> node01..node04, node07, gpu5.
// Zero padding of a range's bounds is kept. Throws UserError on malformed lists.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);

// A TCP port free on this host now (launch --standalone, tests, benchmarks).
int free_tcp_port();

}  // namespace memtune
