#include "runtime/threads.h"

#include <sched.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <dlfcn.h>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#include "runtime/cpu_features.h"
#include "runtime/error.h"

namespace memtune {

namespace {

// What the log says when the re-exec chose OpenBLAS's core (reexec_with_passive_omp_wait).
std::string blas_core_note() {
  const char* picked = std::getenv("MEMTUNE_OPENBLAS_PICKED");
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  if (picked == nullptr || core == nullptr) return "";
  return str_cat(", OPENBLAS_CORETYPE=", core, " (set by memtune: OpenBLAS picked its ", picked,
                 " kernels, which lack the AVX2 this CPU has)");
}

// What OpenBLAS's SkylakeX kernels need: AVX-512 F, BW, DQ, VL and CD.
bool cpu_runs_avx512_blas() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512cd");
}

// OpenBLAS's cores with AVX-512 kernels (blas_core()'s spelling, any case).
bool blas_core_is_avx512(const std::string& core) {
  for (const char* wide : {"skylakex", "cooperlake", "sapphirerapids"})
    if (strcasecmp(core.c_str(), wide) == 0) return true;
  return false;
}

}  // namespace

void reexec_with_passive_omp_wait(char** argv) {
  if (std::getenv("MEMTUNE_NO_REEXEC") != nullptr) return;
  bool changed = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    changed = true;
  }
  // OpenBLAS's pthreads spin on sched_yield for 2^28 cycles (about 0.1 s) after each call
  // before they sleep, taking the core from LibTorch's thread that runs the element-wise
  // work between two matrix products; 2^4 makes them sleep at once. Ignored by other BLAS.
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") == nullptr) {
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
    changed = true;
  }
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    if (const std::string core = blas_core_for_cpu(); !core.empty()) {
      setenv("MEMTUNE_OPENBLAS_PICKED", blas_core().c_str(), 1);  // for the log line
      setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
      changed = true;
    }
  }
  if (!changed) return;
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on with the slower default rather than stop.
}

int affinity_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string configure_threads(int requested) {
  int n = 0;
  std::string source;
  if (requested > 0) {
    n = requested;
    source = "runtime.num_threads";
  } else if (const char* env = std::getenv("OMP_NUM_THREADS"); env && *env) {
    n = std::atoi(env);
    MEMTUNE_CHECK(n > 0, "OMP_NUM_THREADS='", env, "' is not a positive integer");
    source = "OMP_NUM_THREADS";
  } else {
    n = affinity_cpu_count();
    source = "CPU affinity";
  }
  at::set_num_threads(n);
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  const char* blas_timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  return str_cat("threads: ", n, " intra-op (from ", source, "), OpenMP wait policy ",
                 wait ? wait : "default (spin)", ", OpenBLAS thread timeout 2^",
                 blas_timeout ? blas_timeout : "28 (default)", " cycles", blas_core_note(), "; kernels: ATen ",
                 aten_cpu_capability(), ", OpenBLAS ", blas_core(), ", memtune ", cpu_kernels_in_use());
}

std::string aten_cpu_capability() {
  // ATen's build configuration ends with the capability it chose at run time.
  const std::string config = at::show_config(), key = "CPU capability usage: ";
  const auto at = config.find(key);
  if (at == std::string::npos) return "unknown";
  const auto begin = at + key.size();
  return config.substr(begin, config.find('\n', begin) - begin);
}

std::string blas_core_hint() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced == nullptr || *forced == '\0') return "";
  const std::string core = blas_core();
  if (!cpu_runs_avx512_blas() || core == "not OpenBLAS" || blas_core_is_avx512(core)) return "";
  // How much the AVX-512 kernels gain depends on the core: 1.9x on one thread of the AVX-512
  // machine of 2026-11-24, 1.83x on two threads of a Zen 5 (family 26 model 2) of 2026-11-26
  // (381 against 207 GFLOP/s; memtune's training 1.3-1.6x), nothing on a Zen 4 (family 25
  // model 17) of 2026-11-26, 108 against 112 GFLOP/s on one thread, 209 against 216 on two
  // (docs/performance.md).
  return str_cat("OPENBLAS_CORETYPE=", forced, " makes OpenBLAS run its ", core,
                 " (AVX2) kernels on this CPU, which has AVX-512; on some such CPUs its SkylakeX kernels multiply "
                 "fp32 matrices up to 1.9x as fast, on others no faster: bench/bench_matmul_peak with and without "
                 "the variable tells for this one. Unset it, or set OPENBLAS_CORETYPE=SkylakeX, to use them");
}

std::string blas_core_for(const std::string& picked, bool avx512, bool avx2_fma) {
  if (picked == "not OpenBLAS" || blas_core_is_avx512(picked) || strcasecmp(picked.c_str(), "haswell") == 0 ||
      strcasecmp(picked.c_str(), "zen") == 0)
    return "";
  if (avx512) return "SkylakeX";
  if (avx2_fma) return "Haswell";
  return "";
}

std::string blas_core_for_cpu() {
  return blas_core_for(blas_core(), cpu_runs_avx512_blas(),
                       __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

std::string blas_core() {
  using CoreName = char* (*)();
  const auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return fn ? fn() : "not OpenBLAS";
}

}  // namespace memtune
