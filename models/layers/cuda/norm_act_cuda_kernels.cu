// RMSNorm and SwiGLU on CUDA: one pass each way where ATen's op chains make several, the
// statistics in fp32 and each stored value rounded to its dtype once, where Hugging Face's
// modules under PyTorch's autograd round it (norm_act_cuda_kernels.h).
#include "models/layers/cuda/norm_act_cuda_kernels.h"

#include <algorithm>
#include <cstdint>

#include "runtime/cuda/device_math.cuh"

namespace memtune::models::norm_act_cuda {
namespace {

using cuda_math::block_sum;
using cuda_math::Convert;
using cuda_math::round_to;
using cuda_math::with_type;

constexpr int kRowThreads = 256;   // a CTA per row (grid-stride over rows)
constexpr int kFlatThreads = 256;  // elementwise kernels

int64_t flat_grid(int64_t n) { return std::clamp<int64_t>((n + kFlatThreads - 1) / kFlatThreads, 1, int64_t{1} << 20); }
int64_t row_grid(int64_t rows) { return std::clamp<int64_t>(rows, 1, 65535); }

template <class T, class W>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const W* __restrict__ w, int64_t rows, int64_t width,
                                        float eps, T* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float scratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * width;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float v = Convert<T>::from(xr[j]);
      ss = __fmaf_rn(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    // As ATen's mean and rsqrt: the sum times 1/width, rsqrtf.
    const float rs = rsqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / static_cast<float>(width)), eps));
    if (threadIdx.x == 0) rstd[r] = rs;
    T* yr = y + r * width;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float n = round_to<T>(__fmul_rn(Convert<T>::from(xr[j]), rs));
      yr[j] = Convert<T>::to(__fmul_rn(n, round_to<T>(Convert<W>::from(w[j]))));
    }
  }
}

template <class T, class W>
__global__ void rms_norm_backward_input_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                               const float* __restrict__ rstd, const T* __restrict__ gy, int64_t rows,
                                               int64_t width, T* __restrict__ gx) {
  __shared__ float scratch[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * width;
    const T* gr = gy + r * width;
    const float rs = rstd[r];
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float n = __fmul_rn(Convert<T>::from(xr[j]), rs);
      const float dn = round_to<T>(__fmul_rn(Convert<T>::from(gr[j]), round_to<T>(Convert<W>::from(w[j]))));
      dot = __fmaf_rn(dn, n, dot);
    }
    dot = __fdiv_rn(block_sum(dot, scratch), static_cast<float>(width));
    T* out = gx + r * width;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      const float n = __fmul_rn(Convert<T>::from(xr[j]), rs);
      const float dn = round_to<T>(__fmul_rn(Convert<T>::from(gr[j]), round_to<T>(Convert<W>::from(w[j]))));
      out[j] = Convert<T>::to(__fmul_rn(__fsub_rn(dn, __fmul_rn(n, dot)), rs));
    }
  }
}

// Thread (column j, chunk c): the sum over chunk c's rows, reading a row's columns coalesced.
template <class T>
__global__ void rms_norm_backward_weight_kernel(const T* __restrict__ x, const float* __restrict__ rstd,
                                                const T* __restrict__ gy, int64_t rows, int64_t width,
                                                int64_t rows_per_chunk, float* __restrict__ partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c = blockIdx.y;
  if (j >= width) return;
  const int64_t r0 = c * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float n = round_to<T>(__fmul_rn(Convert<T>::from(x[r * width + j]), rstd[r]));
    acc = __fadd_rn(acc, round_to<T>(__fmul_rn(Convert<T>::from(gy[r * width + j]), n)));
  }
  partial[c * width + j] = acc;
}

__device__ __forceinline__ float sigmoid(float g) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g))); }

// One element of SwiGLU each way, shared by the scalar and the vector kernels so that both
// give the same bits.
template <class T>
__device__ __forceinline__ T swiglu_one(T gate, T up) {
  const float g = Convert<T>::from(gate);
  const float s = round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));  // silu(g), stored as T
  return Convert<T>::to(__fmul_rn(s, Convert<T>::from(up)));
}

template <class T>
__device__ __forceinline__ T swiglu_grad_up(T gate, T gy) {
  const float g = Convert<T>::from(gate);
  const float s = round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
  return Convert<T>::to(__fmul_rn(Convert<T>::from(gy), s));
}

// silu'(g) = sig * (1 + g * (1 - sig)) applied to the product's gradient gy * up, in the
// order of ATen's silu_backward (ds * sig * (1 + g * (1 - sig)), one FMA).
template <class T>
__device__ __forceinline__ T swiglu_grad_gate(T gate, T up, T gy) {
  const float g = Convert<T>::from(gate);
  const float ds = round_to<T>(__fmul_rn(Convert<T>::from(gy), Convert<T>::from(up)));
  const float sig = sigmoid(g);
  return Convert<T>::to(__fmul_rn(__fmul_rn(ds, sig), __fmaf_rn(g, __fsub_rn(1.0f, sig), 1.0f)));
}

// Elements [begin, n) one per thread and iteration.
template <class T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t begin, int64_t n,
                                      T* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = swiglu_one(gate[i], up[i]);
}

template <class T>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ gy,
                                       int64_t begin, int64_t n, T* __restrict__ grad_gate, T* __restrict__ grad_up) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (grad_up != nullptr) grad_up[i] = swiglu_grad_up(gate[i], gy[i]);
    if (grad_gate != nullptr) grad_gate[i] = swiglu_grad_gate(gate[i], up[i], gy[i]);
  }
}

// 16 bytes of each tensor per thread and iteration (8 bf16 or fp16, 4 fp32): one vector
// load or store per tensor where one element each made the scalar kernels slower than
// ATen's vectorized ones (0.76x at 4096 x 14336 bf16 on an H200, 2026-11-26). `vectors`
// counts 16-byte groups; every pointer is 16-byte aligned.
template <class T>
struct Vec {
  static constexpr int kN = 16 / sizeof(T);
  alignas(16) T v[kN];
  __device__ __forceinline__ static Vec load(const T* p, int64_t i) {
    Vec r;
    *reinterpret_cast<uint4*>(r.v) = reinterpret_cast<const uint4*>(p)[i];
    return r;
  }
  __device__ __forceinline__ void store(T* p, int64_t i) const {
    reinterpret_cast<uint4*>(p)[i] = *reinterpret_cast<const uint4*>(v);
  }
};

template <class T>
__global__ void swiglu_forward_vec_kernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t vectors,
                                          T* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const Vec<T> g = Vec<T>::load(gate, i), u = Vec<T>::load(up, i);
    Vec<T> o;
#pragma unroll
    for (int k = 0; k < Vec<T>::kN; ++k) o.v[k] = swiglu_one(g.v[k], u.v[k]);
    o.store(y, i);
  }
}

template <class T>
__global__ void swiglu_backward_vec_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                           const T* __restrict__ gy, int64_t vectors, T* __restrict__ grad_gate,
                                           T* __restrict__ grad_up) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const Vec<T> g = Vec<T>::load(gate, i), d = Vec<T>::load(gy, i);
    if (grad_up != nullptr) {
      Vec<T> o;
#pragma unroll
      for (int k = 0; k < Vec<T>::kN; ++k) o.v[k] = swiglu_grad_up(g.v[k], d.v[k]);
      o.store(grad_up, i);
    }
    if (grad_gate != nullptr) {
      const Vec<T> u = Vec<T>::load(up, i);
      Vec<T> o;
#pragma unroll
      for (int k = 0; k < Vec<T>::kN; ++k) o.v[k] = swiglu_grad_gate(g.v[k], u.v[k], d.v[k]);
      o.store(grad_gate, i);
    }
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t rms_norm_forward(const void* x, DType xt, const void* w, DType wt, int64_t rows, int64_t width,
                             float eps, void* y, float* rstd, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  with_type(xt, [&](auto xtag) {
    using T = decltype(xtag);
    with_type(wt, [&](auto wtag) {
      using W = decltype(wtag);
      rms_norm_forward_kernel<T, W><<<row_grid(rows), kRowThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(w), rows, width, eps, static_cast<T*>(y), rstd);
    });
  });
  return cudaGetLastError();
}

cudaError_t rms_norm_backward_input(const void* x, DType xt, const void* w, DType wt, const float* rstd,
                                    const void* gy, int64_t rows, int64_t width, void* gx, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  with_type(xt, [&](auto xtag) {
    using T = decltype(xtag);
    with_type(wt, [&](auto wtag) {
      using W = decltype(wtag);
      rms_norm_backward_input_kernel<T, W><<<row_grid(rows), kRowThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(w), rstd, static_cast<const T*>(gy), rows, width,
          static_cast<T*>(gx));
    });
  });
  return cudaGetLastError();
}

cudaError_t rms_norm_backward_weight(const void* x, DType xt, const float* rstd, const void* gy, int64_t rows,
                                     int64_t width, int64_t chunks, float* partial, cudaStream_t stream) {
  if (rows == 0 || width == 0) return cudaSuccess;
  if (chunks < 1 || chunks > 65535) return cudaErrorInvalidValue;
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>((width + kFlatThreads - 1) / kFlatThreads), static_cast<unsigned>(chunks));
  with_type(xt, [&](auto xtag) {
    using T = decltype(xtag);
    rms_norm_backward_weight_kernel<T><<<grid, kFlatThreads, 0, stream>>>(
        static_cast<const T*>(x), rstd, static_cast<const T*>(gy), rows, width, per_chunk, partial);
  });
  return cudaGetLastError();
}

cudaError_t swiglu_forward(const void* gate, const void* up, DType t, int64_t n, void* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up);
    T* out = static_cast<T*>(y);
    int64_t begin = 0;
    if (aligned16(g) && aligned16(u) && aligned16(out)) {
      const int64_t vectors = n / Vec<T>::kN;
      if (vectors > 0) swiglu_forward_vec_kernel<T><<<flat_grid(vectors), kFlatThreads, 0, stream>>>(g, u, vectors, out);
      begin = vectors * Vec<T>::kN;
    }
    if (begin < n) swiglu_forward_kernel<T><<<flat_grid(n - begin), kFlatThreads, 0, stream>>>(g, u, begin, n, out);
  });
  return cudaGetLastError();
}

cudaError_t swiglu_backward(const void* gate, const void* up, const void* gy, DType t, int64_t n, void* grad_gate,
                            void* grad_up, cudaStream_t stream) {
  if (n == 0 || (grad_gate == nullptr && grad_up == nullptr)) return cudaSuccess;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    const T *g = static_cast<const T*>(gate), *u = static_cast<const T*>(up), *d = static_cast<const T*>(gy);
    T *gg = static_cast<T*>(grad_gate), *gu = static_cast<T*>(grad_up);
    int64_t begin = 0;
    if (aligned16(g) && aligned16(u) && aligned16(d) && aligned16(gg) && aligned16(gu)) {
      const int64_t vectors = n / Vec<T>::kN;
      if (vectors > 0)
        swiglu_backward_vec_kernel<T><<<flat_grid(vectors), kFlatThreads, 0, stream>>>(g, u, d, vectors, gg, gu);
      begin = vectors * Vec<T>::kN;
    }
    if (begin < n)
      swiglu_backward_kernel<T><<<flat_grid(n - begin), kFlatThreads, 0, stream>>>(g, u, d, begin, n, gg, gu);
  });
  return cudaGetLastError();
}

}  // namespace memtune::models::norm_act_cuda
