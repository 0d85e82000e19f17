#pragma once
// What the CUDA side of this build sees: whether it was compiled in, the CUDA versions,
// and the devices. One line of it goes into `memtune --version`.
// Defined by runtime/cuda/cuda_probe.cpp in CUDA builds (MEMTUNE_CUDA) and by
// runtime/cuda_info.cpp otherwise.
#include <string>

namespace memtune {

struct CudaInfo {
  bool compiled = false;      // memtune was built with MEMTUNE_CUDA
  int toolkit_version = 0;    // CUDA the sources were compiled with (CUDA_VERSION: 12040 = 12.4)
  int runtime_version = 0;    // cudaRuntimeGetVersion() of the loaded runtime; 0 when unknown
  int driver_version = 0;     // cudaDriverGetVersion(); 0 when no driver is installed
  int device_count = 0;       // visible CUDA devices; 0 without a GPU
};

CudaInfo cuda_info();

// "CUDA 12.4 (runtime 12.4, driver 12.8), 2 devices", "CUDA 12.4 (runtime 12.4, no
// driver), 0 devices", or "no CUDA (built without MEMTUNE_CUDA)".
std::string describe(const CudaInfo& info);

// Compute capability of CUDA device `index` as 10 * major + minor (75: Turing, 80: A100,
// 90: H100); 0 without CUDA or without that device.
int cuda_compute_capability(int index);

// Whether a device of that capability computes bf16 natively (tensor cores from sm_80 on;
// sm_7x emulates it, far slower than fp16).
inline bool has_native_bf16(int compute_capability) { return compute_capability >= 80; }

// "12.4" from CUDA's integer encoding 1000 * major + 10 * minor.
std::string cuda_version_string(int version);

}  // namespace memtune
