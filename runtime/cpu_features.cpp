#include "runtime/cpu_features.h"

#ifdef MEMTUNE_X86
#include <cpuid.h>
#endif

namespace memtune {

#ifdef MEMTUNE_X86
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// cpuid leaf 1, ECX bit 29: clang before 15 has no "f16c" for __builtin_cpu_supports.
bool cpu_has_f16c() {
  static const bool has = [] {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  }();
  return has;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_fma() { return false; }
bool cpu_has_f16c() { return false; }
bool cpu_has_avx512f() { return false; }
#endif

}  // namespace memtune
