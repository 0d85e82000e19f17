#include "runtime/cuda_info.h"

namespace memtune {

std::string cuda_version_string(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

std::string describe(const CudaInfo& info) {
  if (!info.compiled) return "no CUDA (built without MEMTUNE_CUDA)";
  std::string s = "CUDA " + cuda_version_string(info.toolkit_version) + " (runtime ";
  s += info.runtime_version > 0 ? cuda_version_string(info.runtime_version) : "unknown";
  s += info.driver_version > 0 ? ", driver " + cuda_version_string(info.driver_version)
                               : std::string(", no driver");
  s += "), " + std::to_string(info.device_count) +
       (info.device_count == 1 ? " device" : " devices");
  return s;
}

// The CPU twin of runtime/cuda/cuda_probe.cpp.
#ifndef MEMTUNE_CUDA
CudaInfo cuda_info() { return CudaInfo{}; }
int cuda_compute_capability(int) { return 0; }
#endif

}  // namespace memtune
