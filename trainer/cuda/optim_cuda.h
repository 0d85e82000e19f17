#pragma once
// The optimizer step's passes over fp32 tensors on CUDA devices, many tensors a launch
// (trainer/cuda/optim_cuda.cpp, built only with CUDA; the kernels:
// trainer/cuda/optim_cuda_kernels.h): trainer/optimizer.cpp calls these under MEMTUNE_CUDA.
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/optim_kernels.h"

namespace memtune::trainer {

// torch.optim.AdamW's update, the same bits as the CPU's kernel (trainer/optim_kernels.h).
// Nothing is allocated, so an out-of-memory error cannot interrupt an update half way.
//
// Whether the update of p (gradient g, states m and v) can run in the kernel: p on a CUDA
// device, everything there, fp32, contiguous, of p's size.
bool torch_adamw_cuda_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v);

struct AdamWCudaTensor {
  at::Tensor p, g, m, v;
  float decay;  // 1 - lr * weight_decay of this tensor
};

// Updates every tensor with s's scalars (s.decay is each tensor's own): grouped by device, at
// most optim_cuda::kMaxTensors a launch, on each device's current stream.
void torch_adamw_cuda(const TorchAdamW& s, const std::vector<AdamWCudaTensor>& tensors);

// The sum of the squares of `xs` (fp32, contiguous, all on one CUDA device: each
// square_sum_cuda_applies), in double, as a 0-dim tensor on that device, not read here: the
// caller reads each device's sum once. It allocates square_sum_cuda_scratch(n) bytes per
// tensor of n elements (trainer/optim_kernels.h) for the partial sums; the partials are added
// by one ATen sum, so the result is the same bits on every run of the same tensors.
bool square_sum_cuda_applies(const at::Tensor& x);
at::Tensor square_sum_cuda(const std::vector<at::Tensor>& xs);

}  // namespace memtune::trainer
