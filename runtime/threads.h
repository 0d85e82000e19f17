#pragma once
// CPU threading: how many intra-op threads LibTorch uses, and how its OpenMP threads wait.
#include <string>

namespace memtune {

// OpenMP reads OMP_WAIT_POLICY once, when the library loads, so it cannot be changed from
// main(). With the default spin-wait, LibTorch's OpenMP threads and OpenBLAS's pthreads
// fight over the cores and a training step runs about 2x slower. OpenBLAS reads
// OPENBLAS_THREAD_TIMEOUT the same way: its threads yield-spin for 2^28 cycles after each
// product unless told otherwise (10-15 % of a LoRA step measured on 2 cores). When either
// variable is unset, this sets it (passive, 4) and re-executes the program (argv
// unchanged); when both are set (by the user or by the re-exec), it returns. It also sets
// OPENBLAS_CORETYPE, when unset, to blas_core_for_cpu()'s core where that is not empty. Call
// first thing in main().
void reexec_with_passive_omp_wait(char** argv);

// Sets LibTorch's intra-op threads: `requested` when > 0, else OMP_NUM_THREADS when set,
// else the number of CPUs in this process's affinity mask. Returns a line for the log, which
// names the kernels of ATen, OpenBLAS and memtune; it throws on an ATEN_CPU_CAPABILITY that
// memtune does not know (runtime/cpu_features.h), so a run stops before its first step.
std::string configure_threads(int requested);

int affinity_cpu_count();

// The instructions this process's kernels use: ATen's run-time CPU capability ("AVX2",
// "AVX512", "DEFAULT") and OpenBLAS's kernel core ("Haswell", "SkylakeX", ...; "not OpenBLAS"
// for another BLAS). A CPU with AVX-512 runs AVX2 kernels where either library picks them
// (or OPENBLAS_CORETYPE / ATEN_CPU_CAPABILITY say so).
std::string aten_cpu_capability();
std::string blas_core();

// OpenBLAS picks its kernels by the CPU's family and model, and OpenBLAS 0.3.21 (Debian 12)
// knows only the CPUs before its release: on a newer one it falls back to its Prescott (SSE3)
// kernels. Measured on a 2-vCPU Intel Xeon of family 6 model 207 (2026-11-29), fp32 products
// ran at 74 GFLOP/s with them against 343 with SkylakeX's (bench_matmul_peak). When OpenBLAS
// picked a core without AVX2 on a CPU that has it, this names the core of the widest
// instructions the CPU has (SkylakeX: AVX-512 F, BW, DQ, VL and CD; else Haswell: AVX2 and
// FMA); otherwise (OpenBLAS's pick stands, or another BLAS) it is empty.
std::string blas_core_for_cpu();
// The same for OpenBLAS's pick `picked` (blas_core()'s spelling) on a CPU with these instructions.
std::string blas_core_for(const std::string& picked, bool avx512, bool avx2_fma);

// A line for the log when OpenBLAS runs AVX2 kernels on a CPU with AVX-512 because
// OPENBLAS_CORETYPE says so (the user's setting stands; its AVX-512 kernels multiply fp32
// matrices about twice as fast); empty otherwise.
std::string blas_core_hint();

}  // namespace memtune
