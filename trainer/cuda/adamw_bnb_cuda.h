#pragma once
// bitsandbytes' AdamW updates for parameters and states on one CUDA device
// (trainer/cuda/adamw_bnb_cuda.cpp, built only with CUDA): trainer/optimizer.cpp calls these
// under MEMTUNE_CUDA. Every tensor contiguous fp32 (codes uint8) on the parameter's device;
// nothing is allocated, so an out-of-memory error cannot interrupt an update half way.
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/bnb_scalars.h"

namespace memtune::trainer {

// Whether the update of p (with gradient g and these states) can run on p's CUDA device:
// all contiguous, fp32 (the 8-bit codes uint8), on that device.
bool bnb_cuda_applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& states);

// adamw_8bit: c1, c2 the codes, absmax1, absmax2 fp32 per 256 elements.
void bnb_adam8_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& c1,
                    const at::Tensor& c2, const at::Tensor& absmax1, const at::Tensor& absmax2);
// adamw_32bit (and adamw_8bit's tensors under 4096 elements): fp32 m, v.
void bnb_adam32_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v);

}  // namespace memtune::trainer
