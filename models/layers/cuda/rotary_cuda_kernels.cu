// Rotary position embeddings on CUDA (rotary_cuda_kernels.h): a thread per pair of
// elements (d, d + dim/2) of one head, which the rotation mixes.
#include "models/layers/cuda/rotary_cuda_kernels.h"

#include <algorithm>

#include "runtime/cuda/device_math.cuh"

namespace memtune::models::rotary_cuda {
namespace {

using cuda_math::Convert;
using cuda_math::round_to;
using cuda_math::with_type;

constexpr int kThreads = 256;

template <class T, class C>
__global__ void rotate_kernel(const T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin,
                              int64_t rows, int64_t heads, int64_t dim, bool inverse, T* __restrict__ out) {
  const int64_t half = dim / 2;
  const int64_t pairs = rows * heads * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += stride) {
    const int64_t d = p % half, head_row = p / half, r = head_row / heads;
    const T* xi = x + head_row * dim;
    T* o = out + head_row * dim;
    const C* cr = cos + r * dim;
    const C* sr = sin + r * dim;
    // The tables as T holds them.
    const float c1 = round_to<T>(Convert<C>::from(cr[d])), c2 = round_to<T>(Convert<C>::from(cr[d + half]));
    const float s1 = round_to<T>(Convert<C>::from(sr[d])), s2 = round_to<T>(Convert<C>::from(sr[d + half]));
    const float x1 = Convert<T>::from(xi[d]), x2 = Convert<T>::from(xi[d + half]);
    const float a1 = round_to<T>(__fmul_rn(x1, c1)), a2 = round_to<T>(__fmul_rn(x2, c2));
    if (!inverse) {
      // rotate_half(x) = [-x2, x1], times sin.
      o[d] = Convert<T>::to(__fsub_rn(a1, round_to<T>(__fmul_rn(x2, s1))));
      o[d + half] = Convert<T>::to(__fadd_rn(a2, round_to<T>(__fmul_rn(x1, s2))));
    } else {
      // rotate_half^T(g * s) = [(g * s)2, -(g * s)1].
      o[d] = Convert<T>::to(__fadd_rn(a1, round_to<T>(__fmul_rn(x2, s2))));
      o[d + half] = Convert<T>::to(__fsub_rn(a2, round_to<T>(__fmul_rn(x1, s1))));
    }
  }
}

}  // namespace

cudaError_t rotate(const void* x, DType xt, const void* cos, const void* sin, DType ct, int64_t rows, int64_t heads,
                   int64_t dim, bool inverse, void* out, cudaStream_t stream) {
  const int64_t pairs = rows * heads * (dim / 2);
  if (pairs == 0) return cudaSuccess;
  if (dim % 2 != 0) return cudaErrorInvalidValue;
  const int64_t grid = std::clamp<int64_t>((pairs + kThreads - 1) / kThreads, 1, int64_t{1} << 20);
  with_type(xt, [&](auto xtag) {
    using T = decltype(xtag);
    with_type(ct, [&](auto ctag) {
      using C = decltype(ctag);
      rotate_kernel<T, C><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<const C*>(cos),
                                                         static_cast<const C*>(sin), rows, heads, dim, inverse,
                                                         static_cast<T*>(out));
    });
  });
  return cudaGetLastError();
}

}  // namespace memtune::models::rotary_cuda
