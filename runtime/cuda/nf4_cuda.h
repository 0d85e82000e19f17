#pragma once
// NF4 on CUDA tensors (runtime/cuda/nf4_cuda.cpp, built only with CUDA): runtime/nf4.cpp
// dispatches here, under MEMTUNE_CUDA, for quantized state and weights on a CUDA device.
#include <ATen/core/Tensor.h>

#include "runtime/nf4.h"

namespace memtune {

// nf4_dequantize for q on a CUDA device: one kernel, equal to the CPU kernels bit for bit.
at::Tensor nf4_dequantize_cuda(const NF4Tensor& q, at::ScalarType out_dtype);

// The 4-bit half of nf4_quantize for a finite CUDA tensor w (fp32/fp16/bf16): packed codes
// of `quant_type` (uint8 [ceil(n/2)]) and fp32 absmax per block, on w's device, equal to the
// CPU's bytes.
void nf4_quantize_blocks_cuda(const at::Tensor& w, int64_t blocksize, QuantType quant_type, at::Tensor& packed,
                              at::Tensor& absmax);

}  // namespace memtune
