// 4-bit (NF4, FP4) dequantize and quantize on CUDA, the numerics of runtime/nf4.cpp's CPU
// kernels (bitsandbytes' kDequantizeBlockwise and kQuantizeBlockwise): value =
// codebook[code] * scale in fp32, scale = map[code] * nested_absmax, then + offset (two
// roundings), codes by strict ">" against the fp32 midpoints of x * (1 / absmax) (FP4: of
// its magnitude, with the sign bit for x < 0). Every product and sum is written as an
// _rn intrinsic, so nvcc's default contraction into fused multiply-adds cannot change a bit.
#include "runtime/cuda/nf4_cuda_kernels.h"

#include "runtime/cuda/device_math.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace memtune::nf4_cuda {
namespace {

constexpr int kThreads = 256;

// Tables passed by value (kernel parameters) and copied to shared memory by each CTA: a
// warp's lanes index them with different codes, which constant memory would serialize.
struct Codebook {
  float v[16];
};

int log2_of(int64_t blocksize) {
  int k = 0;
  while ((int64_t{1} << k) < blocksize) ++k;
  return k;
}

int64_t grid_for(int64_t items) {
  // Grid-stride loops: the grid need not cover every item.
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t{1} << 20));
}

using cuda_math::Convert;

__device__ __forceinline__ float block_scale(const Scales& s, int64_t block, const float* map) {
  if (s.absmax != nullptr) return s.absmax[block];
  return __fadd_rn(__fmul_rn(map[s.absmax_codes[block]], s.nested_absmax[block / 256]), s.nested_offset);
}

// Thread g writes elements [E g, E g + E), E = 32 bytes of output (8 fp32, 16 fp16 or bf16):
// E / 2 packed bytes, in one quantization block (the block size is a power of two >= 32).
// With `vector_io` (packed aligned to E / 2 bytes, out to 16) a full group is one 4- or 8-byte
// load and two 16-byte stores. (At 8 elements per thread, 16 bytes of bf16 output, NF4 to bf16
// ran at 59-62 % of a device copy's bandwidth on an H200 against fp32's 84 %, 2026-11-26.)
template <class T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, Scales s, int64_t n, int log2_bs,
                                  Codebook codebook, bool vector_io, T* __restrict__ out) {
  constexpr int E = 32 / static_cast<int>(sizeof(T));
  constexpr int kWords = E / 8;  // 4-byte words of packed codes per group
  __shared__ float cb[16];
  __shared__ float map[256];
  if (threadIdx.x < 16) cb[threadIdx.x] = codebook.v[threadIdx.x];
  if (s.absmax == nullptr)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = s.nested_map[i];
  __syncthreads();
  const int64_t groups = (n + E - 1) / E;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const int64_t e0 = E * g;
    const float scale = block_scale(s, e0 >> log2_bs, map);
    if (vector_io && e0 + E <= n) {
      uint32_t words[kWords];
      if constexpr (kWords == 2) {
        const uint2 w = reinterpret_cast<const uint2*>(packed)[g];
        words[0] = w.x;
        words[1] = w.y;
      } else {
        words[0] = reinterpret_cast<const uint32_t*>(packed)[g];
      }
      alignas(16) T v[E];
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t byte = (words[w] >> (8 * k)) & 0xffu;  // little endian: byte k of the four
          v[8 * w + 2 * k] = Convert<T>::to(__fmul_rn(cb[byte >> 4], scale));
          v[8 * w + 2 * k + 1] = Convert<T>::to(__fmul_rn(cb[byte & 15u], scale));
        }
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) reinterpret_cast<uint4*>(out + e0)[k] = reinterpret_cast<const uint4*>(v)[k];
    } else {
      for (int64_t i = e0; i < n && i < e0 + E; ++i) {
        const uint8_t byte = packed[i >> 1];
        const int code = (i & 1) ? (byte & 15) : (byte >> 4);
        out[i] = Convert<T>::to(__fmul_rn(cb[code], scale));
      }
    }
  }
}

// One warp per quantization block: max |x| over the block (exact, so in any order).
template <class T>
__global__ void absmax_kernel(const T* __restrict__ x, int64_t n, int64_t blocksize, int64_t nblocks,
                              float* __restrict__ absmax) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t b = warp; b < nblocks; b += warps) {  // uniform across the warp
    const int64_t a = b * blocksize, z = min(n, a + blocksize);
    float m = 0.0f;
    for (int64_t i = a + lane; i < z; i += 32) m = fmaxf(m, fabsf(Convert<T>::from(x[i])));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) absmax[b] = m;
  }
}

// CodeRule's two forms (nf4_cuda_kernels.h); th and mc are the rule's tables in shared memory.
__device__ __forceinline__ uint32_t code_of(float v, bool sign_magnitude, const float* th, const uint8_t* mc) {
  uint32_t c = 0;
  if (!sign_magnitude) {
#pragma unroll
    for (int j = 0; j < 15; ++j) c += v > th[j] ? 1u : 0u;
    return c;
  }
  const float a = fabsf(v);
#pragma unroll
  for (int j = 0; j < 7; ++j) c += a > th[j] ? 1u : 0u;
  return (v < 0.0f ? 8u : 0u) | mc[c];
}

// Thread k writes packed byte k: elements 2k (high nibble) and 2k + 1, one block.
template <class T>
__global__ void codes_kernel(const T* __restrict__ x, int64_t n, int log2_bs, const float* __restrict__ absmax,
                             CodeRule rule, uint8_t* __restrict__ packed) {
  __shared__ float th[15];
  __shared__ uint8_t mc[8];
  if (threadIdx.x < 15) th[threadIdx.x] = rule.thresholds[threadIdx.x];
  if (threadIdx.x < 8) mc[threadIdx.x] = rule.magnitude_codes[threadIdx.x];
  __syncthreads();
  const bool sm = rule.sign_magnitude;
  const uint32_t zero_code = code_of(0.0f, sm, th, mc);
  const int64_t nbytes = (n + 1) / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < nbytes; k += stride) {
    const int64_t i = 2 * k;
    const float m = absmax[i >> log2_bs];
    uint32_t hi = zero_code, lo = zero_code;  // a block of zeros; the padding of an odd n
    if (m != 0.0f) {
      const float r = __frcp_rn(m);  // 1.0f / m, correctly rounded like the CPU's division
      hi = code_of(__fmul_rn(Convert<T>::from(x[i]), r), sm, th, mc);
      if (i + 1 < n) lo = code_of(__fmul_rn(Convert<T>::from(x[i + 1]), r), sm, th, mc);
    }
    packed[k] = static_cast<uint8_t>((hi << 4) | lo);
  }
}

template <class T>
cudaError_t launch_dequantize(const uint8_t* packed, const Scales& s, int64_t n, int log2_bs, const Codebook& cb,
                              void* out, cudaStream_t stream) {
  constexpr int64_t E = 32 / sizeof(T);  // elements per thread (dequantize_kernel)
  const bool vector_io =
      reinterpret_cast<uintptr_t>(packed) % (E / 2) == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  dequantize_kernel<T><<<grid_for((n + E - 1) / E), kThreads, 0, stream>>>(packed, s, n, log2_bs, cb, vector_io,
                                                                           static_cast<T*>(out));
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_quantize(const void* x, int64_t n, int64_t blocksize, const CodeRule& rule, uint8_t* packed,
                            float* absmax, cudaStream_t stream) {
  const int64_t nblocks = (n + blocksize - 1) / blocksize;
  const T* xt = static_cast<const T*>(x);
  absmax_kernel<T><<<grid_for(nblocks * 32), kThreads, 0, stream>>>(xt, n, blocksize, nblocks, absmax);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  codes_kernel<T><<<grid_for((n + 1) / 2), kThreads, 0, stream>>>(xt, n, log2_of(blocksize), absmax, rule, packed);
  return cudaGetLastError();
}

}  // namespace

cudaError_t dequantize(const uint8_t* packed, const Scales& scales, const float* codebook, int64_t n,
                       int64_t blocksize, OutType out_type, void* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  Codebook cb;
  for (int i = 0; i < 16; ++i) cb.v[i] = codebook[i];
  const int log2_bs = log2_of(blocksize);
  switch (out_type) {
    case OutType::kFloat: return launch_dequantize<float>(packed, scales, n, log2_bs, cb, out, stream);
    case OutType::kHalf: return launch_dequantize<__half>(packed, scales, n, log2_bs, cb, out, stream);
    case OutType::kBFloat16: return launch_dequantize<__nv_bfloat16>(packed, scales, n, log2_bs, cb, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t quantize(const void* x, InType in_type, const CodeRule& rule, int64_t n, int64_t blocksize,
                     uint8_t* packed, float* absmax, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (in_type) {
    case InType::kFloat: return launch_quantize<float>(x, n, blocksize, rule, packed, absmax, stream);
    case InType::kHalf: return launch_quantize<__half>(x, n, blocksize, rule, packed, absmax, stream);
    case InType::kBFloat16: return launch_quantize<__nv_bfloat16>(x, n, blocksize, rule, packed, absmax, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace memtune::nf4_cuda
