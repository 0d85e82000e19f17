#pragma once
// y = x @ deq(W)^T (+ b) for a frozen NF4 weight W [out, in], in the compute dtype
// (bnb_4bit_compute_dtype). Autograd keeps only the quantized state of W for backward
// (never a dense copy) and dequantizes again there to form grad_x; W gets no gradient.
#include <ATen/core/Tensor.h>

#include <memory>

#include "runtime/nf4.h"

namespace memtune::models {

// How the CPU forms x @ deq(W)^T and grad_y @ deq(W).
enum class Nf4MatmulPath {
  kAuto,                  // kPanels on the CPU (measured faster, see bench/nf4_bench.cpp)
  kDequantizeThenMatmul,  // dequantize all of W, one GEMM; a dense W lives during the op
  kPanels,                // dequantize row panels of W into a reused buffer, GEMM per panel
};

// x (..., in), bias [out] or undefined -> (..., out) in compute_dtype.
at::Tensor linear4bit(const at::Tensor& x, const std::shared_ptr<const NF4Tensor>& w, const at::Tensor& bias,
                      at::ScalarType compute_dtype, Nf4MatmulPath path = Nf4MatmulPath::kAuto);

}  // namespace memtune::models
