#pragma once
// y = x @ W^T (+ b) for a frozen LLM.int8 weight (runtime/int8.h), as bitsandbytes'
// Linear8bitLt computes it: dequantize then multiply on a CPU in training (its MatMul8bitFp),
// the mixed int8 product with outlier columns elsewhere (MatMul8bitLt: a GPU, or a CPU in
// evaluation). Autograd keeps only the 8-bit weight for backward (bitsandbytes keeps the input
// too, which a frozen weight does not need) and forms grad_x = g @ deq(W) in x's dtype there.
#include <ATen/core/Tensor.h>

namespace memtune::models {

struct Int8Weight {
  at::Tensor codes;   // CB: int8 [out, in]
  at::Tensor absmax;  // SCB: fp32 [out]
  double threshold = 6.0;  // llm_int8_threshold; 0: no outlier columns
};

// Which product the forward forms.
enum class Int8Product {
  kAuto,        // bitsandbytes' choice: kDequantize on a CPU in training, kMixed otherwise
  kDequantize,  // y = x @ deq(W)^T + b in the product dtype
  kMixed,       // LLM.int8's mixed product (CUDA kernels' flavour on a GPU, default ops' on a CPU)
};

// x (..., in); bias [out] (x's dtype) or undefined; `autocast`: the dtype of the Trainer's
// fp16 / bf16 autocast when on, else Undefined (the products run in x's dtype). Returns
// (..., out) in x's dtype or, under autocast, in the dtype autocast gives bitsandbytes' ops.
at::Tensor linear8bit(const at::Tensor& x, const Int8Weight& w, const at::Tensor& bias, bool training,
                      at::ScalarType autocast = at::ScalarType::Undefined, Int8Product product = Int8Product::kAuto);

// Bytes of dequantized weight a CPU's training product holds while it runs, for W [out, in]:
// forward a panel of rows in the product's dtype (`compute_bytes`; float16 takes the whole
// W), backward a panel in fp32 or the whole W in a 16-bit input dtype (`input_bytes`).
int64_t int8_panel_bytes(int64_t out, int64_t in, int64_t compute_bytes, int64_t input_bytes);

// The product kAuto picks for a weight on `device`.
Int8Product int8_product(const c10::Device& device, bool training);

}  // namespace memtune::models
