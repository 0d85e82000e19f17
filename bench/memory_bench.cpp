// Overhead of the CPU budget allocator against c10's default CPU allocator, measured in the
// same run. Installing an allocator is process-wide, so each allocator runs in its own
// child process (this program re-executed with --phase default|budget); the parent prints
// the two side by side.
//
//   bench_memory_bench [--small N] [--steps N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "runtime/cpu_budget_allocator.h"
#include "runtime/threads.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the whole process (all threads), in seconds. On a loaded machine the wall
// clock also counts time spent waiting for a core; CPU time counts only the work.
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Timing {
  double wall_s = 1e30, cpu_s = 1e30;
};

// Best of `reps` runs of fn(): wall and process CPU seconds, each its own minimum.
template <class F>
Timing best_of(int reps, F&& fn) {
  Timing best;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    const double c0 = process_cpu_s();
    fn();
    best.cpu_s = std::min(best.cpu_s, process_cpu_s() - c0);
    best.wall_s = std::min(best.wall_s, seconds_since(t0));
  }
  return best;
}

int run_phase(const std::string& phase, int64_t small_n, int steps) {
  memtune::configure_threads(0);
  if (phase == "budget") {
    memtune::install_cpu_budget_allocator();
    memtune::set_cpu_memory_limit(int64_t{64} << 30);  // a limit, so its check runs too
  }
  // Through ATen: at::empty of 16 floats (dispatch + TensorImpl + storage).
  const Timing empty = best_of(3, [&] {
    for (int64_t i = 0; i < small_n; ++i) {
      at::Tensor t = at::empty({16}, at::kFloat);
    }
  });
  // A training-like step: 8 layers of (256 x 1024) @ (1024 x 1024) + relu, forward and
  //    backward, weights with gradients.
  at::manual_seed(0);
  std::vector<at::Tensor> ws;
  for (int l = 0; l < 8; ++l) ws.push_back((at::randn({1024, 1024}) * 0.03).requires_grad_(true));
  const at::Tensor x0 = at::randn({256, 1024});
  auto step = [&] {
    at::Tensor x = x0;
    for (const auto& w : ws) x = at::relu(at::matmul(x, w));
    x.sum().backward();
    for (auto& w : ws) w.mutable_grad().reset();
  };
  step();  // warm-up
  std::vector<double> wall, cpu;
  for (int s = 0; s < steps; ++s) {
    const Timing t = best_of(1, step);
    wall.push_back(t.wall_s);
    cpu.push_back(t.cpu_s);
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());

  std::printf("empty_ns %.2f\n", empty.wall_s / small_n * 1e9);
  std::printf("empty_cpu_ns %.2f\n", empty.cpu_s / small_n * 1e9);
  std::printf("step_ms %.3f\n", wall[wall.size() / 2] * 1e3);
  std::printf("step_min_ms %.3f\n", wall.front() * 1e3);
  std::printf("step_cpu_ms %.3f\n", cpu[cpu.size() / 2] * 1e3);
  std::printf("threads %d\n", at::get_num_threads());
  if (phase == "budget") {
    const auto c = memtune::cpu_allocator_counters();
    std::printf("counted_allocations %lld\n", static_cast<long long>(c.total_allocations));
    std::printf("peak_mib %.1f\n", static_cast<double>(c.peak) / (1 << 20));
  }
  return 0;
}

// Allocate + free 64 bytes `n` times with `alloc` on each of `threads` threads at once:
// wall seconds until the slowest thread ends, and process CPU seconds.
Timing raw_run(c10::Allocator* alloc, int64_t n, int threads) {
  const auto t0 = Clock::now();
  const double c0 = process_cpu_s();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int64_t i = 0; i < n; ++i) {
        c10::DataPtr p = alloc->allocate(64);
        if (p.get() == nullptr) std::abort();
      }
    });
  for (auto& th : pool) th.join();
  return {seconds_since(t0), process_cpu_s() - c0};
}

std::map<std::string, double> run_child(const std::string& self, const std::string& phase,
                                        int64_t small_n, int steps) {
  const std::string cmd = self + " --phase " + phase + " --small " + std::to_string(small_n) +
                          " --steps " + std::to_string(steps);
  std::map<std::string, double> out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char key[64];
  double value = 0;
  while (std::fscanf(p, "%63s %lf", key, &value) == 2) out[key] = value;
  if (pclose(p) != 0) std::fprintf(stderr, "phase %s failed\n", phase.c_str());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string phase;
  int64_t small_n = 1000000;
  int steps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--phase")) phase = argv[i + 1];
    else if (!std::strcmp(argv[i], "--small")) small_n = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  }
  if (!phase.empty()) return run_phase(phase, small_n, steps);

  setenv("OMP_WAIT_POLICY", "passive", 0);  // as memtune itself runs (runtime/threads.h)
  char self_buf[4096] = {};
  if (readlink("/proc/self/exe", self_buf, sizeof self_buf - 1) <= 0) return 1;
  const std::string self = self_buf;
  // The allocators alone need no installation: both objects are called directly, in
  // alternating rounds within this process, so load on the machine hits both alike.
  c10::Allocator* def = c10::GetDefaultCPUAllocator();
  memtune::install_cpu_budget_allocator();
  memtune::set_cpu_memory_limit(int64_t{64} << 30);
  c10::Allocator* bud = c10::GetCPUAllocator();
  const int cores = memtune::affinity_cpu_count();
  Timing raw1[2], rawn[2];
  for (int round = 0; round < 7; ++round) {
    for (int k = 0; k < 2; ++k) {
      c10::Allocator* a = k == 0 ? def : bud;
      const Timing t1 = raw_run(a, small_n, 1), tn = raw_run(a, small_n, cores);
      raw1[k] = {std::min(raw1[k].wall_s, t1.wall_s), std::min(raw1[k].cpu_s, t1.cpu_s)};
      rawn[k] = {std::min(rawn[k].wall_s, tn.wall_s), std::min(rawn[k].cpu_s, tn.cpu_s)};
    }
  }

  // Interleave, twice each, so drift in machine load hits both allocators alike.
  std::map<std::string, std::vector<double>> d, b;
  for (int round = 0; round < 2; ++round) {
    for (const auto& [k, v] : run_child(self, "default", small_n, steps)) d[k].push_back(v);
    for (const auto& [k, v] : run_child(self, "budget", small_n, steps)) b[k].push_back(v);
  }
  auto best = [](const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); };
  std::printf("CPU budget allocator vs c10 default CPU allocator (allocator rows: best of 7 alternating rounds in one process; ATen rows: best of 2 child processes per allocator, %d intra-op threads)\n",
              static_cast<int>(best(d["threads"])));
  std::printf("%-50s %12s %12s %9s\n", "measure", "default", "budget", "ratio");
  const struct {
    const char* key;
    const char* label;
  } rows[] = {{"empty_ns", "at::empty({16}) + free: wall (ns)"},
              {"empty_cpu_ns", "at::empty({16}) + free: CPU (ns)"},
              {"step_ms", "8-layer matmul fwd+bwd step: wall, median (ms)"},
              {"step_min_ms", "8-layer matmul fwd+bwd step: wall, fastest (ms)"},
              {"step_cpu_ms", "8-layer matmul fwd+bwd step: CPU, median (ms)"}};
  auto row = [](const std::string& label, double x, double y) {
    std::printf("%-50s %12.2f %12.2f %8.3fx\n", label.c_str(), x, y, x > 0 ? y / x : 0.0);
  };
  const double per_op = 1e9 / static_cast<double>(small_n);
  row("allocate+free 64 B, allocator only: wall (ns)", raw1[0].wall_s * per_op, raw1[1].wall_s * per_op);
  row("allocate+free 64 B, allocator only: CPU (ns)", raw1[0].cpu_s * per_op, raw1[1].cpu_s * per_op);
  const std::string tag = "same, " + std::to_string(cores) + " threads at once";
  row(tag + ": wall (ns/op)", rawn[0].wall_s * per_op, rawn[1].wall_s * per_op);
  row(tag + ": CPU (ns/op/thread)", rawn[0].cpu_s * per_op / cores, rawn[1].cpu_s * per_op / cores);
  for (const auto& r : rows) row(r.label, best(d[r.key]), best(b[r.key]));
  std::printf("(%lld small allocations per run; budget phase counted %.0f allocations, peak %.1f MiB)\n",
              static_cast<long long>(small_n), best(b["counted_allocations"]), best(b["peak_mib"]));
  return 0;
}
