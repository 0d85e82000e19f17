// The chunked loss's softmax pass on CUDA (cross_entropy_cuda_kernels.h): a CTA per row,
// one pass for the max and its first index, one that writes exp(e - max) and sums it.
#include "models/layers/cuda/cross_entropy_cuda_kernels.h"

#include <algorithm>
#include <cstdint>

#include "runtime/cuda/device_math.cuh"

namespace memtune::models::cross_entropy_cuda {
namespace {

using cuda_math::block_sum;

constexpr int kThreads = 512;

// (v, i) comes before (best, best_i) in ATen's max: larger, a NaN before any number, and
// among equals (NaNs included) the smaller index.
__device__ __forceinline__ bool before(float v, int64_t i, float best, int64_t best_i) {
  const bool v_nan = isnan(v), b_nan = isnan(best);
  if (v_nan || b_nan) return v_nan && (!b_nan || i < best_i);
  return v > best || (v == best && i < best_i);
}

__device__ __forceinline__ void take(float v, int64_t i, float& best, int64_t& best_i) {
  if (before(v, i, best, best_i)) {
    best = v;
    best_i = i;
  }
}

// The CTA's first maximum, returned to every thread; scratch_v / scratch_i hold 33 entries.
__device__ void block_first_max(float& best, int64_t& best_i, float* scratch_v, int64_t* scratch_i) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1)
    take(__shfl_xor_sync(0xffffffffu, best, offset), __shfl_xor_sync(0xffffffffu, best_i, offset), best, best_i);
  if (lane == 0) {
    scratch_v[warp] = best;
    scratch_i[warp] = best_i;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    float v = lane < warps ? scratch_v[lane] : -INFINITY;
    int64_t i = lane < warps ? scratch_i[lane] : INT64_MAX;
    for (int offset = 16; offset > 0; offset >>= 1)
      take(__shfl_xor_sync(0xffffffffu, v, offset), __shfl_xor_sync(0xffffffffu, i, offset), v, i);
    if (lane == 0) {
      scratch_v[32] = v;
      scratch_i[32] = i;
    }
  }
  __syncthreads();
  best = scratch_v[32];
  best_i = scratch_i[32];
  __syncthreads();
}

__global__ void row_softmax_parts_kernel(float* __restrict__ e, int64_t n, int64_t V, bool vec4,
                                         float* __restrict__ m_out, float* __restrict__ s_out,
                                         int64_t* __restrict__ first_max) {
  __shared__ float scratch_v[33];
  __shared__ int64_t scratch_i[33];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    float* row = e + r * V;
    float best = -INFINITY;
    int64_t best_i = INT64_MAX;
    if (vec4) {
      const float4* row4 = reinterpret_cast<const float4*>(row);
      for (int64_t j = threadIdx.x; j < V / 4; j += blockDim.x) {
        const float4 q = row4[j];
        take(q.x, 4 * j, best, best_i);
        take(q.y, 4 * j + 1, best, best_i);
        take(q.z, 4 * j + 2, best, best_i);
        take(q.w, 4 * j + 3, best, best_i);
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) take(row[j], j, best, best_i);
    }
    block_first_max(best, best_i, scratch_v, scratch_i);
    const float m = best;
    float sum = 0.0f;
    if (vec4) {
      float4* row4 = reinterpret_cast<float4*>(row);
      for (int64_t j = threadIdx.x; j < V / 4; j += blockDim.x) {
        float4 q = row4[j];
        q.x = expf(__fsub_rn(q.x, m));
        q.y = expf(__fsub_rn(q.y, m));
        q.z = expf(__fsub_rn(q.z, m));
        q.w = expf(__fsub_rn(q.w, m));
        row4[j] = q;
        sum = __fadd_rn(sum, __fadd_rn(__fadd_rn(q.x, q.y), __fadd_rn(q.z, q.w)));
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = expf(__fsub_rn(row[j], m));
        row[j] = v;
        sum = __fadd_rn(sum, v);
      }
    }
    sum = block_sum(sum, scratch_v);
    if (threadIdx.x == 0) {
      m_out[r] = m;
      s_out[r] = sum;
      first_max[r] = best_i;
    }
  }
}

}  // namespace

cudaError_t row_softmax_parts(float* e, int64_t n, int64_t V, float* m, float* s, int64_t* first_max,
                              cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (V <= 0) return cudaErrorInvalidValue;
  const bool vec4 = V % 4 == 0 && reinterpret_cast<uintptr_t>(e) % 16 == 0;
  const int64_t grid = std::clamp<int64_t>(n, 1, 65535);
  row_softmax_parts_kernel<<<grid, kThreads, 0, stream>>>(e, n, V, vec4, m, s, first_max);
  return cudaGetLastError();
}

}  // namespace memtune::models::cross_entropy_cuda
