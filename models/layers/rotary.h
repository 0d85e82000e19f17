#pragma once
// Rotary position embeddings (RoPE) in Hugging Face's rotate_half layout as one autograd
// node: x * cos + rotate_half(x) * sin, where rotate_half([x1, x2]) = [-x2, x1] over the
// two halves of the head dimension. Written as ATen ops it is five passes forward (two
// products, a negation, a concatenation, a sum) and as many backward; here one pass each
// way on the CPU (fp32) and on CUDA (fp32, fp16, bf16: models/layers/cuda/), and nothing
// of x is kept (the rotation's backward needs cos and sin only).
#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

#include "models/model_spec.h"

namespace memtune::models {

// x (B,T,H,D), cos and sin (B,T,1,D) or (B,T,D), D even. Returns (B,T,H,D) in x's dtype.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The (head_dim / 2) fp32 inverse frequencies of base `theta` after `scaling` (linear,
// llama3, yarn; dynamic within max_position_embeddings is the plain embedding), as
// transformers' rope init functions compute them.
at::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling);
// The scale of cos and sin (yarn's attention factor; 1 otherwise), transformers' attention_scaling.
double rope_attention_factor(const RopeScaling& scaling);
// cos and sin (B,T,1,D) fp32, times `scale`, of frequencies `inv_freq` (D/2) at `position_ids`
// (B,T): the tables apply_rotary takes, broadcast over heads.
std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& position_ids, const at::Tensor& inv_freq,
                                                double scale);

}  // namespace memtune::models
