#pragma once
// The optimizer step's passes over fp32 tensors on a CUDA device, many tensors a launch
// (optim_cuda_kernels.cu), on raw device pointers so that nvcc compiles no LibTorch header;
// trainer/cuda/optim_cuda.cpp checks the tensors and calls these. The CUDA twins of
// trainer/optim_kernels.h:
// - torch.optim.AdamW's update (adamw_torch), operation for operation torch_adamw_scalar (one
//   fp32 rounding each, no fused multiply-add), so the states and parameters equal the CPU's
//   to the bit;
// - the gradients' sum of squares that gradient clipping reads, in double as square_sum.
//
// Why many tensors a launch: LoRA on an 8B model trains 448 small tensors. ATen's op chains
// took nine kernels per tensor for the update and four for the sum of squares (the last
// through an fp64 copy of each gradient): about 5,800 launches a step, each moving a few
// hundred KiB.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "trainer/optim_kernels.h"

namespace memtune::trainer::optim_cuda {

// Tensors per launch: their pointers travel in the kernel's argument (CUDA's 4 KiB).
inline constexpr int kMaxTensors = 40;

struct AdamWTensor {
  float* p;
  float* g;  // written back (scaled) only when s.scale is not 1, as torch_adamw_scalar
  float* m;
  float* v;
  int64_t n;
  float decay;  // 1 - lr * weight_decay of this tensor (s.decay is not read)
};

// Updates tensors[0, count), count <= kMaxTensors, on `stream`.
cudaError_t torch_adamw(const TorchAdamW& s, const AdamWTensor* tensors, int count, cudaStream_t stream);

// Sum of squares: each kSquareSumChunkCuda elements of a tensor (its last chunk partial) sum
// their squares, in double, into one partial, written in tensor and chunk order to
// `partials`, which must hold square_sum_partials(n) of each tensor's n. The partials' own
// sum is the caller's (one reduction for all of them).
int64_t square_sum_partials(int64_t n);
cudaError_t square_sums(const float* const* xs, const int64_t* ns, int count, double* partials, cudaStream_t stream);

}  // namespace memtune::trainer::optim_cuda
