#pragma once
// DoRA, weight-decomposed low-rank adaptation (Liu et al. 2024), as PEFT computes it for
// use_dora: a trained magnitude m per output row rescales the adapted weight to it,
//   W' = m * (W + s B A) / n,   n = ||W + s B A|| over each row, treated as a constant
// (detached from the gradient, the paper's section 4.3). PEFT writes it as a correction to
// the base's output, so that the frozen base still multiplies x:
//   y = base(x) + (m / n - 1) * (x W^T) + (m / n) * s * (x A^T) B^T
// where x W^T is the base's output without its bias, or, with LoRA dropout in training, the
// product of the dropped input with W (DoraLinearLayer.forward). Linear::forward_dora
// (models/layers/linear.cpp) follows it op by op, so that dtypes promote where PyTorch's do.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace memtune::models {

// Rows of W per block of dora_weight_norm: about 4 MiB of fp32 rows.
inline int64_t dora_norm_rows(int64_t in) { return std::max<int64_t>(1, (int64_t{4} << 20) / (4 * std::max<int64_t>(in, 1))); }

// n = ||W + s B A|| row by row, fp32 [out], no gradient. `rows(r0, k)` gives W's rows
// [r0, r0 + k) as fp32 [k, in]. B A is formed in `product_dtype` (the adapter's fp32, or
// autocast's 16 bits, as PEFT's lora_B(lora_A(eye)) under it) and widened to fp32. The
// rows go a block of dora_norm_rows at a time, so that W + s B A is never whole.
at::Tensor dora_weight_norm(const std::function<at::Tensor(int64_t, int64_t)>& rows, int64_t out, const at::Tensor& A,
                            const at::Tensor& B, double scaling, at::ScalarType product_dtype);

// What a DoRA adapter keeps for backward at `rows` rows beside lora_kept: the base's output
// without its bias (`base_bytes` an element) and the adapter's output (`adapter_bytes`), each
// rows x out, which the magnitude's gradient multiplies.
inline int64_t dora_kept(int64_t rows, int64_t out, int64_t base_bytes, int64_t adapter_bytes) {
  return rows * out * (base_bytes + adapter_bytes);
}

// DoRA's largest transient in a forward: one block of W's rows, of B A and of their sum in
// fp32 (dora_weight_norm), or, where the forward forms whole tensors, the scaled adapter output
// and the correction's two terms (rows x out in fp32 each) beside the base's output.
inline int64_t dora_transient(int64_t rows, int64_t in, int64_t out) {
  const int64_t block = std::min(out, dora_norm_rows(in));
  return std::max(3 * block * in * 4, 3 * rows * out * 4);
}

}  // namespace memtune::models
