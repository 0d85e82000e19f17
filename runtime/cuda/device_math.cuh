#pragma once
// Device helpers shared by memtune's CUDA kernels (.cu files only): the element types'
// conversions to and from fp32 (round to nearest even), and warp and block reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "runtime/cuda/device_types.h"

namespace memtune::cuda_math {

template <class T>
struct Convert;
template <>
struct Convert<float> {
  static __device__ __forceinline__ float to(float x) { return x; }
  static __device__ __forceinline__ float from(float x) { return x; }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ __half to(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float from(__half x) { return __half2float(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 to(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float from(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// x rounded to T and read back: what a tensor of dtype T holds after storing x.
template <class T>
__device__ __forceinline__ float round_to(float x) {
  return Convert<T>::from(Convert<T>::to(x));
}

// Calls f(T{}) with T the element type of `t`: float, __half or __nv_bfloat16.
template <class F>
void with_type(DType t, F&& f) {
  switch (t) {
    case DType::kFloat: f(float{}); break;
    case DType::kHalf: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the CTA (blockDim.x a multiple of 32, at most 1024), returned to every
// thread. `scratch` holds 33 floats of shared memory; every thread must call, and the
// scratch may be reused as soon as the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    float w = lane < warps ? scratch[lane] : 0.0f;
    w = warp_sum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  const float total = scratch[32];
  __syncthreads();
  return total;
}

}  // namespace memtune::cuda_math
