// bitsandbytes' 8-bit blockwise and 32-bit AdamW kernels, ported from memtune's CPU twins
// (trainer/adamw8bit_kernels.cpp: adam8_blocks_scalar; trainer/optimizer.cpp: bnb_adam32),
// which the tests hold to bitsandbytes' bytes; the code search is theirs (quantize_2d.h). Every
// product, sum, quotient and root is an _rn intrinsic, so nvcc's contraction into fused
// multiply-adds cannot change a bit.
#include "trainer/cuda/adamw_bnb_cuda_kernels.h"
#include "trainer/quantize_2d.h"

#include <cfloat>

#include <algorithm>

namespace memtune::trainer::bnb_cuda {
namespace {

constexpr int kBlock = 256;  // one CTA per block of the 8-bit states, a lane per element

struct Map {
  float v[256];
};

__device__ __forceinline__ bool sign_of(float x) { return (__float_as_uint(x) >> 31) != 0; }

// The block's maximum of `a` (no NaN: the callers map it to -FLT_MAX first), on every lane.
__device__ __forceinline__ float block_max(float a, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) scratch[warp] = a;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < kBlock / 32; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// Lane j of CTA b: element b * 256 + j. Lanes past the end take part as the kernel's padded
// loads do (g 0, code1 128, code2 0): they count towards the new absmax and write nothing.
__global__ void adam8_kernel(BnbScalars s, Map map1, Map map2, float* __restrict__ p, const float* __restrict__ g,
                             uint8_t* __restrict__ c1, uint8_t* __restrict__ c2, float* __restrict__ absmax1,
                             float* __restrict__ absmax2, int64_t n) {
  __shared__ float q1[256], q2[256];
  __shared__ float scratch1[kBlock / 32], scratch2[kBlock / 32];
  const int j = threadIdx.x;
  q1[j] = map1.v[j];
  q2[j] = map2.v[j];
  __syncthreads();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {  // uniform across the CTA
    const int64_t i = b * kBlock + j;
    const bool in = i < n;
    const float old1 = absmax1[b], old2 = absmax2[b];
    const float gj = in ? g[i] : 0.0f;
    const int k1 = in ? c1[i] : 128, k2 = in ? c2[i] : 0;
    const bool finite = isfinite(gj);
    const float gv = __fmul_rn(gj, s.gs);
    float v = __fmul_rn(q2[k2], old2);
    v = __fadd_rn(__fmul_rn(v, s.b2), __fmul_rn(__fmul_rn(s.one_minus_b2, gv), gv));
    float m = __fmul_rn(q1[k1], old1);
    m = __fadd_rn(__fmul_rn(m, s.b1), __fmul_rn(s.one_minus_b1, gv));
    const float s1 = finite ? m : 0.0f, s2 = finite ? v : 0.0f;  // a non-finite gradient zeroes the states
    const float a1 = fabsf(s1), a2 = fabsf(s2);
    // The CPU's running "a > max ? a : max" from -FLT_MAX: a NaN state leaves the maximum.
    const float max1 = block_max(a1 > -FLT_MAX ? a1 : -FLT_MAX, scratch1);
    const float max2 = block_max(a2 > -FLT_MAX ? a2 : -FLT_MAX, scratch2);
    if (j == 0) {  // every lane read the old absmax before block_max's barrier
      absmax1[b] = max1;
      absmax2[b] = max2;
    }
    if (in) {
      float pj = __fadd_rn(p[i], __fmul_rn(s.step_size, __fdiv_rn(s1, __fadd_rn(__fsqrt_rn(s2), s.eps_c2))));
      if (s.decay_on) pj = __fmul_rn(pj, s.decay);
      if (finite) p[i] = pj;
      int code1 = quantize_2d_search(q1, true, __fdiv_rn(s1, max1));
      // the first moment's code keeps its sign (bitsandbytes moves it one step)
      if (sign_of(q1[code1]) != sign_of(s1)) code1 = s1 > 0.0f ? code1 + 1 : code1 - 1;
      c1[i] = static_cast<uint8_t>(code1);
      c2[i] = static_cast<uint8_t>(quantize_2d_search(q2, false, __fdiv_rn(s2, max2)));
    }
    __syncthreads();  // the scratch is read by every lane before the next block writes it
  }
}

__global__ void adam32_kernel(BnbScalars s, float* __restrict__ p, const float* __restrict__ g,
                              float* __restrict__ m, float* __restrict__ v, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float gj = __fmul_rn(s.gs, g[i]);
    const float mj = __fadd_rn(__fmul_rn(m[i], s.b1), __fmul_rn(s.one_minus_b1, gj));
    const float vj = __fadd_rn(__fmul_rn(v[i], s.b2), __fmul_rn(s.one_minus_b2, __fmul_rn(gj, gj)));
    m[i] = mj;
    v[i] = vj;
    float pj = __fadd_rn(p[i], __fmul_rn(s.step_size, __fdiv_rn(mj, __fadd_rn(__fsqrt_rn(vj), s.eps_c2))));
    if (s.decay_on) pj = __fmul_rn(pj, s.decay);
    p[i] = pj;
  }
}

}  // namespace

cudaError_t adam8(const BnbScalars& s, const float* map_signed, const float* map_unsigned, float* p, const float* g,
                  uint8_t* c1, uint8_t* c2, float* absmax1, float* absmax2, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  Map m1, m2;
  for (int k = 0; k < 256; ++k) {
    m1.v[k] = map_signed[k];
    m2.v[k] = map_unsigned[k];
  }
  const int64_t grid = std::min<int64_t>((n + kBlock - 1) / kBlock, int64_t{1} << 20);
  adam8_kernel<<<static_cast<unsigned>(grid), kBlock, 0, stream>>>(s, m1, m2, p, g, c1, c2, absmax1, absmax2, n);
  return cudaGetLastError();
}

cudaError_t adam32(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n,
                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, int64_t{1} << 20));
  adam32_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(s, p, g, m, v, n);
  return cudaGetLastError();
}

}  // namespace memtune::trainer::bnb_cuda
