// CUDA builds only: what the CUDA runtime and LibTorch's CUDA side report.
#include <c10/cuda/CUDAFunctions.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "runtime/cuda_info.h"

namespace memtune {

CudaInfo cuda_info() {
  CudaInfo info;
  info.compiled = true;
  info.toolkit_version = CUDA_VERSION;
  // Both calls answer without a device; a missing driver leaves the driver version 0.
  if (cudaRuntimeGetVersion(&info.runtime_version) != cudaSuccess) info.runtime_version = 0;
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  // c10's count: 0 (not an error) without a driver or a GPU, and honours
  // CUDA_VISIBLE_DEVICES like every tensor placement does.
  info.device_count = static_cast<int>(c10::cuda::device_count());
  return info;
}

int cuda_compute_capability(int index) {
  int major = 0, minor = 0;
  if (index < 0 || index >= static_cast<int>(c10::cuda::device_count())) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) != cudaSuccess)
    return 0;
  return 10 * major + minor;
}

}  // namespace memtune
