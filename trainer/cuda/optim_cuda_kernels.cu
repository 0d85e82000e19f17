// The optimizer step's multi-tensor passes on CUDA (optim_cuda_kernels.h). The AdamW update is
// trainer/optim_kernels.cpp's torch_adamw_scalar with every product, sum, quotient and root an
// _rn intrinsic, so nvcc's contraction into fused multiply-adds cannot change a bit.
#include "trainer/cuda/optim_cuda_kernels.h"

namespace memtune::trainer::optim_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kAdamWChunk = kThreads * 16;  // elements a CTA updates, all of one tensor
constexpr int64_t kSumChunk = kSquareSumChunkCuda;
static_assert(kSumChunk % kThreads == 0, "a chunk is whole strides of the CTA");

// Which of a launch's tensors CTA b works on: first[t] is tensor t's first CTA, first[count]
// the grid. A linear scan of at most kMaxTensors entries, the same on every lane.
__device__ __forceinline__ int tensor_of(const int64_t* first, int count, int64_t b) {
  int t = 0;
  while (t + 1 < count && first[t + 1] <= b) ++t;
  return t;
}

struct AdamWList {
  float* p[kMaxTensors];
  float* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  int64_t n[kMaxTensors];
  float decay[kMaxTensors];
  int64_t first[kMaxTensors + 1];
  int count;
};
static_assert(sizeof(AdamWList) + sizeof(TorchAdamW) < 4000, "a kernel's arguments are at most 4 KiB");

__global__ void torch_adamw_kernel(TorchAdamW s, AdamWList list) {
  const int64_t b = blockIdx.x;
  const int t = tensor_of(list.first, list.count, b);
  const int64_t n = list.n[t];
  float* __restrict__ p = list.p[t];
  float* __restrict__ g = list.g[t];
  float* __restrict__ m = list.m[t];
  float* __restrict__ v = list.v[t];
  const float decay = list.decay[t];
  const bool scaled = s.scale != 1.0f;
  const int64_t begin = (b - list.first[t]) * kAdamWChunk;
  const int64_t end = begin + kAdamWChunk < n ? begin + kAdamWChunk : n;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float gj = __fmul_rn(g[i], s.scale);
    if (scaled) g[i] = gj;
    const float pj = __fmul_rn(p[i], decay);
    const float mj = __fadd_rn(__fmul_rn(m[i], s.b1), __fmul_rn(s.one_minus_b1, gj));
    const float vj = __fadd_rn(__fmul_rn(v[i], s.b2), __fmul_rn(s.one_minus_b2, __fmul_rn(gj, gj)));
    m[i] = mj;
    v[i] = vj;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vj), s.sqrt_bc2), s.eps);
    p[i] = __fadd_rn(pj, __fmul_rn(s.step, __fdiv_rn(mj, denom)));
  }
}

struct SumList {
  const float* x[kMaxTensors];
  int64_t n[kMaxTensors];
  int64_t first[kMaxTensors + 1];
  int count;
};

// CTA b: one chunk of one tensor. Each lane sums its strided elements' squares in double (a
// float's square is exact there), then the lanes' sums are added pairwise in a fixed tree, so
// a gradient's partials are the same bits on every run.
__global__ void square_sum_kernel(SumList list, double* __restrict__ partials) {
  __shared__ double sums[kThreads];
  const int64_t b = blockIdx.x;
  const int t = tensor_of(list.first, list.count, b);
  const float* __restrict__ x = list.x[t];
  const int64_t begin = (b - list.first[t]) * kSumChunk;
  const int64_t end = begin + kSumChunk < list.n[t] ? begin + kSumChunk : list.n[t];
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double xi = x[i];
    acc = __dadd_rn(acc, __dmul_rn(xi, xi));
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width >>= 1) {
    if (threadIdx.x < width) sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + width]);
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[b] = sums[0];
}

// Fills first[0, count] for tensors of n[k] elements at `chunk` elements a CTA; returns the
// grid (first[count]).
int64_t plan_grid(const int64_t* n, int count, int64_t chunk, int64_t* first) {
  int64_t blocks = 0;
  for (int k = 0; k < count; ++k) {
    first[k] = blocks;
    blocks += (n[k] + chunk - 1) / chunk;
  }
  first[count] = blocks;
  return blocks;
}

constexpr int64_t kMaxGrid = 0x7fffffff;  // CUDA's largest gridDim.x

}  // namespace

cudaError_t torch_adamw(const TorchAdamW& s, const AdamWTensor* tensors, int count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > kMaxTensors) return cudaErrorInvalidValue;
  AdamWList list{};
  list.count = count;
  for (int k = 0; k < count; ++k) {
    const AdamWTensor& x = tensors[k];
    list.p[k] = x.p;
    list.g[k] = x.g;
    list.m[k] = x.m;
    list.v[k] = x.v;
    list.n[k] = x.n;
    list.decay[k] = x.decay;
  }
  const int64_t blocks = plan_grid(list.n, count, kAdamWChunk, list.first);
  if (blocks == 0) return cudaSuccess;
  if (blocks > kMaxGrid) return cudaErrorInvalidValue;
  torch_adamw_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s, list);
  return cudaGetLastError();
}

int64_t square_sum_partials(int64_t n) { return (n + kSumChunk - 1) / kSumChunk; }

cudaError_t square_sums(const float* const* xs, const int64_t* ns, int count, double* partials, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > kMaxTensors) return cudaErrorInvalidValue;
  SumList list{};
  list.count = count;
  for (int k = 0; k < count; ++k) {
    list.x[k] = xs[k];
    list.n[k] = ns[k];
  }
  const int64_t blocks = plan_grid(list.n, count, kSumChunk, list.first);  // a partial per CTA
  if (blocks == 0) return cudaSuccess;
  if (blocks > kMaxGrid) return cudaErrorInvalidValue;
  square_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(list, partials);
  return cudaGetLastError();
}

}  // namespace memtune::trainer::optim_cuda
