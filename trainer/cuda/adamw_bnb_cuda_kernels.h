#pragma once
// bitsandbytes' AdamW updates on CUDA (adamw_bnb_cuda_kernels.cu), on raw device pointers
// so that nvcc compiles no LibTorch header; trainer/cuda/adamw_bnb_cuda.cpp checks the
// tensors and calls these. Operation for operation the CPU kernels of
// trainer/adamw8bit_kernels.cpp and trainer/optimizer.cpp (one fp32 rounding each, no fused
// multiply-add), so the states and parameters equal theirs to the bit.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "trainer/bnb_scalars.h"

namespace memtune::trainer::bnb_cuda {

// kOptimizerStatic8bit2StateBlockwise<ADAM, 256>: n elements in blocks of 256, c1/c2 the
// uint8 states over the signed and unsigned dynamic maps (`map_signed`, `map_unsigned`: 256
// host floats each), absmax1/absmax2 one fp32 per block, all updated in place.
cudaError_t adam8(const BnbScalars& s, const float* map_signed, const float* map_unsigned, float* p, const float* g,
                  uint8_t* c1, uint8_t* c2, float* absmax1, float* absmax2, int64_t n, cudaStream_t stream);

// kOptimizer32bit2State<ADAM>: fp32 states m, v.
cudaError_t adam32(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n,
                   cudaStream_t stream);

}  // namespace memtune::trainer::bnb_cuda
