#include "runtime/cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "runtime/error.h"

#ifdef MEMTUNE_X86
#include <cpuid.h>
#endif

namespace memtune {

CpuCap parse_cpu_capability(const char* value) {
#ifdef MEMTUNE_X86
  if (value == nullptr || *value == '\0' || std::strcmp(value, "avx512") == 0) return CpuCap::kAvx512;
  if (std::strcmp(value, "avx2") == 0) return CpuCap::kAvx2;
  if (std::strcmp(value, "default") == 0) return CpuCap::kDefault;
  fail("ATEN_CPU_CAPABILITY='", value,
       "' is not a capability memtune knows; ATen's values on x86 are default (no vector kernels), avx2 and "
       "avx512, lower case, and memtune's own kernels follow the same cap. Unset it to use everything the CPU has");
#else
  // memtune's kernels are the portable ones here whatever the value; ATen judges its own
  // (vsx, zvector, sve256, ...).
  (void)value;
  return CpuCap::kDefault;
#endif
}

namespace {

CpuCap cap() {
  static const CpuCap c = parse_cpu_capability(std::getenv("ATEN_CPU_CAPABILITY"));
  return c;
}

}  // namespace

#ifdef MEMTUNE_X86
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && cap() >= CpuCap::kAvx2;
  return has;
}

bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("fma") && cap() >= CpuCap::kAvx2;
  return has;
}

bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f") && cap() >= CpuCap::kAvx512;
  return has;
}

// cpuid leaf 1, ECX bit 29: clang before 15 has no "f16c" for __builtin_cpu_supports. It comes
// with AVX2 on every x86 that has both, so the cap that removes AVX2 removes it too.
bool cpu_has_f16c() {
  static const bool has = [] {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && cap() >= CpuCap::kAvx2;
  }();
  return has;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_fma() { return false; }
bool cpu_has_f16c() { return false; }
bool cpu_has_avx512f() { return false; }
#endif

std::string cpu_kernels_in_use() {
  cap();  // the value is checked on every CPU, not only where a cpu_has_* reaches it
  const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string widest = cpu_has_avx512f() ? "AVX-512" : cpu_has_avx2() && cpu_has_fma() ? "AVX2" : "portable";
  if (forced == nullptr || *forced == '\0') return widest;
  return str_cat(widest, " (ATEN_CPU_CAPABILITY=", forced, ")");
}

}  // namespace memtune
