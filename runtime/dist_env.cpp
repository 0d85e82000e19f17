#include "runtime/dist_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdlib>

#include "runtime/error.h"

namespace memtune {
namespace {

using Lookup = std::function<std::optional<std::string>(const std::string&)>;

std::optional<int> read_int(const Lookup& env, const std::string& name) {
  auto value = env(name);
  if (!value || value->empty()) return std::nullopt;
  size_t used = 0;
  long parsed = 0;
  try {
    parsed = std::stol(*value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MEMTUNE_CHECK(used == value->size() && parsed >= 0 && parsed < (1L << 30),
                "environment variable ", name, "='", *value,
                "' is not a non-negative integer (set by the launcher: torchrun, memtune launch or srun)");
  return static_cast<int>(parsed);
}

// Splits at commas outside brackets.
std::vector<std::string> split_top_level(const std::string& text, const std::string& whole) {
  std::vector<std::string> parts;
  std::string current;
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    MEMTUNE_CHECK(depth >= 0 && depth <= 1, "SLURM_JOB_NODELIST '", whole,
                  "' has unbalanced or nested brackets");
    if (c == ',' && depth == 0) {
      parts.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  MEMTUNE_CHECK(depth == 0, "SLURM_JOB_NODELIST '", whole, "' has an unclosed '['");
  parts.push_back(current);
  return parts;
}

// "01-04,07" -> 01 02 03 04 07 (the width of the lower bound is kept).
std::vector<std::string> expand_ranges(const std::string& ranges, const std::string& whole) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t comma = ranges.find(',', start);
    std::string item = ranges.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t dash = item.find('-');
    std::string lo = item.substr(0, dash), hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    auto digits = [](const std::string& s) {
      return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
    };
    MEMTUNE_CHECK(digits(lo) && digits(hi) && lo.size() < 10 && hi.size() < 10, "SLURM_JOB_NODELIST '",
                  whole, "': '", item, "' is not a number or a range like 01-04");
    long a = std::stol(lo), b = std::stol(hi);
    MEMTUNE_CHECK(a <= b, "SLURM_JOB_NODELIST '", whole, "': range '", item, "' runs backwards");
    for (long i = a; i <= b; ++i) {
      std::string n = std::to_string(i);
      if (n.size() < lo.size()) n.insert(0, lo.size() - n.size(), '0');
      out.push_back(n);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// One host expression, possibly with several bracket groups: "rack[1-2]-n[1-2]".
void expand_item(const std::string& item, const std::string& whole, std::vector<std::string>& out) {
  size_t open = item.find('[');
  if (open == std::string::npos) {
    out.push_back(item);
    return;
  }
  size_t close = item.find(']', open);
  std::string prefix = item.substr(0, open), rest = item.substr(close + 1);
  for (const auto& n : expand_ranges(item.substr(open + 1, close - open - 1), whole)) {
    expand_item(prefix + n + rest, whole, out);
  }
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
  MEMTUNE_CHECK(!nodelist.empty(), "SLURM_JOB_NODELIST is empty");
  std::vector<std::string> hosts;
  for (const auto& item : split_top_level(nodelist, nodelist)) {
    MEMTUNE_CHECK(!item.empty() && item[0] != '[', "SLURM_JOB_NODELIST '", nodelist,
                  "' has an empty host name");
    expand_item(item, nodelist, hosts);
  }
  return hosts;
}

DistEnv DistEnv::from_environment(const Lookup& getenv_fn) {
  Lookup env = getenv_fn ? getenv_fn : [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  DistEnv d;
  auto world = read_int(env, "WORLD_SIZE");
  if (world) {
    d.source = "torchrun";
    d.world_size = *world;
    MEMTUNE_CHECK(d.world_size >= 1, "WORLD_SIZE=0: a job has at least one process");
    auto rank = read_int(env, "RANK");
    MEMTUNE_CHECK(rank || d.world_size == 1, "WORLD_SIZE=", d.world_size,
                  " is set but RANK is not (run through torchrun, memtune launch or srun)");
    d.rank = rank.value_or(0);
    d.local_rank = read_int(env, "LOCAL_RANK").value_or(d.rank);
    d.local_world_size = read_int(env, "LOCAL_WORLD_SIZE").value_or(d.world_size);
    d.node_rank = read_int(env, "GROUP_RANK").value_or(0);
  } else if (auto ntasks = read_int(env, "SLURM_NTASKS")) {
    d.source = "slurm";
    d.world_size = *ntasks;
    auto procid = read_int(env, "SLURM_PROCID");
    MEMTUNE_CHECK(procid, "SLURM_NTASKS=", *ntasks, " is set but SLURM_PROCID is not (start the job with srun)");
    d.rank = *procid;
    d.local_rank = read_int(env, "SLURM_LOCALID").value_or(0);
    d.node_rank = read_int(env, "SLURM_NODEID").value_or(0);
    auto nnodes = read_int(env, "SLURM_NNODES").value_or(1);
    auto per_node = env("SLURM_NTASKS_PER_NODE");
    // "4" or "4(x2)": equal tasks per node; otherwise assume an even split.
    int local = 0;
    if (per_node && !per_node->empty()) local = std::atoi(per_node->c_str());
    d.local_world_size = local > 0 ? local : std::max(1, d.world_size / std::max(1, nnodes));
  } else {
    return d;
  }
  MEMTUNE_CHECK(d.rank < d.world_size, "rank ", d.rank, " (", d.source == "slurm" ? "SLURM_PROCID" : "RANK",
                ") is not below the world size ", d.world_size);
  MEMTUNE_CHECK(d.local_world_size <= d.world_size, "LOCAL_WORLD_SIZE=", d.local_world_size,
                " exceeds WORLD_SIZE=", d.world_size);
  MEMTUNE_CHECK(d.local_rank < d.local_world_size, "local rank ", d.local_rank,
                " is not below the processes on this node (", d.local_world_size, ")");

  auto addr = env("MASTER_ADDR");
  if (addr && !addr->empty()) {
    d.master_addr = *addr;
  } else if (d.source == "slurm") {
    auto nodelist = env("SLURM_JOB_NODELIST");
    if (!nodelist) nodelist = env("SLURM_NODELIST");
    MEMTUNE_CHECK(nodelist, "under Slurm with SLURM_NTASKS=", d.world_size,
                  " neither MASTER_ADDR nor SLURM_JOB_NODELIST is set");
    d.master_addr = expand_slurm_nodelist(*nodelist).front();
  } else {
    d.master_addr = "127.0.0.1";
  }
  auto port = read_int(env, "MASTER_PORT");
  if (port) {
    d.master_port = *port;
  } else if (d.source == "slurm") {
    // Every task of the job derives the same port from the job id.
    d.master_port = 29500 + read_int(env, "SLURM_JOB_ID").value_or(0) % 1000;
  } else {
    MEMTUNE_CHECK(!d.enabled(), "WORLD_SIZE=", d.world_size, " but MASTER_PORT is not set");
  }
  MEMTUNE_CHECK(d.master_port < 65536, "MASTER_PORT=", d.master_port, " is not a TCP port");
  return d;
}

int free_tcp_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  MEMTUNE_CHECK(fd >= 0, "free_tcp_port: socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  MEMTUNE_CHECK(ok, "cannot find a free TCP port: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

}  // namespace memtune
