#include "tools/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>

#include "runtime/error.h"

extern char** environ;

namespace memtune::tools {
namespace fs = std::filesystem;
namespace {

volatile sig_atomic_t g_signal = 0;
int g_wake_write = -1;

void on_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
  if (g_wake_write >= 0) {
    char c = 1;
    ssize_t ignored = write(g_wake_write, &c, 1);
    (void)ignored;
  }
}

using Clock = std::chrono::steady_clock;

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  int fd = -1;              // read end of the worker's stdout+stderr
  fs::path log_path;
  std::ofstream log;
  std::string partial;      // console text after the last newline
  bool running = false;
  int status = 0;           // waitpid status once exited
  int stop_signal = 0;      // while stopped (SIGSTOP, SIGTSTP, a debugger): the signal
  Clock::time_point stopped_at;
};

std::string signal_name(int sig) {
  return str_cat(sig, " (SIG", sigabbrev_np(sig) ? sigabbrev_np(sig) : "?", ")");
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return str_cat("killed by signal ", signal_name(sig));
  }
  return str_cat("exit code ", WEXITSTATUS(status));
}

bool failed(int status) { return WIFSIGNALED(status) || WEXITSTATUS(status) != 0; }

std::string tail_of(const fs::path& path, int lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "  (no log)\n";
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  std::streamoff start = std::max<std::streamoff>(0, size - 8192);
  in.seekg(start);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> all;
  std::istringstream ss(text);
  for (std::string line; std::getline(ss, line);) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size(); ++i)
    out += "  | " + all[i] + "\n";
  return out.empty() ? "  (empty log)\n" : out;
}

class Group {
 public:
  Group(const LaunchOptions& options, bool console) : options_(options), console_(console) {}

  void start(int restart_count, const fs::path& dir) {
    fs::create_directories(dir);
    std::vector<std::string> base;
    for (char** e = environ; *e; ++e) base.emplace_back(*e);
    const int cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    std::vector<std::string> args = options_.args;
    if (restart_count > 0) args.insert(args.end(), options_.restart_args.begin(), options_.restart_args.end());
    workers_.clear();
    workers_.resize(options_.nproc_per_node);
    for (int l = 0; l < options_.nproc_per_node; ++l) {
      Worker& w = workers_[l];
      w.local_rank = l;
      w.rank = options_.node_rank * options_.nproc_per_node + l;
      w.log_path = dir / str_cat("rank_", w.rank, ".log");
      w.log.open(w.log_path, std::ios::binary | std::ios::trunc);
      MEMTUNE_CHECK(w.log.good(), "--log-dir: cannot write ", w.log_path.string());
      spawn(w, args, worker_environment(options_, l, restart_count, base, cores));
    }
  }

  // Pumps output and reaps until every worker exited, one failed, or a signal arrived.
  // Returns the index of the first failed worker, or -1.
  int watch() {
    while (true) {
      pump(static_cast<int>(options_.monitor_interval * 1000));
      int failure = reap();
      if (failure >= 0 || g_signal) return failure;
      if (running() == 0) return -1;
    }
  }

  // `sig` to every running worker's process group, SIGKILL after the stop timeout.
  void stop(int sig) {
    for (auto& w : workers_)
      if (w.running) {
        kill(-w.pid, sig);
        if (w.stop_signal) kill(-w.pid, SIGCONT);  // a stopped worker acts on `sig` only once continued
      }
    auto deadline = Clock::now() + std::chrono::duration<double>(options_.stop_timeout);
    while (running() > 0 && Clock::now() < deadline) {
      pump(50);
      reap();
    }
    for (auto& w : workers_)
      if (w.running) kill(-w.pid, SIGKILL);
    while (running() > 0) {
      pump(50);
      reap();
    }
    // A grandchild may still hold a pipe open: keep what was read, close the rest.
    for (auto& w : workers_) {
      if (w.fd >= 0) {
        close(w.fd);
        w.fd = -1;
      }
      if (console_ && !w.partial.empty()) echo(w, "\n");
    }
  }

  const Worker& worker(int i) const { return workers_[i]; }

  // A worker that is stopped now (SIGSTOP...): while it is, its peers wait for it in their
  // collectives until they time out and fail, so it, not they, is the cause. -1 if none.
  int stopped_worker() const {
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].running && workers_[i].stop_signal) return static_cast<int>(i);
    return -1;
  }

 private:
  void spawn(Worker& w, const std::vector<std::string>& args, const std::vector<std::string>& env) {
    std::vector<char*> argv, envp;
    argv.push_back(const_cast<char*>(options_.program.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    int fds[2];
    MEMTUNE_CHECK(pipe2(fds, O_CLOEXEC) == 0, "memtune launch: pipe: ", std::strerror(errno));
    pid_t pid = fork();
    MEMTUNE_CHECK(pid >= 0, "memtune launch: fork: ", std::strerror(errno));
    if (pid == 0) {
      // Async-signal-safe calls only until exec.
      setpgid(0, 0);                      // signals reach the worker's whole tree
      prctl(PR_SET_PDEATHSIG, SIGTERM);   // the launcher gone: checkpoint and exit
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      execve(argv[0], argv.data(), envp.data());
      const char msg[] = "memtune launch: cannot execute the worker program\n";
      ssize_t ignored = write(2, msg, sizeof msg - 1);
      (void)ignored;
      _exit(127);
    }
    setpgid(pid, pid);
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    w.pid = pid;
    w.fd = fds[0];
    w.running = true;
  }

  int running() const {
    int n = 0;
    for (const auto& w : workers_) n += w.running;
    return n;
  }

  void pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<Worker*> owners;
    for (auto& w : workers_) {
      if (w.fd < 0) continue;
      fds.push_back({w.fd, POLLIN, 0});
      owners.push_back(&w);
    }
    poll(fds.data(), fds.size(), timeout_ms);  // EINTR on a signal: fine
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) drain(*owners[i]);
  }

  void drain(Worker& w) {
    char buf[65536];
    while (w.fd >= 0) {
      ssize_t n = read(w.fd, buf, sizeof buf);
      if (n > 0) {
        w.log.write(buf, n);
        w.log.flush();
        if (console_) echo(w, std::string(buf, n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        close(w.fd);
        w.fd = -1;
        if (console_ && !w.partial.empty()) echo(w, "\n");
      } else if (errno == EAGAIN) {
        return;
      }
    }
  }

  void echo(Worker& w, const std::string& text) {
    w.partial += text;
    size_t start = 0, nl;
    std::string out;
    while ((nl = w.partial.find('\n', start)) != std::string::npos) {
      out += str_cat("[rank ", w.rank, "]: ", w.partial.substr(start, nl + 1 - start));
      start = nl + 1;
    }
    w.partial.erase(0, start);
    std::cerr << out << std::flush;
  }

  int reap() {
    int failure = -1;
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (!w.running) continue;
      int status = 0;
      if (waitpid(w.pid, &status, WNOHANG | WUNTRACED | WCONTINUED) != w.pid) continue;
      if (WIFSTOPPED(status)) {
        w.stop_signal = WSTOPSIG(status);
        w.stopped_at = Clock::now();
        continue;
      }
      if (WIFCONTINUED(status)) {
        w.stop_signal = 0;
        continue;
      }
      w.running = false;
      w.status = status;
      // Its output may still sit in the pipe; a grandchild holding the pipe must not block us.
      drain(w);
      // Of several found dead in one pass, a signal death is more likely the cause than a
      // peer's error exit.
      if (failed(status) && (failure < 0 || (WIFSIGNALED(status) && !WIFSIGNALED(workers_[failure].status))))
        failure = static_cast<int>(i);
    }
    return failure;
  }

  const LaunchOptions& options_;
  bool console_;
  std::vector<Worker> workers_;
};

}  // namespace

std::vector<std::string> worker_environment(const LaunchOptions& o, int local_rank, int restart_count,
                                            const std::vector<std::string>& base, int cores) {
  const int world = o.nnodes * o.nproc_per_node;
  const int rank = o.node_rank * o.nproc_per_node + local_rank;
  std::map<std::string, std::string> set = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(o.nnodes)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world)},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      {"TORCHELASTIC_RUN_ID", o.run_id},
  };
  std::vector<std::string> env;
  bool has_omp = false;
  for (const auto& entry : base) {
    std::string name = entry.substr(0, entry.find('='));
    if (set.count(name)) continue;
    has_omp |= name == "OMP_NUM_THREADS";
    env.push_back(entry);
  }
  for (const auto& [name, value] : set) env.push_back(name + "=" + value);
  if (!has_omp) env.push_back(str_cat("OMP_NUM_THREADS=", std::max(1, cores / std::max(1, o.nproc_per_node))));
  return env;
}

int run_launcher(const LaunchOptions& options) {
  MEMTUNE_CHECK(options.nnodes >= 1, "--nnodes ", options.nnodes, " must be at least 1");
  MEMTUNE_CHECK(options.nproc_per_node >= 1, "--nproc-per-node ", options.nproc_per_node, " must be at least 1");
  // Each worker is a whole process holding the model: a mistyped count must not fork
  // thousands of them (99999 did, until the machine stalled).
  const int local_limit = std::max(64, 4 * static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  MEMTUNE_CHECK(options.nproc_per_node <= local_limit, "--nproc-per-node ", options.nproc_per_node,
                " exceeds ", local_limit, " workers on this node (4 per CPU core, at least 64); use one per GPU or a few "
                "per CPU core");
  MEMTUNE_CHECK(options.nnodes <= 65536, "--nnodes ", options.nnodes, " exceeds 65536 nodes");
  MEMTUNE_CHECK(options.node_rank >= 0 && options.node_rank < options.nnodes, "--node-rank ", options.node_rank,
                " is not in [0, --nnodes ", options.nnodes, ")");
  MEMTUNE_CHECK(options.max_restarts >= 0, "--max-restarts ", options.max_restarts, " must be >= 0");
  MEMTUNE_CHECK(options.monitor_interval > 0, "--monitor-interval ", options.monitor_interval, " must be > 0");
  MEMTUNE_CHECK(!options.args.empty(), "memtune launch: no worker command after '--' (e.g. -- train config.yaml)");

  fs::path log_dir = options.log_dir;
  if (log_dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "memtune-launch-XXXXXX").string();
    MEMTUNE_CHECK(mkdtemp(tmpl.data()) != nullptr, "memtune launch: cannot create a log directory: ",
                  std::strerror(errno));
    log_dir = tmpl;
  }
  // Without --log-dir the console is the user's only view, as with torchrun.
  const bool console = options.tee || options.log_dir.empty();

  int wake[2];
  MEMTUNE_CHECK(pipe2(wake, O_CLOEXEC | O_NONBLOCK) == 0, "memtune launch: pipe: ", std::strerror(errno));
  g_wake_write = wake[1];
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const int world = options.nnodes * options.nproc_per_node;
  std::cerr << str_cat("memtune launch: ", options.nproc_per_node, " worker(s) on node ", options.node_rank, " of ",
                       options.nnodes, " (world size ", world, "), master ", options.master_addr, ":",
                       options.master_port, ", logs in ", log_dir.string(), "\n");
  Group group(options, console);
  for (int restart = 0;; ++restart) {
    group.start(restart, log_dir / str_cat("attempt_", restart));
    int failure = group.watch();
    if (g_signal) {
      int sig = g_signal;
      std::cerr << str_cat("memtune launch: got signal ", sig, "; forwarding it to the workers\n");
      group.stop(sig);
      return 128 + sig;
    }
    if (failure < 0) return 0;
    const Worker& w = group.worker(failure);
    std::string what = str_cat("rank ", w.rank, " (local rank ", w.local_rank, ", pid ", w.pid, ") failed: ",
                               describe_status(w.status));
    if (int s = group.stopped_worker(); s >= 0) {
      const Worker& cause = group.worker(s);
      const double ago = std::chrono::duration<double>(Clock::now() - cause.stopped_at).count();
      what = str_cat("rank ", cause.rank, " (local rank ", cause.local_rank, ", pid ", cause.pid,
                     ") was stopped by signal ", signal_name(cause.stop_signal), " ", static_cast<int64_t>(ago),
                     " s ago and never continued; the other ranks waited for it until they timed out (rank ", w.rank,
                     ": ", describe_status(w.status), ")");
    }
    group.stop(SIGTERM);
    if (restart < options.max_restarts) {
      std::cerr << str_cat("memtune launch: ", what, "; restarting the workers (restart ", restart + 1, " of ",
                           options.max_restarts, ")\n");
      continue;
    }
    std::cerr << str_cat("memtune launch: ", what, "; no restarts left (--max-restarts ", options.max_restarts,
                         "). Last lines of ", w.log_path.string(), ":\n", tail_of(w.log_path, 20));
    return 1;
  }
}

}  // namespace memtune::tools
