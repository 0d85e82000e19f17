// The memory supervisor's own cost per training step, without the step's work: what the
// trainer adds around every step (Supervisor::run_step over the step's stages, the memory
// samples at phase boundaries, observe_peak with its thresholds, taking the events), with
// stages that do nothing else (8 samples per step as micro-batch 4 x 2). bench/oom_recovery.py sets it against a measured training step. Prints
// one JSON line: {"per_step_us": median of rounds, "rounds": N, "steps_per_round": M}.
//
//   bench_supervisor_overhead [--steps-per-round M] [--rounds N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/memory.h"
#include "runtime/supervisor.h"
#include "runtime/threads.h"

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  memtune::configure_threads(0);
  int64_t steps = 20000, rounds = 9;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--steps-per-round") == 0) steps = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoll(argv[i + 1]);
  }
  memtune::MemoryBackend& mem = memtune::memory_backend(c10::Device(c10::DeviceType::CPU));
  memtune::SupervisorOptions o;
  o.samples_per_step = 8;
  o.micro_batch = 4;
  memtune::Supervisor supervisor(o);
  memtune::StepStages stages;
  int64_t sink = 0;
  // The trainer's monitoring inside a step: per micro-batch a peak reset and a sample after
  // the forward and after the backward; once more around the optimizer's checks.
  auto sample = [&] {
    mem.reset_peak();
    sink += mem.stats().peak & 1;
  };
  stages.compute = [&](int64_t micro_batch) {
    for (int64_t i = 0; i < o.samples_per_step; i += micro_batch) {
      sample();
      sample();
    }
  };
  stages.prepare = [&] { sample(); };
  stages.apply = [&] { ++sink; };
  stages.cleanup = [] {};
  const int64_t limit = int64_t{1} << 34;  // a limit, so the thresholds are evaluated
  std::vector<double> per_step_us;
  int64_t step = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i, ++step) {
      supervisor.run_step(step, stages);
      const memtune::MemoryStats ms = mem.stats();
      supervisor.observe_peak(step, static_cast<double>(ms.peak) / static_cast<double>(limit),
                              [&] { mem.release_cached(); }, [] { return std::string(); });
      sink += static_cast<int64_t>(supervisor.take_events().size());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    per_step_us.push_back(1e6 * s / static_cast<double>(steps));
  }
  std::sort(per_step_us.begin(), per_step_us.end());
  std::printf("{\"per_step_us\": %.3f, \"rounds\": %lld, \"steps_per_round\": %lld, \"sink\": %lld}\n",
              per_step_us[per_step_us.size() / 2], static_cast<long long>(rounds), static_cast<long long>(steps),
              static_cast<long long>(sink % 7));
  return 0;
}
