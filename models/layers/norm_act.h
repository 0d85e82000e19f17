#pragma once
// RMSNorm and SwiGLU's gate as single autograd nodes. Written as chains of ATen ops,
// autograd keeps every intermediate (RMSNorm: x, x^2, the rsqrt, the normalised rows;
// SwiGLU: gate, silu(gate), up) and walks one node per op; here the forward keeps only what
// the backward cannot cheaply rebuild, and the backward is a few fused expressions.
#include <ATen/core/Tensor.h>

namespace memtune::models {

// Hugging Face's LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)).to(x's dtype), the
// statistics in fp32. Keeps x and one fp32 value per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up, in their dtype. Keeps gate and up; silu(gate) is rebuilt in backward.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace memtune::models
