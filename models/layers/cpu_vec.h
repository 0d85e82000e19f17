#pragma once
// Row kernels for fp32 on the CPU that attention and the loss share: AVX2 + FMA where the
// CPU has them (chosen once at run time), portable C++ elsewhere.
#include <cstdint>

namespace memtune::models::detail {

// x[j] = exp(x[j] * scale - shift) for j < n, in place; returns their sum.
float exp_shift_sum(float* x, int64_t n, float scale, float shift);

// The largest of n >= 1 values (exact: a max rounds nothing, in any order). NaNs are not
// ordered: a row holding one may give NaN, another of its values or -inf.
float row_max(const float* x, int64_t n);

// A softmax row's pieces in two passes: *max = max x, then x[j] = exp(x[j] - max) in place
// and *sum = their sum. Returns the first index holding the maximum, -1 where no element
// equals the maximum found (always for a row of NaNs; maybe for a row holding one).
int64_t exp_row_from_max(float* x, int64_t n, float* max, float* sum);

// SwiGLU on n fp32 elements, in the roundings of ATen's ops (silu(g) = g / (1 + exp(-g)),
// then the product): y = silu(g) * u.
void swiglu_forward(const float* g, const float* u, float* y, int64_t n);
// Its gradients as autograd forms them through `silu(g) * u`: du = silu(g) * gy and
// dg = silu_backward(gy * u, g) = (gy * u) * s * (1 + g * (1 - s)), s = 1 / (1 + exp(-g)).
// A null dg or du is not written.
void swiglu_backward(const float* g, const float* u, const float* gy, float* dg, float* du, int64_t n);

// Gemma 2's soft-capping of n fp32 scores in place, as transformers' eager attention: u = x
// scale / cap, x = cap tanh(u); th (when not null) receives tanh(u). The AVX2 form's tanh is
// within about 1e-7 of std::tanh (absolute; relative under 3e-9 where |u| < 1/4).
void soft_cap(float* x, int64_t n, float scale, float cap, float* th);

// GELU with tanh's approximation (Hugging Face's gelu_new, ATen's gelu(approximate="tanh")) on n
// fp32 elements, written as y = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), the same
// function as 0.5 x (1 + tanh(u)); and its gradient dx = gy (s + x s (1 - s) 2 sqrt(2/pi) (1 +
// 3 0.044715 x^2)), s = sigmoid(2u).
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* x, const float* gy, float* dx, int64_t n);

// RMSNorm of one row of n fp32 values, the operations of norm_act.cpp's ATen chain (its sums in
// another order): rstd = 1 / sqrt(sum(x^2) / n + eps), y = (x * rstd) * w. Returns rstd.
float rms_norm_row(const float* x, const float* w, float eps, float* y, int64_t n);
// Its gradients for one row, with nx = x * rstd and dn = gy * w: dx = (dn - nx * (sum(dn * nx) /
// n)) * rstd where dx is not null, and dw[j] += gy[j] * nx[j] where dw is not null.
void rms_norm_backward_row(const float* x, const float* w, const float* gy, float rstd, float* dx, float* dw,
                           int64_t n);

// Whether the AVX2 kernels run (the CPU has AVX2 and FMA, and the portable ones were not
// asked for).
bool avx2_kernels_active();

// Whether the GEMM of cpu_gemm.h takes its AVX-512 form (the CPU has AVX-512F, and neither the
// portable kernels nor AVX2 at most were asked for).
bool avx512_kernels_active();

// Tests: the portable C++ kernels instead of the AVX2 ones this CPU may have; covers the
// attention kernel's GEMM too (attention_cpu.h).
void use_portable_cpu_kernels(bool portable);
// Tests: AVX2 at most, on a CPU that has AVX-512 (the machines without it run these).
void use_avx2_cpu_kernels_at_most(bool at_most);

}  // namespace memtune::models::detail
