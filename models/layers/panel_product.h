#pragma once
// The CPU products of a frozen quantized weight W [out, in] with its rows dequantized a panel
// at a time into one reused buffer (NF4's and LLM.int8's layers): no dense copy of W lives
// during the op, only a panel of `rows` rows.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace memtune::models {

// Bytes of one dequantized panel of W, the only dense piece of W alive at any time. Each
// panel's GEMM packs x again, so panels must be large: on the 2-core machine of
// bench/nf4_bench.cpp (2026-11-22) 16 MiB panels ran at 1.14x/1.25x a dense Linear
// (4096x4096 / 11008x4096, 512 tokens), 4 MiB at 1.50x/1.34x, and dequantizing all of W
// then one GEMM at 1.2x-1.4x.
constexpr int64_t kPanelBytes = int64_t{16} << 20;

// Rows of W [*, in] in one panel of `elem_bytes` elements (at least one).
inline int64_t panel_rows(int64_t in, int64_t elem_bytes) {
  return kPanelBytes / (in * elem_bytes) > 0 ? kPanelBytes / (in * elem_bytes) : 1;
}

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
