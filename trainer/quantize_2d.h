#pragma once
// bitsandbytes' quantize_2D<SIGNED> on a sorted 256-entry map, as its 8-bit optimizer kernels
// write it: a 7-step binary search from entry 127, then the nearer of the entries it last
// passed on either side by an fp32 midpoint (NaN ends at code 0). One definition for the CPU
// kernels (trainer/adamw8bit_kernels.cpp, whose fast tables are built from and checked
// against it) and their CUDA twin (trainer/cuda/adamw_bnb_cuda_kernels.cu): free of LibTorch,
// host and device. Its only arithmetic, (a + b) * 0.5f, has no product to fuse into a sum.
#include <cstdint>

#if defined(__CUDACC__)
#define MEMTUNE_HOST_DEVICE __host__ __device__
#else
#define MEMTUNE_HOST_DEVICE
#endif

namespace memtune::trainer {

MEMTUNE_HOST_DEVICE inline uint8_t quantize_2d_search(const float* code, bool is_signed, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
  float val = code[pivot];
  for (int i = 64; i > 0; i >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += i;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= i;
    }
    val = code[pivot];
  }
  if (x > val) {
    const float midpoint = (upper + val) * 0.5f;
    return static_cast<uint8_t>(x > midpoint ? upper_pivot : pivot);
  }
  const float midpoint = (lower + val) * 0.5f;
  return static_cast<uint8_t>(x < midpoint ? lower_pivot : pivot);
}

}  // namespace memtune::trainer
