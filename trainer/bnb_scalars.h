#pragma once
// The fp32 scalars bitsandbytes' AdamW kernels (8-bit blockwise and 32-bit) derive from the
// step, learning rate and betas, computed once per tensor update on the host. Free of
// LibTorch headers: the CUDA kernels (trainer/cuda/) take it as a kernel argument.
#include <cstdint>

namespace memtune::trainer {

struct BnbScalars {
  float b1, b2, one_minus_b1, one_minus_b2;
  float eps_c2;     // eps * sqrt(1 - b2^t) (the 8-bit kernel's correction2 * eps)
  float step_size;  // -lr * sqrt(1 - b2^t) / (1 - b1^t)
  float decay;      // 1 - lr * weight_decay, applied when decay_on
  float gs;         // gradient scale
  bool decay_on;
  BnbScalars(int64_t step, double lr, double beta1, double beta2, double eps, double wd, double grad_scale);
};

}  // namespace memtune::trainer
