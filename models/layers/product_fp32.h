#pragma once
// A weight gradient from 16-bit operands, summed in fp32: c (m, k) fp32 += a^T b for a (n, m)
// and b (n, k) contiguous, in one 16-bit dtype (bf16 or fp16). The products of 16-bit values
// are exact in fp32 and summed there, so the gradient is not rounded to 16 bits per chunk of
// rows (the loss's chunks, a micro-batch): it does not depend on how the rows are split.
#include <ATen/core/Tensor.h>

namespace memtune::models {

// On CUDA one cuBLAS GEMM with 16-bit inputs and an fp32 result; elsewhere the fp32 product
// of the same values, through `scratch` when given (an fp32 buffer of a's shape that a may
// be copied into).
void add_product_t_fp32(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, at::Tensor scratch = {});

}  // namespace memtune::models
