#pragma once
// 8-bit weights as bitsandbytes' LLM.int8 keeps them (Linear8bitLt with has_fp16_weights
// False, what transformers' load_in_8bit builds), and the two products bitsandbytes forms
// with them. Written from bitsandbytes' Int8Params, MatMul8bitLt / MatMul8bitFp and their
// default and CUDA ops; tests/reference/int8_reference.py is the independent reference.
//
// A weight W [out, in] is cast to float16 and quantized row by row:
//   SCB[r] = max_j |W16[r, j]| (fp32), CB[r, j] = round(W16[r, j] * (reciprocal(SCB[r]) * 127))
// (int8), round half to even, a zero row all zeros. The scale is the default ops'
// `127.0 / SCB` as torch evaluates it and the CUDA kernel's __fdividef (a * (1/b)) with its
// reciprocal correctly rounded. Dequantized: CB * (SCB * (1 / 127)), one rounding
// to the dtype asked for from the fp32 product.
//
// The products with an input A [rows, in] of dtype D:
//  - dequantize then multiply: y = A @ deq_D(W)^T + b. bitsandbytes' matmul() takes it on a
//    CPU in training (MatMul8bitFp).
//  - LLM.int8's mixed product, everywhere else (MatMul8bitLt): A is cast to float16; with a
//    threshold t > 0 the columns holding any |a| >= t (the outlier columns) are taken out;
//    every row is quantized like a weight row (outliers excluded from its absmax, and zero);
//    the int8 product is summed exactly in int32 and scaled back by SCA[i] * SCB[j] / 127^2
//    to float16 (the bias added there), then D; the outlier columns are added back as
//    A[:, cols] @ deq(W[:, cols])^T in D. The CUDA kernels and the default (CPU) ops differ in
//    the last steps (the constant, the order of the products, a fused fp16 bias): both are
//    here, Int8Flavour picks one.
// The gradient of the input is, on every path, g @ deq_D(W), as MatMul8bitLt's backward.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace memtune {

// LLM.int8's default outlier threshold (BitsAndBytesConfig.llm_int8_threshold).
constexpr double kInt8DefaultThreshold = 6.0;

struct Int8Rows {
  at::Tensor codes;   // CB: int8 [out, in]
  at::Tensor absmax;  // SCB: fp32 [out], the float16 weight's row absmax
};

// Int8Params' quantization of a 2-D float32 / bfloat16 / float16 weight [out, in] on its
// device. `name` labels errors. Throws UserError for a value that is not finite in float16
// (bitsandbytes casts the weight to float16 first: |w| > 65504 becomes inf).
Int8Rows int8_quantize_rows(const at::Tensor& w, const std::string& name);

// CB * (SCB * (1/127)) in `dtype` [out, in], as MatMul8bitFp and MatMul8bitLt's backward form it.
at::Tensor int8_dequantize(const at::Tensor& codes, const at::Tensor& absmax, at::ScalarType dtype);

// Rows [r0, r0 + n) of the dequantized weight into `out` (a contiguous CPU tensor of n * in
// elements, float32 / bfloat16 / float16): int8_dequantize's values, by a parallel loop over
// the rows (for fused use: a panel of rows at a time).
void int8_dequantize_rows_into(const at::Tensor& codes, const at::Tensor& absmax, int64_t r0, int64_t n,
                               at::Tensor& out);

// The int32 product a [m, k] @ b [n, k]^T of two int8 matrices, exact on any device: fp32
// products over slices of k short enough (1024) that every partial sum is an integer below
// 2^24, summed in int32. (cuBLAS's fp32 GEMM must not use TF32, LibTorch's default.)
at::Tensor int8_matmul_i32(const at::Tensor& a, const at::Tensor& b);

enum class Int8Flavour {
  kCuda,     // bitsandbytes' CUDA kernels (kInt8VectorQuant, kdequant_mm_int32_fp16)
  kDefault,  // its default ops (a CPU outside training)
};

// The steps of the mixed product, for tests.
struct Int8MixedParts {
  at::Tensor codes;         // CA: int8 [rows, in]
  at::Tensor absmax;        // SCA: fp32 [rows]
  at::Tensor outlier_cols;  // int64, ascending (empty without outliers)
  at::Tensor i32;           // CA @ CB^T, int32 [rows, out]
  at::Tensor base;          // the int8 product scaled back, bias included, in a's dtype
};

// LLM.int8's mixed product of a [rows, in] (float32 / bfloat16 / float16) with the 8-bit
// weight, bias [out] (a's dtype, or float16 / bfloat16 / float32) or undefined. `autocast`
// other than Undefined: the dtype of a torch.autocast region around it, which takes the
// outlier columns' addmm (only that: bitsandbytes' own ops are not autocast). Returns
// [rows, out] in a's dtype (in `autocast` when outlier columns were added under it).
at::Tensor int8_mixed_matmul(const at::Tensor& a, const at::Tensor& codes, const at::Tensor& absmax,
                             const at::Tensor& bias, double threshold, Int8Flavour flavour,
                             at::ScalarType autocast = at::ScalarType::Undefined, Int8MixedParts* parts = nullptr);

// c + a @ b in c's dtype; float16 on a CPU, which has no float16 GEMM, as fp32 sums rounded
// once (what cuBLAS does).
at::Tensor int8_addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b);

// Bytes an 8-bit weight [out, in] keeps: the codes and the fp32 row absmax.
inline int64_t int8_storage_bytes(int64_t out, int64_t in) { return out * in + 4 * out; }

}  // namespace memtune
