#pragma once
// The CPU products of a frozen quantized weight W [out, in] with its rows dequantized a panel
// at a time into one reused buffer (NF4's and LLM.int8's layers): no dense copy of W lives
// during the op, only a panel of `rows` rows.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace memtune::models {

// Writes W's rows [r0, r0 + r) dequantized into `panel` (r * in contiguous elements, the
// product's dtype).
using FillPanel = std::function<void(int64_t r0, int64_t r, at::Tensor& panel)>;

// y [M, out] = x [M, in] @ W^T (+ bias [out], added inside the GEMM): each panel multiplied
// into its columns of y, so each output element is the sum one GEMM over W forms.
at::Tensor panel_matmul_wt(const at::Tensor& x, int64_t out, int64_t in, int64_t rows, const at::Tensor& bias,
                           const FillPanel& fill);

// gx [M, in] = g [M, out] @ W, the panels' products summed into gx in its dtype (fp32: a
// 16-bit gx would be rounded once per panel).
at::Tensor panel_matmul_w(const at::Tensor& g, int64_t out, int64_t in, int64_t rows, const FillPanel& fill);

}  // namespace memtune::models
