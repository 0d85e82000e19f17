#pragma once
// RMSNorm's and SwiGLU's CUDA kernels (norm_act_cuda_kernels.cu), on raw device pointers
// so that nvcc compiles no LibTorch header; models/layers/norm_act.cpp checks the tensors
// and calls these for CUDA tensors. Every tensor is contiguous; T is x's (or gate's) dtype.
//
// The roundings are those of Hugging Face's modules run by PyTorch's autograd in T, so a
// bf16 run is what transformers computes (one rounding per op, each op in fp32):
//   RMSNorm  y = T(T(x * rstd) * T(w)), rstd = rsqrt(mean(x^2) + eps) per row in fp32
//            (ATen's rsqrtf: its last bits, like the sum's order, may differ);
//   SwiGLU   y = T(T(silu(gate)) * up).
// In fp32 they equal the CPU's nodes up to the order of a row's sum and the exp's last bit.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "runtime/cuda/device_types.h"

namespace memtune::models::norm_act_cuda {

using cuda_math::DType;

// x, y (rows, width) of type xt; w (width) of type wt; rstd (rows) fp32, written.
cudaError_t rms_norm_forward(const void* x, DType xt, const void* w, DType wt, int64_t rows, int64_t width,
                             float eps, void* y, float* rstd, cudaStream_t stream);

// gx = rstd * (dn - n * mean(dn * n)) with n = x * rstd and dn = T(gy * T(w)), in fp32,
// stored as T. x, gy, gx (rows, width) of type xt.
cudaError_t rms_norm_backward_input(const void* x, DType xt, const void* w, DType wt, const float* rstd,
                                    const void* gy, int64_t rows, int64_t width, void* gx, cudaStream_t stream);

// partial[c][j] = sum over the rows of chunk c of T(gy * T(x * rstd))[., j] in fp32, the
// rows split in `chunks` runs of equal length (the last shorter); the caller sums the
// partials. partial is fp32 (chunks, width).
cudaError_t rms_norm_backward_weight(const void* x, DType xt, const float* rstd, const void* gy, int64_t rows,
                                     int64_t width, int64_t chunks, float* partial, cudaStream_t stream);

// y = T(T(silu(gate)) * up); gate, up, y of n elements of type t.
cudaError_t swiglu_forward(const void* gate, const void* up, DType t, int64_t n, void* y, cudaStream_t stream);

// The gradients autograd forms for silu(gate) * up in T: grad_up = T(gy * T(silu(gate))),
// grad_gate = T(T(gy * up) * s * (1 + gate * (1 - s))) with s = sigmoid(gate) in fp32.
// Either output may be null (not wanted).
cudaError_t swiglu_backward(const void* gate, const void* up, const void* gy, DType t, int64_t n, void* grad_gate,
                            void* grad_up, cudaStream_t stream);

}  // namespace memtune::models::norm_act_cuda
