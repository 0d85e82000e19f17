// This machine's fp32 matrix-multiply peak as memtune sees it: LibTorch's at::mm with
// memtune's thread set-up (passive OpenMP wait, OpenBLAS thread timeout, intra-op threads
// from the CPU affinity). The yardstick for model-FLOPs utilisation in
// bench/train_vs_peer.py. Prints one JSON line:
//   {"peak_gflops": best, "shapes": [{"m":..,"k":..,"n":..,"gflops":..}, ...], "threads": N,
//    "aten_cpu_capability": "AVX2", "blas_core": "Haswell", "memtune_kernels": "AVX-512"}
// The last three name the instructions the run's kernels use: ATen's vectorized kernels pick a
// capability at run time, OpenBLAS its core's kernels, and memtune's own the widest the CPU has
// under ATEN_CPU_CAPABILITY's cap, so a CPU's AVX-512 need not be used.
//
//   bench_matmul_peak [--seconds S]   (time spent per shape, default 1)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/cpu_features.h"
#include "runtime/threads.h"

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  memtune::configure_threads(0);
  double seconds = 1.0;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--seconds") == 0) seconds = std::atof(argv[i + 1]);

  struct Shape {
    int64_t m, k, n;
  };
  // Square products give the peak; the others are the shapes of the benchmark's models.
  const Shape shapes[] = {{2048, 2048, 2048}, {1024, 256, 688}, {512, 768, 2048}, {512, 768, 32000}};
  double best = 0;
  std::string rows;
  for (const Shape& s : shapes) {
    at::Tensor a = at::randn({s.m, s.k}), b = at::randn({s.k, s.n}), c = at::empty({s.m, s.n});
    for (int i = 0; i < 3; ++i) at::mm_out(c, a, b);  // warm-up: packing buffers, threads
    const double flop = 2.0 * s.m * s.k * s.n;
    double shape_best = 0;
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
      const auto t0 = std::chrono::steady_clock::now();
      at::mm_out(c, a, b);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      shape_best = std::max(shape_best, flop / dt / 1e9);
    }
    best = std::max(best, shape_best);
    char row[160];
    std::snprintf(row, sizeof row, "%s{\"m\": %lld, \"k\": %lld, \"n\": %lld, \"gflops\": %.1f}",
                  rows.empty() ? "" : ", ", static_cast<long long>(s.m), static_cast<long long>(s.k),
                  static_cast<long long>(s.n), shape_best);
    rows += row;
  }
  std::printf("{\"peak_gflops\": %.1f, \"threads\": %d, \"aten_cpu_capability\": \"%s\", \"blas_core\": \"%s\", "
              "\"memtune_kernels\": \"%s\", \"shapes\": [%s]}\n",
              best, at::get_num_threads(), memtune::aten_cpu_capability().c_str(), memtune::blas_core().c_str(),
              memtune::cpu_kernels_in_use().c_str(), rows.c_str());
  return 0;
}
