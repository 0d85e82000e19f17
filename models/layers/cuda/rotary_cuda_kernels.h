#pragma once
// Rotary position embeddings' CUDA kernel (rotary_cuda_kernels.cu), on raw device pointers
// so that nvcc compiles no LibTorch header; models/layers/rotary.cpp checks the tensors and
// calls it for CUDA tensors. One pass each way where Hugging Face's ATen ops make five.
//
// The roundings are those of apply_rotary_pos_emb under PyTorch's autograd in x's type T,
// with cos and sin cast to T first (as Hugging Face's rotary module returns them):
//   forward   out = T(T(x * c) + T(rotate_half(x) * s)),
//   backward  gx  = T(T(g * c) + rotate_half^T(T(g * s))), rotate_half^T([a, b]) = [b, -a].
// In fp32 these are the CPU kernel's products and sums, each rounded once.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "runtime/cuda/device_types.h"

namespace memtune::models::rotary_cuda {

using cuda_math::DType;

// x and out (rows, heads, dim) of type xt, contiguous; cos and sin (rows, dim) of type ct,
// contiguous, shared by a row's heads; dim even. `inverse` applies the backward's transpose.
cudaError_t rotate(const void* x, DType xt, const void* cos, const void* sin, DType ct, int64_t rows, int64_t heads,
                   int64_t dim, bool inverse, void* out, cudaStream_t stream);

}  // namespace memtune::models::rotary_cuda
