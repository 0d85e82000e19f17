#pragma once
// RMSNorm, SwiGLU's gate and GELU as single autograd nodes. Written as chains of ATen ops,
// autograd keeps every intermediate (RMSNorm: x, x^2, the rsqrt, the normalised rows;
// SwiGLU: gate, silu(gate), up) and walks one node per op; here the forward keeps only what
// the backward cannot cheaply rebuild, and the backward is a few fused expressions. On a
// CUDA device (fp32, fp16, bf16) each direction is one kernel (models/layers/cuda/), with
// Hugging Face's roundings in bf16 and fp16.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace memtune::models {

// Hugging Face's LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)).to(x's dtype), the
// statistics in fp32. Keeps x and one fp32 value per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Gemma's RMSNorm (GemmaRMSNorm, Gemma3RMSNorm): (x / sqrt(mean(x^2) + eps)) * (1 + weight)
// in fp32, rounded once to x's dtype. Keeps x and one fp32 value per row.
at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Gemma's GeGLU, gelu(gate) * up in their dtype: GELU with tanh's approximation
// (gelu_pytorch_tanh) or exact (gelu). Keeps gate and up; gelu(gate) is rebuilt in backward.
at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, bool tanh_approximation);

// silu(gate) * up, in their dtype. Keeps gate and up; silu(gate) is rebuilt in backward.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// GELU with tanh's approximation (Hugging Face's gelu_new and gelu_pytorch_tanh, GPT-2's
// activations; ATen's gelu(approximate="tanh")): on fp32 CPU tensors one node with memtune's
// kernels, elsewhere at::gelu, which keeps x. `as_written` (gelu_new) on a 16-bit x: the
// formula op by op, as transformers' NewGELUActivation rounds it (it keeps four tensors of x's
// size, and holds at most two more while it runs).
at::Tensor gelu_tanh(const at::Tensor& x, bool as_written = false);

// Their memory at `rows` rows (models/memory.h), elements of `elem_bytes`: what each keeps
// for backward, and the transient of SwiGLU's backward (sigmoid(gate) rebuilt, both
// gradients formed, in fp32). at::layer_norm (GPT-2) keeps x and fp32 mean and rstd per
// row; at::gelu keeps its input.
inline int64_t rms_norm_kept(int64_t rows, int64_t width, int64_t elem_bytes) { return rows * width * elem_bytes + rows * 4; }
inline int64_t layer_norm_kept(int64_t rows, int64_t width, int64_t elem_bytes) {
  return rows * width * elem_bytes + 2 * rows * 4;
}
inline int64_t swiglu_kept(int64_t rows, int64_t width, int64_t elem_bytes) { return 2 * rows * width * elem_bytes; }
// SwiGLU's backward at its widest: memtune's kernels (CUDA in every dtype, the CPU in fp32)
// write the two gradients alone, in their dtype; ATen's ops (bf16 and fp16 on the CPU) form
// up's gradient, gy * up and gate's gradient from it, counted in fp32 (norm_act.cpp).
inline int64_t swiglu_backward_transient(int64_t rows, int64_t width, int64_t elem_bytes, bool cuda_kernel) {
  return cuda_kernel || elem_bytes == 4 ? 2 * rows * width * elem_bytes : 3 * rows * width * 4;
}
inline int64_t gelu_backward_transient(int64_t rows, int64_t width) { return rows * width * 4; }
// GeGLU's backward at its widest: gy * up, gate's gradient and up's (gelu(gate) rebuilt), in
// the dtype.
inline int64_t geglu_backward_transient(int64_t rows, int64_t width, int64_t elem_bytes) {
  return 3 * rows * width * elem_bytes;
}

}  // namespace memtune::models
