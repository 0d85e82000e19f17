#include "models/layers/cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/cpu_features.h"

#ifdef MEMTUNE_X86
#include <immintrin.h>
#endif

namespace memtune::models::detail {

namespace {

bool g_portable = false;
bool g_avx2_at_most = false;

float exp_shift_sum_scalar(float* x, int64_t n, float scale, float shift) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += (x[j] = std::exp(x[j] * scale - shift));
  return sum;
}

// One element of SwiGLU's forward and backward (the portable kernels and the AVX2 ones' tails).
inline float swiglu_scalar(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }
inline void swiglu_backward_scalar(float g, float u, float gy, float* dg, float* du) {
  const float e = 1.0f + std::exp(-g);
  if (du != nullptr) *du = g / e * gy;
  if (dg != nullptr) {
    const float s = 1.0f / e;
    *dg = gy * u * s * (1.0f + g * (1.0f - s));
  }
}

// GELU with tanh's approximation as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): 0.5 (1 +
// tanh(u)) is sigmoid(2u), without tanh's cancellation where it nears -1.
constexpr float kGeluBeta2 = 2 * 0.7978845608028654f;  // 2 sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
inline float gelu_sigmoid(float x, float x2) { return 1.0f / (1.0f + std::exp(-kGeluBeta2 * (x * (1.0f + kGeluKappa * x2)))); }
inline float gelu_tanh_scalar(float x) { return x * gelu_sigmoid(x, x * x); }
inline float gelu_tanh_backward_scalar(float x, float gy) {
  const float x2 = x * x, s = gelu_sigmoid(x, x2);
  return gy * (s + x * (s * (1.0f - s)) * (kGeluBeta2 * (1.0f + 3.0f * kGeluKappa * x2)));
}

float rms_norm_row_scalar(const float* x, const float* w, float eps, float* y, int64_t n) {
  float ss = 0.0f;
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * rstd * w[j];
  return rstd;
}

void rms_norm_backward_row_scalar(const float* x, const float* w, const float* gy, float rstd, float* dx, float* dw,
                                  int64_t n) {
  if (dw != nullptr)
    for (int64_t j = 0; j < n; ++j) dw[j] += gy[j] * (x[j] * rstd);
  if (dx == nullptr) return;
  float dot = 0.0f;
  for (int64_t j = 0; j < n; ++j) dot += gy[j] * w[j] * (x[j] * rstd);
  const float mean = dot / static_cast<float>(n);
  for (int64_t j = 0; j < n; ++j) dx[j] = (gy[j] * w[j] - x[j] * rstd * mean) * rstd;
}

#ifdef MEMTUNE_X86
#define MEMTUNE_AVX2 __attribute__((target("avx2,fma")))

// exp on 8 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p Cephes' degree-5 polynomial
// (relative error about 2e-7 over the clamped range; inputs below -87.3 give ~0).
MEMTUNE_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

MEMTUNE_AVX2 inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

MEMTUNE_AVX2 inline float sum8(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

MEMTUNE_AVX2 float exp_shift_sum_avx2(float* x, int64_t n, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale), vt = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), vs, vt));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {
    const __m256i mask = tail_mask(n - j);
    const __m256 e =
        _mm256_and_ps(exp8(_mm256_fmsub_ps(_mm256_maskload_ps(x + j, mask), vs, vt)), _mm256_castsi256_ps(mask));
    _mm256_maskstore_ps(x + j, mask, e);
    acc = _mm256_add_ps(acc, e);
  }
  return sum8(acc);
}

MEMTUNE_AVX2 float row_max_avx2(const float* x, int64_t n) {
  __m256 v0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), v1 = v0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // two chains, each max waiting on the one before it
    v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j));
    v1 = _mm256_max_ps(v1, _mm256_loadu_ps(x + j + 8));
  }
  if (j + 8 <= n) v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j)), j += 8;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(v0, v1));
  float m = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

MEMTUNE_AVX2 int64_t exp_row_from_max_avx2(float* x, int64_t n, float* max, float* sum) {
  const float m = row_max_avx2(x, n);
  // The second pass finds the first maximum before overwriting, and exponentiates.
  int64_t arg = -1, j = 0;
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    if (arg < 0) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(v, vmax, _CMP_EQ_OQ));
      if (hits != 0) arg = j + __builtin_ctz(static_cast<unsigned>(hits));
    }
    const __m256 e = exp8(_mm256_sub_ps(v, vmax));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = sum8(acc);
  for (; j < n; ++j) {
    if (arg < 0 && x[j] == m) arg = j;
    s += (x[j] = std::exp(x[j] - m));
  }
  *max = m;
  *sum = s;
  return arg;
}

// Each product and sum rounded once, in ATen's order (no contraction into FMAs), so that the
// exponential is the only difference from ATen's ops.
MEMTUNE_AVX2 void swiglu_forward_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 vg = _mm256_loadu_ps(g + j);
    const __m256 e = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, vg)));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_div_ps(vg, e), _mm256_loadu_ps(u + j)));
  }
  for (; j < n; ++j) y[j] = swiglu_scalar(g[j], u[j]);
}

MEMTUNE_AVX2 void swiglu_backward_avx2(const float* g, const float* u, const float* gy, float* dg, float* du,
                                       int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 vg = _mm256_loadu_ps(g + j), vgy = _mm256_loadu_ps(gy + j);
    const __m256 e = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, vg)));
    if (du != nullptr) _mm256_storeu_ps(du + j, _mm256_mul_ps(_mm256_div_ps(vg, e), vgy));
    if (dg != nullptr) {
      const __m256 s = _mm256_div_ps(one, e);
      const __m256 d = _mm256_mul_ps(_mm256_mul_ps(vgy, _mm256_loadu_ps(u + j)), s);
      _mm256_storeu_ps(dg + j, _mm256_mul_ps(d, _mm256_add_ps(one, _mm256_mul_ps(vg, _mm256_sub_ps(one, s)))));
    }
  }
  for (; j < n; ++j)
    swiglu_backward_scalar(g[j], u[j], gy[j], dg == nullptr ? nullptr : dg + j, du == nullptr ? nullptr : du + j);
}

// s = sigmoid(2u) on 8 lanes, for GELU's forward and backward.
MEMTUNE_AVX2 inline __m256 gelu_sigmoid8(__m256 x, __m256 x2) {
  const __m256 inner = _mm256_mul_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), x2)));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-kGeluBeta2), inner));
  return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

MEMTUNE_AVX2 void gelu_tanh_forward_avx2(const float* x, float* y, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    _mm256_storeu_ps(y + j, _mm256_mul_ps(v, gelu_sigmoid8(v, _mm256_mul_ps(v, v))));
  }
  for (; j < n; ++j) y[j] = gelu_tanh_scalar(x[j]);
}

MEMTUNE_AVX2 void gelu_tanh_backward_avx2(const float* x, const float* gy, float* dx, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), slope = _mm256_set1_ps(kGeluBeta2),
               kappa3 = _mm256_set1_ps(3.0f * kGeluKappa);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j), v2 = _mm256_mul_ps(v, v);
    const __m256 s = gelu_sigmoid8(v, v2);
    const __m256 du = _mm256_mul_ps(slope, _mm256_add_ps(one, _mm256_mul_ps(kappa3, v2)));
    const __m256 d = _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(v, _mm256_mul_ps(s, _mm256_sub_ps(one, s))), du));
    _mm256_storeu_ps(dx + j, _mm256_mul_ps(_mm256_loadu_ps(gy + j), d));
  }
  for (; j < n; ++j) dx[j] = gelu_tanh_backward_scalar(x[j], gy[j]);
}

MEMTUNE_AVX2 float rms_norm_row_avx2(const float* x, const float* w, float eps, float* y, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
  }
  float ss = sum8(_mm256_add_ps(a0, a1));
  for (; j < n; ++j) ss += x[j] * x[j];
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 r = _mm256_set1_ps(rstd);
  for (j = 0; j + 8 <= n; j += 8)
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), r), _mm256_loadu_ps(w + j)));
  for (; j < n; ++j) y[j] = x[j] * rstd * w[j];
  return rstd;
}

MEMTUNE_AVX2 void rms_norm_backward_row_avx2(const float* x, const float* w, const float* gy, float rstd, float* dx,
                                             float* dw, int64_t n) {
  const __m256 r = _mm256_set1_ps(rstd);
  int64_t j = 0;
  if (dw != nullptr) {
    for (; j + 8 <= n; j += 8) {
      const __m256 nx = _mm256_mul_ps(_mm256_loadu_ps(x + j), r);
      _mm256_storeu_ps(dw + j, _mm256_add_ps(_mm256_loadu_ps(dw + j), _mm256_mul_ps(_mm256_loadu_ps(gy + j), nx)));
    }
    for (; j < n; ++j) dw[j] += gy[j] * (x[j] * rstd);
  }
  if (dx == nullptr) return;
  __m256 acc = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 dn = _mm256_mul_ps(_mm256_loadu_ps(gy + j), _mm256_loadu_ps(w + j));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(dn, _mm256_mul_ps(_mm256_loadu_ps(x + j), r)));
  }
  float dot = sum8(acc);
  for (; j < n; ++j) dot += gy[j] * w[j] * (x[j] * rstd);
  const float mean = dot / static_cast<float>(n);
  const __m256 m = _mm256_set1_ps(mean);
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 dn = _mm256_mul_ps(_mm256_loadu_ps(gy + j), _mm256_loadu_ps(w + j));
    const __m256 nx = _mm256_mul_ps(_mm256_loadu_ps(x + j), r);
    _mm256_storeu_ps(dx + j, _mm256_mul_ps(_mm256_sub_ps(dn, _mm256_mul_ps(nx, m)), r));
  }
  for (; j < n; ++j) dx[j] = (gy[j] * w[j] - x[j] * rstd * mean) * rstd;
}

// tanh on 8 lanes: for |u| < 1/4 its odd series to u^9 (the next term is under 3e-9 of u
// there), else 1 - 2 / (exp(2u) + 1) (about 1e-7 from tanh, absolute, where |tanh| > 0.24).
MEMTUNE_AVX2 inline __m256 tanh8(__m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 u2 = _mm256_mul_ps(u, u);
  __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, u2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 series = _mm256_fmadd_ps(_mm256_mul_ps(p, u2), u, u);
  const __m256 e = exp8(_mm256_add_ps(u, u));
  const __m256 wide = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 abs_u = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), u);
  return _mm256_blendv_ps(wide, series, _mm256_cmp_ps(abs_u, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
}

MEMTUNE_AVX2 void soft_cap_avx2(float* x, int64_t n, float scale, float cap, float* th) {
  const __m256 s = _mm256_set1_ps(scale), c = _mm256_set1_ps(cap);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 t = tanh8(_mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), s), c));
    _mm256_storeu_ps(x + j, _mm256_mul_ps(t, c));
    if (th != nullptr) _mm256_storeu_ps(th + j, t);
  }
  if (j < n) {
    const __m256i mask = tail_mask(n - j);
    const __m256 t = tanh8(_mm256_div_ps(_mm256_mul_ps(_mm256_maskload_ps(x + j, mask), s), c));
    _mm256_maskstore_ps(x + j, mask, _mm256_mul_ps(t, c));
    if (th != nullptr) _mm256_maskstore_ps(th + j, mask, t);
  }
}
#endif

}  // namespace

bool avx2_kernels_active() { return !g_portable && cpu_has_avx2() && cpu_has_fma(); }

bool avx512_kernels_active() { return avx2_kernels_active() && !g_avx2_at_most && cpu_has_avx512f(); }

void use_portable_cpu_kernels(bool portable) { g_portable = portable; }

void use_avx2_cpu_kernels_at_most(bool at_most) { g_avx2_at_most = at_most; }

float exp_shift_sum(float* x, int64_t n, float scale, float shift) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return exp_shift_sum_avx2(x, n, scale, shift);
#endif
  return exp_shift_sum_scalar(x, n, scale, shift);
}

float row_max(const float* x, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return row_max_avx2(x, n);
#endif
  return *std::max_element(x, x + n);
}

int64_t exp_row_from_max(float* x, int64_t n, float* max, float* sum) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return exp_row_from_max_avx2(x, n, max, sum);
#endif
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = -1;
  for (int64_t j = 0; j < n; ++j)
    if (x[j] > m || (arg < 0 && x[j] == m)) m = x[j], arg = j;
  *max = m;
  *sum = exp_shift_sum_scalar(x, n, 1.0f, m);
  return arg;
}

void swiglu_forward(const float* g, const float* u, float* y, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return swiglu_forward_avx2(g, u, y, n);
#endif
  for (int64_t j = 0; j < n; ++j) y[j] = swiglu_scalar(g[j], u[j]);
}

void swiglu_backward(const float* g, const float* u, const float* gy, float* dg, float* du, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return swiglu_backward_avx2(g, u, gy, dg, du, n);
#endif
  for (int64_t j = 0; j < n; ++j)
    swiglu_backward_scalar(g[j], u[j], gy[j], dg == nullptr ? nullptr : dg + j, du == nullptr ? nullptr : du + j);
}

void soft_cap(float* x, int64_t n, float scale, float cap, float* th) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return soft_cap_avx2(x, n, scale, cap, th);
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float t = std::tanh(x[j] * scale / cap);
    x[j] = t * cap;
    if (th != nullptr) th[j] = t;
  }
}

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return gelu_tanh_forward_avx2(x, y, n);
#endif
  for (int64_t j = 0; j < n; ++j) y[j] = gelu_tanh_scalar(x[j]);
}

void gelu_tanh_backward(const float* x, const float* gy, float* dx, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return gelu_tanh_backward_avx2(x, gy, dx, n);
#endif
  for (int64_t j = 0; j < n; ++j) dx[j] = gelu_tanh_backward_scalar(x[j], gy[j]);
}

float rms_norm_row(const float* x, const float* w, float eps, float* y, int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return rms_norm_row_avx2(x, w, eps, y, n);
#endif
  return rms_norm_row_scalar(x, w, eps, y, n);
}

void rms_norm_backward_row(const float* x, const float* w, const float* gy, float rstd, float* dx, float* dw,
                           int64_t n) {
#ifdef MEMTUNE_X86
  if (avx2_kernels_active()) return rms_norm_backward_row_avx2(x, w, gy, rstd, dx, dw, n);
#endif
  rms_norm_backward_row_scalar(x, w, gy, rstd, dx, dw, n);
}

}  // namespace memtune::models::detail
