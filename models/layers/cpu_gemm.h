#pragma once
// A register-tiled fp32 GEMM for the CPU products BLAS serves badly: many small ones
// (attention's tiles, models/layers/attention_cpu.h) and narrow ones (a LoRA adapter's
// rank-r products, models/layers/lora_linear.cpp), which OpenBLAS runs at a third of its
// peak or less (a 16-wide output split over two threads). The left operand is read in place
// with any strides; the right one is packed, as BLAS libraries pack it, into column panels
// of 16. AVX-512 where the CPU has it, else AVX2 + FMA (cpu_vec.h's choice), portable C++
// elsewhere: memtune's own kernels take the widest registers whatever core type OpenBLAS
// was told to use.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace memtune::models::detail {

constexpr int64_t kPanelLanes = 16;  // columns of a packed panel: two 8-float registers

// The left operand A (M x K) in place: element (i, k) at p[i * row + k * col] (row-major:
// row = ld, col = 1; transposed storage: row = 1, col = ld).
struct Left {
  const float* p;
  int64_t row, col;
  float at(int64_t i, int64_t k) const { return p[i * row + k * col]; }
};
inline Left rows_of(const float* p, int64_t ld) { return {p, ld, 1}; }
inline Left columns_of(const float* p, int64_t ld) { return {p, 1, ld}; }

// The right operand B (K x N) packed: panel q holds rows k = 0..K-1 of columns 16q..16q+15
// contiguously (zero past N). The kernel then streams B in order whatever the source strides
// were (heads in a (B,T,H*D) tensor sit a power of two apart, which maps a panel's rows onto
// a few L1 sets).
struct Panels {
  const float* p;
  int64_t stride;  // floats from one panel to the next
  const float* at(int64_t q, int64_t k) const { return p + q * stride + k * kPanelLanes; }
};

// Floats a packing of K x N into panels of `stride` >= K rows takes.
inline int64_t panel_floats(int64_t stride, int64_t N) {
  return (N + kPanelLanes - 1) / kPanelLanes * stride * kPanelLanes;
}

// Packs alpha * B (K x N), element (k, n) at src[k * row + n * col], into panels of
// `stride` >= K rows at dst (panel_floats(stride, N) floats).
Panels pack_panels(const float* src, int64_t row, int64_t col, int64_t K, int64_t N, int64_t stride, float* dst,
                   float alpha = 1.0f);

// C (M x N, row-major, ldc) = A (M x K) * B (K x N), or += with `acc`. Each row of C is
// formed alone, its sums over k in order: how rows are split among threads does not change
// a bit of the result.
using GemmFn = void (*)(int64_t M, int64_t N, int64_t K, Left A, Panels B, float* C, int64_t ldc, bool acc);

// The GEMM this CPU runs best.
GemmFn gemm_kernel();

// ---- Narrow products on tensors -----------------------------------------------------------
// Whether narrow_mm takes a (M x K) and b (K x N): CPU float32 2-d tensors, b no wider than
// 64 columns (a LoRA rank: its packing is then small next to the products), and the vector
// kernels active. Elsewhere callers use ATen. (A product narrow in K instead, r-deep, is
// bound by memory, not arithmetic: BLAS serves it as well.)
bool narrow_mm_applies(const at::Tensor& a, const at::Tensor& b);

// out = alpha * a b (out undefined: a new tensor), or out += alpha * a b with `accumulate`;
// out row-major (its last stride 1) or column-major (its first: a transposed view, the same
// bits stored across). Rows are spread over the intra-op threads. Returns out.
at::Tensor narrow_mm(const at::Tensor& a, const at::Tensor& b, double alpha = 1.0, at::Tensor out = {},
                     bool accumulate = false);

}  // namespace memtune::models::detail
