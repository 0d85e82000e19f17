// RMSNorm and SwiGLU on CUDA: one pass each way where ATen's op chains make several, the
// statistics in fp32 and each stored value rounded to its dtype once, where Hugging Face's
// modules under PyTorch's autograd round it (norm_act_cuda_kernels.h).
#include "models/layers/cuda/norm_act_cuda_kernels.h"

#include <algorithm>

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

template <class T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t n,
                                      T* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = Convert<T>::from(gate[i]);
    const float s = round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));  // silu(g), stored as T
    y[i] = Convert<T>::to(__fmul_rn(s, Convert<T>::from(up[i])));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ gy,
                                       int64_t n, T* __restrict__ grad_gate, T* __restrict__ grad_up) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = Convert<T>::from(gate[i]), d = Convert<T>::from(gy[i]);
    if (grad_up != nullptr) {
      const float s = round_to<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
      grad_up[i] = Convert<T>::to(__fmul_rn(d, s));
    }
    if (grad_gate != nullptr) {
      // silu'(g) = sig * (1 + g * (1 - sig)) applied to the product's gradient gy * up, in
      // the order of ATen's silu_backward (ds * sig * (1 + g * (1 - sig)), one FMA).
      const float ds = round_to<T>(__fmul_rn(d, Convert<T>::from(up[i])));
      const float sig = sigmoid(g);
      grad_gate[i] = Convert<T>::to(__fmul_rn(__fmul_rn(ds, sig), __fmaf_rn(g, __fsub_rn(1.0f, sig), 1.0f)));
    }
  }
}

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
    swiglu_forward_kernel<T><<<flat_grid(n), kFlatThreads, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), n, static_cast<T*>(y));
  });
  return cudaGetLastError();
}

cudaError_t swiglu_backward(const void* gate, const void* up, const void* gy, DType t, int64_t n, void* grad_gate,
                            void* grad_up, cudaStream_t stream) {
  if (n == 0 || (grad_gate == nullptr && grad_up == nullptr)) return cudaSuccess;
  with_type(t, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<flat_grid(n), kFlatThreads, 0, stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(gy), n,
        static_cast<T*>(grad_gate), static_cast<T*>(grad_up));
  });
  return cudaGetLastError();
}

}  // namespace memtune::models::norm_act_cuda
