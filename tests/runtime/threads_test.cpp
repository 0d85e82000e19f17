// The kernels a run's log names: ATen's capability and OpenBLAS's core are what the libraries
// chose, which the environment can force (ATEN_CPU_CAPABILITY, OPENBLAS_CORETYPE), not what the
// CPU could run.
#include <gtest/gtest.h>

#include <strings.h>

#include <cstdlib>
#include <string>

#include "runtime/cpu_features.h"
#include "runtime/error.h"
#include "runtime/threads.h"

namespace {

TEST(Threads, TheLogNamesTheKernelsTheLibrariesChose) {
  const std::string aten = memtune::aten_cpu_capability();
  EXPECT_TRUE(aten == "DEFAULT" || aten == "NO AVX" || aten == "AVX2" || aten == "AVX512" || aten == "VSX" || aten == "ZVECTOR") << aten;
  if (const char* forced = std::getenv("ATEN_CPU_CAPABILITY"); forced && *forced && strcasecmp(forced, "default") != 0)
    EXPECT_EQ(strcasecmp(forced, aten.c_str()), 0) << forced << " asked, " << aten << " reported";

  const std::string core = memtune::blas_core();
  EXPECT_FALSE(core.empty());
  // A core forced by the environment is the one OpenBLAS reports (names as OpenBLAS spells them).
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE"); forced && *forced && core != "not OpenBLAS")
    EXPECT_EQ(strcasecmp(forced, core.c_str()), 0) << forced << " asked, " << core << " reported";

  // The hint names the forced core only where OpenBLAS was made to run AVX2 kernels on an
  // AVX-512 CPU.
  const std::string hint = memtune::blas_core_hint();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!forced || !*forced || !avx512 || strcasecmp(core.c_str(), "SkylakeX") == 0 ||
      strcasecmp(core.c_str(), "Cooperlake") == 0)
    EXPECT_EQ(hint, "");
  else if (strcasecmp(core.c_str(), "Haswell") == 0)
    EXPECT_NE(hint.find(std::string("OPENBLAS_CORETYPE=") + forced), std::string::npos) << hint;

  const std::string line = memtune::configure_threads(0);
  EXPECT_NE(line.find("kernels: ATen " + aten + ", OpenBLAS " + core + ", memtune "), std::string::npos) << line;
}

// OpenBLAS's fallback for a CPU it does not know is replaced by the core of the widest
// instructions the CPU has; a core with AVX2 or wider kernels, and another BLAS, stand.
TEST(Threads, OpenBlasFallbackKernelsAreReplacedByTheCpusWidest) {
  using memtune::blas_core_for;
  EXPECT_EQ(blas_core_for("Prescott", true, true), "SkylakeX");
  EXPECT_EQ(blas_core_for("Prescott", false, true), "Haswell");
  EXPECT_EQ(blas_core_for("Prescott", false, false), "");
  EXPECT_EQ(blas_core_for("Nehalem", true, true), "SkylakeX");
  EXPECT_EQ(blas_core_for("Sandybridge", false, true), "Haswell");
  for (const char* stands : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "not OpenBLAS"})
    EXPECT_EQ(blas_core_for(stands, true, true), "") << stands;
}

// This process went through reexec_with_passive_omp_wait (tests/test_main.cpp): unless the
// environment chose the core, OpenBLAS runs kernels as wide as this CPU's instructions allow,
// whatever it picked by itself, and the log line says when memtune chose them.
TEST(Threads, OpenBlasRunsKernelsAsWideAsThisCpusInstructions) {
  const std::string core = memtune::blas_core();
  if (core == "not OpenBLAS") GTEST_SKIP() << "another BLAS";
  const char* picked = std::getenv("MEMTUNE_OPENBLAS_PICKED");
  if (!picked && std::getenv("OPENBLAS_CORETYPE")) GTEST_SKIP() << "OPENBLAS_CORETYPE set outside memtune";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    EXPECT_EQ(memtune::blas_core_for_cpu(), "") << "OpenBLAS runs " << core;
  const std::string line = memtune::configure_threads(0);
  if (picked)
    EXPECT_NE(line.find(std::string("set by memtune: OpenBLAS picked its ") + picked), std::string::npos) << line;
  else
    EXPECT_EQ(line.find("set by memtune"), std::string::npos) << line;
}

// ATEN_CPU_CAPABILITY's values as ATen 1.13 and 2.x compare them (strcmp, lower case); unset
// or empty is no cap. ATen ignores anything else with a warning; memtune refuses it by name.
TEST(Threads, AtenCpuCapabilityCapsMemtunesKernelsAndAnUnknownValueIsRefused) {
  using memtune::CpuCap;
  EXPECT_EQ(memtune::parse_cpu_capability(nullptr), CpuCap::kAvx512);
  EXPECT_EQ(memtune::parse_cpu_capability(""), CpuCap::kAvx512);
  EXPECT_EQ(memtune::parse_cpu_capability("avx512"), CpuCap::kAvx512);
  EXPECT_EQ(memtune::parse_cpu_capability("avx2"), CpuCap::kAvx2);
  EXPECT_EQ(memtune::parse_cpu_capability("default"), CpuCap::kDefault);
  for (const char* bad : {"AVX2", "avx", "sse4", " avx2"}) {
    try {
      memtune::parse_cpu_capability(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const memtune::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("ATEN_CPU_CAPABILITY='") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
  // This process's cap: what the CPU has, at most what the variable allows.
  const memtune::CpuCap cap = memtune::parse_cpu_capability(std::getenv("ATEN_CPU_CAPABILITY"));
  EXPECT_EQ(memtune::cpu_has_avx512f(), __builtin_cpu_supports("avx512f") && cap == CpuCap::kAvx512);
  EXPECT_EQ(memtune::cpu_has_avx2(), __builtin_cpu_supports("avx2") && cap != CpuCap::kDefault);
}

}  // namespace
