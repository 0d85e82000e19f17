#pragma once
// A LoRA adapter's output added into its projection's 16-bit output in one pass
// (lora_cuda_kernels.cu), on raw device pointers so that nvcc compiles no LibTorch header;
// models/layers/lora_linear.cpp checks the tensors and calls it for CUDA tensors.
//
// With r small (the adapter's rank), each element of a b is a short dot product, so it is
// formed where y is read and written: one read and one write of y, where ATen's
// `y.add_(at::mm(a, b).mul_(s))` writes the product, reads it back, and reads and writes y
// (twice y's bytes more). The roundings are those ATen ops' in y's type T, as PEFT's
// `result + lora_B(lora_A(x)) * scaling` under autocast rounds them:
//   y = T(y + T(T(sum_k a[i, k] b[k, j]) * scaling)),
// the sum in fp32 over k = 0, 1, ..., r - 1 in that order, each step a fused multiply-add
// (the product of two 16-bit values is exact in fp32). cuBLAS may sum the r terms in
// another order, which can move the rounded product by one unit in its last place.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "runtime/cuda/device_types.h"

namespace memtune::models::lora_cuda {

using cuda_math::DType;

// y (m, n) with row stride ldy, a (m, r) with row stride lda, b (r, n) with row stride ldb:
// columns adjacent in each. For the forward b is B^T (B the adapter's [n, r]), for the input's
// gradient A itself ([r, n]). One 16-bit type t (kHalf or kBFloat16) for all three.
cudaError_t add_scaled_product(void* y, int64_t ldy, const void* a, int64_t lda, const void* b, int64_t ldb, DType t,
                               int64_t m, int64_t n, int64_t r, float scaling, cudaStream_t stream);

}  // namespace memtune::models::lora_cuda
