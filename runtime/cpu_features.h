#pragma once
// What the CPU offers memtune's hand-written kernels (runtime/nf4_kernels.h,
// models/layers/cpu_vec.h, trainer/optim_kernels.h, trainer/adamw8bit_kernels.h), asked once
// per process. Each kernel file carries its functions' target attributes and builds with the
// project's flags, so its dispatcher asks here before it calls a wider path.

// Where the x86 kernels exist at all.
#if defined(__x86_64__) || defined(__i386__)
#define MEMTUNE_X86 1
#endif

namespace memtune {

bool cpu_has_avx2();
bool cpu_has_fma();
bool cpu_has_f16c();  // fp32 <-> fp16 conversions (vcvtps2ph)
bool cpu_has_avx512f();  // 512-bit registers and their fused multiply-add

}  // namespace memtune
