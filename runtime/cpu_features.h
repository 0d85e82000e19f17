#pragma once
// What memtune's hand-written kernels may use (runtime/nf4_kernels.h, models/layers/cpu_vec.h,
// trainer/optim_kernels.h, trainer/adamw8bit_kernels.h), asked once per process. Each kernel
// file carries its functions' target attributes and builds with the project's flags, so its
// dispatcher asks here before it calls a wider path.
//
// The answer is what the CPU has, capped by ATEN_CPU_CAPABILITY when it is set: the variable
// that caps ATen's own kernels ("default", "avx2", "avx512") caps memtune's the same way, so
// that one setting runs a whole step on the instructions of a narrower machine (an AVX2-only
// EPYC, say). ATen ignores a value it does not know, with a warning; memtune refuses it. Off
// x86 memtune has portable kernels only and leaves the value to ATen.
#include <string>

// Where the x86 kernels exist at all.
#if defined(__x86_64__) || defined(__i386__)
#define MEMTUNE_X86 1
#endif

namespace memtune {

bool cpu_has_avx2();
bool cpu_has_fma();
bool cpu_has_f16c();  // fp32 <-> fp16 conversions (vcvtps2ph)
bool cpu_has_avx512f();  // 512-bit registers and their fused multiply-add

// The widest kernels the cap allows, from ATEN_CPU_CAPABILITY's value (null or empty: no cap).
enum class CpuCap { kDefault, kAvx2, kAvx512 };
CpuCap parse_cpu_capability(const char* value);  // throws UserError on an unknown value

// For the log: "AVX-512", "AVX2" or "portable", and "(ATEN_CPU_CAPABILITY=...)" when capped.
// Throws what parse_cpu_capability throws, so a run that calls it first fails at start.
std::string cpu_kernels_in_use();

}  // namespace memtune
