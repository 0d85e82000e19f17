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

// The frozen base: exactly one of `dense` ([out, in]) or `nf4` is set.
struct FrozenWeight {
  at::Tensor dense;
  std::shared_ptr<const NF4Tensor> nf4;
};

// What an adapter of rank r on a projection of `in` features keeps for backward at `rows`
// rows (models/memory.h): x A^T (fp32), and with dropout the dropped input (fp32, the
// adapter's input) and, where keyed_dropout keeps one (`mask`: a GPU, or fp16/bf16 on the
// CPU: keyed_dropout_keeps_mask), its boolean mask.
inline int64_t lora_kept(int64_t rows, int64_t in, int64_t r, double dropout, bool mask) {
  return r > 0 ? rows * r * 4 + (dropout > 0 ? rows * in * (4 + (mask ? 1 : 0)) : 0) : 0;
}

// x (..., in); adapter_input: what the adapter sees, x after LoRA dropout (undefined: x
// itself, and grad_x sums both paths in one GEMM); bias [out] or undefined; A [r, in],
// B [out, r]. Every tensor on one device, in one dtype, except that A and B may be fp32 on a
// 16-bit x and W (PEFT's adapters on a bf16 or fp16 model: autocast_adapter_dtype): then the
// adapter takes its input in fp32 and, as PEFT's forward (without autocast), the sum with a
// dense base is formed in fp32 and rounded once, while on a 4-bit base the adapter's output is
// rounded to x's dtype and then added (PEFT's bnb Linear4bit); the adapter input, when given,
// is then fp32 too. Gradients flow to x, the adapter input, A, B and a bias that requires one;
// W gets none. Memory beyond lora_kept in that mixed form: the fp32 copies of x or of the output
// while the node runs, 6 bytes per element of the wider of the two (lora_mixed_transient).
inline int64_t lora_mixed_transient(int64_t rows, int64_t in, int64_t out) {
  return rows * std::max(in, out) * 6;
}
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& adapter_input, const FrozenWeight& w,
                       const at::Tensor& bias, const at::Tensor& A, const at::Tensor& B, double scaling,
                       Nf4MatmulPath path = Nf4MatmulPath::kAuto);

}  // namespace memtune::models
