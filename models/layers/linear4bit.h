#pragma once
// y = x @ deq(W)^T (+ b) for a frozen NF4 weight W [out, in], in the compute dtype
// (bnb_4bit_compute_dtype). Autograd keeps only the quantized state of W for backward
// (never a dense copy) and dequantizes again there to form grad_x; W gets no gradient.
#include <ATen/core/Tensor.h>

#include <memory>

#include "runtime/nf4.h"

namespace torch::autograd {
struct AutogradContext;
}

namespace memtune::models {

// How the CPU forms x @ deq(W)^T and grad_y @ deq(W).
enum class Nf4MatmulPath {
  kAuto,                  // kPanels on the CPU (measured faster, see bench/nf4_bench.cpp)
  kDequantizeThenMatmul,  // dequantize all of W, one GEMM; a dense W lives during the op
  kPanels,                // dequantize row panels of W into a reused buffer, GEMM per panel
};

// The two products with a frozen NF4 W [out, in], x and g 2-D in the compute dtype ct:
// y [M, out] = x [M, in] @ deq(W)^T (+ bias [out], added inside the GEMM as F.linear does)
// and gx [M, in] = g [M, out] @ deq(W).
at::Tensor nf4_matmul_wt(const at::Tensor& x, const NF4Tensor& q, at::ScalarType ct, Nf4MatmulPath path,
                         const at::Tensor& bias = {});
at::Tensor nf4_matmul_w(const at::Tensor& g, const NF4Tensor& q, at::ScalarType ct, Nf4MatmulPath path);

// Bytes of the dequantized panel the CPU products hold while they run, for a W [out, in]
// in the compute dtype of `elem_bytes` (the memory model's transient, models/memory.h): all
// of W in 16-bit dtypes, whose backward takes one GEMM.
int64_t nf4_panel_bytes(int64_t out, int64_t in, int64_t elem_bytes);

// Keeps W's quantized state (its tensors share storage, nothing is copied) in an autograd
// node's saved data for its backward, and gets it back there.
void save_nf4(torch::autograd::AutogradContext* ctx, const NF4Tensor& q);
NF4Tensor load_nf4(torch::autograd::AutogradContext* ctx);

// x (..., in), bias [out] or undefined -> (..., out) in compute_dtype.
at::Tensor linear4bit(const at::Tensor& x, const std::shared_ptr<const NF4Tensor>& w, const at::Tensor& bias,
                      at::ScalarType compute_dtype, Nf4MatmulPath path = Nf4MatmulPath::kAuto);

}  // namespace memtune::models
