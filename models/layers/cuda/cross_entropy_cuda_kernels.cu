// The chunked loss's softmax pass on CUDA (cross_entropy_cuda_kernels.h): a CTA per row,
// one pass for the max and its first index, one that sums exp(x - max) (writing it over fp32
// logits), and for bf16 logits one that writes d loss / d logits over them.
#include "models/layers/cuda/cross_entropy_cuda_kernels.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

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

// Four adjacent elements as fp32 (a bf16 is the high half of an fp32: exact), and stored back.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = reinterpret_cast<const uint32_t&>(lo);
  u.y = reinterpret_cast<const uint32_t&>(hi);
  *reinterpret_cast<uint2*>(p) = u;
}

// A CTA per row of x (n, V), T float or bf16, read as fp32: the row's max and its first index,
// then the sum of exp(x - max) over the row, each thread's terms in the same groups and order
// whatever T (so a bf16 row and its fp32 copy give the same bits). Then by kMode:
//   kExpInPlace (fp32): the pass that sums also writes exp(x - max) over x;
//   kStatsOnly: x is only read;
//   kGradInPlace: a third pass writes d loss / d logits over x, rounded to T:
//     exp(x - max) * (1 / sum), less 1 at the row's target, each step rounded in fp32 as the
//     ATen ops that form it from kExpInPlace's output do (reciprocal, mul, scatter_add of -1).
enum Mode { kExpInPlace, kStatsOnly, kGradInPlace };

template <class T, Mode kMode>
__global__ void softmax_rows_kernel(T* __restrict__ x, int64_t n, int64_t V, bool vec4,
                                    const int64_t* __restrict__ targets, float* __restrict__ m_out,
                                    float* __restrict__ s_out, int64_t* __restrict__ first_max) {
  using cuda_math::Convert;
  __shared__ float scratch_v[33];
  __shared__ int64_t scratch_i[33];
  const int64_t V4 = V / 4;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    T* row = x + r * V;
    float best = -INFINITY;
    int64_t best_i = INT64_MAX;
    if (vec4) {
      for (int64_t j = threadIdx.x; j < V4; j += blockDim.x) {
        const float4 q = load4(row + 4 * j);
        take(q.x, 4 * j, best, best_i);
        take(q.y, 4 * j + 1, best, best_i);
        take(q.z, 4 * j + 2, best, best_i);
        take(q.w, 4 * j + 3, best, best_i);
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) take(Convert<T>::from(row[j]), j, best, best_i);
    }
    block_first_max(best, best_i, scratch_v, scratch_i);
    const float m = best;
    float sum = 0.0f;
    if (vec4) {
      for (int64_t j = threadIdx.x; j < V4; j += blockDim.x) {
        float4 q = load4(row + 4 * j);
        q.x = expf(__fsub_rn(q.x, m));
        q.y = expf(__fsub_rn(q.y, m));
        q.z = expf(__fsub_rn(q.z, m));
        q.w = expf(__fsub_rn(q.w, m));
        if constexpr (kMode == kExpInPlace) store4(row + 4 * j, q);
        sum = __fadd_rn(sum, __fadd_rn(__fadd_rn(q.x, q.y), __fadd_rn(q.z, q.w)));
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = expf(__fsub_rn(Convert<T>::from(row[j]), m));
        if constexpr (kMode == kExpInPlace) row[j] = Convert<T>::to(v);
        sum = __fadd_rn(sum, v);
      }
    }
    sum = block_sum(sum, scratch_v);
    if constexpr (kMode == kGradInPlace) {
      const float inv = __frcp_rn(sum);
      const int64_t t = targets[r];
      // One step of d loss / d logits for the element at index i holding v.
      auto grad = [&](float v, int64_t i) {
        const float p = __fmul_rn(expf(__fsub_rn(v, m)), inv);
        return i == t ? __fadd_rn(p, -1.0f) : p;
      };
      if (vec4) {
        for (int64_t j = threadIdx.x; j < V4; j += blockDim.x) {
          float4 q = load4(row + 4 * j);
          q.x = grad(q.x, 4 * j);
          q.y = grad(q.y, 4 * j + 1);
          q.z = grad(q.z, 4 * j + 2);
          q.w = grad(q.w, 4 * j + 3);
          store4(row + 4 * j, q);
        }
      } else {
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) row[j] = Convert<T>::to(grad(Convert<T>::from(row[j]), j));
      }
    }
    if (threadIdx.x == 0) {
      m_out[r] = m;
      s_out[r] = sum;
      first_max[r] = best_i;
    }
  }
}

template <class T, Mode kMode>
cudaError_t launch(T* x, int64_t n, int64_t V, const int64_t* targets, float* m, float* s, int64_t* first_max,
                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (V <= 0) return cudaErrorInvalidValue;
  // Four elements at a time where every row starts on a 4-element boundary of an aligned base.
  const bool vec4 = V % 4 == 0 && reinterpret_cast<uintptr_t>(x) % (4 * sizeof(T)) == 0;
  const int64_t grid = std::clamp<int64_t>(n, 1, 65535);
  softmax_rows_kernel<T, kMode><<<grid, kThreads, 0, stream>>>(x, n, V, vec4, targets, m, s, first_max);
  return cudaGetLastError();
}

}  // namespace

cudaError_t row_softmax_parts(float* e, int64_t n, int64_t V, float* m, float* s, int64_t* first_max,
                              cudaStream_t stream) {
  return launch<float, kExpInPlace>(e, n, V, nullptr, m, s, first_max, stream);
}

cudaError_t bf16_softmax_grad(void* logits, int64_t n, int64_t V, const int64_t* targets, float* m, float* s,
                              int64_t* first_max, cudaStream_t stream) {
  auto* x = static_cast<__nv_bfloat16*>(logits);
  return targets ? launch<__nv_bfloat16, kGradInPlace>(x, n, V, targets, m, s, first_max, stream)
                 : launch<__nv_bfloat16, kStatsOnly>(x, n, V, nullptr, m, s, first_max, stream);
}

}  // namespace memtune::models::cross_entropy_cuda
