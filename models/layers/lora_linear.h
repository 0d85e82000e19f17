#pragma once
// y = x W^T + b + s (x A^T) B^T, a LoRA adapter on a frozen base W, as one autograd node.
//
// Written as separate ops, the adapter adds three full-size passes to the forward (the
// product x A^T B^T, its scaling, the sum with the base) and as many to the backward. Here
// the adapter's product accumulates into the base's output inside the GEMM (beta = 1,
// alpha = s), the scaling lands on the narrow r-wide side of every product, and grad_x
// sums both paths in one GEMM. Memory: the node keeps x and x A^T [M, r]; a dense W is
// kept by reference, an NF4 W as its quantized state (dequantized again in backward).
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "models/layers/linear4bit.h"

namespace memtune::models {

// The frozen base: one of `dense` ([out, in]) or `nf4` is set (neither: the adapter alone).
struct FrozenWeight {
  at::Tensor dense;
  std::shared_ptr<const NF4Tensor> nf4;
};

// What an adapter of rank r on a projection of `in` x `out` features keeps for backward at
// `rows` rows (models/memory.h), its products in `bytes` per element (4: fp32; 2: 16-bit
// under autocast, models::Linear::autocast): x A^T; its own copy of the input where it keeps
// one (`own_input`: LoRA dropout's dropped input, or the 16-bit cast of an fp32 model's);
// LoRA dropout's boolean mask where keyed_dropout keeps one (`mask`: for the adapter's fp32
// input, on a GPU: keyed_dropout_keeps_mask); in 16 bits the copies of A and B.
inline int64_t lora_kept(int64_t rows, int64_t in, int64_t out, int64_t r, bool own_input, bool mask,
                         int64_t bytes) {
  if (r <= 0) return 0;
  return rows * r * bytes + (own_input ? rows * in * bytes : 0) + (mask ? rows * in : 0) +
         (bytes != 4 ? r * (in + out) * bytes : 0);
}
// Under autocast, with LoRA dropout: the input taken to fp32 (a copy unless it is fp32) and
// dropped there, as PEFT drops it, while its 16-bit cast is made.
inline int64_t lora_autocast_dropout_transient(int64_t rows, int64_t in, int64_t act_bytes) {
  return rows * in * ((act_bytes != 4 ? 4 : 0) + 4 + 2);
}

// Memory beyond lora_kept of an fp32 adapter on a 16-bit x outside autocast (lora_linear's
// mixed form): the fp32 copies of x or of the output while the node runs, 6 bytes per element
// of the wider of the two.
inline int64_t lora_mixed_transient(int64_t rows, int64_t in, int64_t out) {
  return rows * std::max(in, out) * 6;
}

// x (..., in); adapter_input: what the adapter sees, x after LoRA dropout (undefined: x
// itself, and grad_x sums both paths); bias [out] or undefined; A [r, in], B [out, r]; with
// neither a dense nor an NF4 weight (and no bias), the adapter alone: s (x A^T) B^T.
// Gradients flow to x, the adapter input, A, B and a bias that requires one; W gets none.
// Every tensor on one device, in one dtype, except fp32 A and B on a 16-bit x and W (PEFT's
// adapters on a bf16 or fp16 model: autocast_adapter_dtype). How those multiply:
//  - `autocast` (the Trainer's, models::Linear::autocast): through 16-bit copies in x's
//    dtype, as PEFT's under torch.autocast: each product rounded, the output scaled and
//    added in 16 bits, grad_x's two paths rounded, then summed. A's and B's gradients are
//    the same 16-bit products summed in fp32 (product_fp32.h), not rounded to 16 bits, so
//    that they do not depend on how a step's rows are split into micro-batches.
//  - without autocast (the mixed form), in fp32, as PEFT's forward without it: the adapter
//    takes its input (and the adapter input) in fp32; the sum with a dense base is formed in
//    fp32 and rounded once, while on a 4-bit base the adapter's output is rounded to x's
//    dtype and then added (PEFT's bnb Linear4bit).
// 16-bit A and B multiply as under autocast, their gradients in 16 bits.
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& adapter_input, const FrozenWeight& w,
                       const at::Tensor& bias, const at::Tensor& A, const at::Tensor& B, double scaling,
                       Nf4MatmulPath path = Nf4MatmulPath::kAuto, bool autocast = false);

namespace detail {
// y (M, N) += s (a b) for a (M, r) and b (r, N), all three in one 16-bit dtype, rounded as
// PEFT's `result + lora_B(lora_A(x)) * scaling` in 16 bits rounds it: the product rounded,
// scaled (rounded) and added. On CUDA one kernel forms each short product where it reads y
// and sums it over k in order (models/layers/cuda/lora_cuda_kernels.h); elsewhere ATen's
// product, then the scaled sum.
void add_adapter_output(at::Tensor& y, const at::Tensor& a, const at::Tensor& b, double s);
}  // namespace detail

}  // namespace memtune::models
