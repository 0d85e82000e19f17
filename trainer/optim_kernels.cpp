// The optimizer step's fp32 CPU passes (trainer/optim_kernels.h): AdamW's two updates,
// Adafactor's elementwise passes and the gradients' sum of squares; the scalar kernels, their
// AVX2 twins and the dispatch. Built with -ffp-contract=off.
#include "trainer/optim_kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>

#ifdef MEMTUNE_X86
#include <immintrin.h>
#endif

namespace memtune::trainer {

namespace {

// Elements per task: a few hundred KiB of the four streams, so the pool's start-up is paid
// once per large tensor and not per adapter matrix.
constexpr int64_t kGrain = 16384;

constexpr int kSums = 16;  // square_sum_block's running sums

double add_in_order(const double (&sums)[kSums]) {
  double total = 0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace

double square_sum_block_scalar(const float* x, int64_t n) {
  double sums[kSums] = {};
  for (int64_t j = 0; j < n; ++j) sums[j % kSums] += static_cast<double>(x[j]) * x[j];
  return add_in_order(sums);
}

void torch_adamw_scalar(const TorchAdamW& s, float* p, float* g, float* m, float* v, int64_t n) {
  const bool scaled = s.scale != 1.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float gj = g[j] * s.scale;
    if (scaled) g[j] = gj;
    const float pj = p[j] * s.decay;
    const float mj = m[j] * s.b1 + s.one_minus_b1 * gj;
    const float vj = v[j] * s.b2 + s.one_minus_b2 * (gj * gj);
    m[j] = mj;
    v[j] = vj;
    p[j] = pj + s.step * (mj / (std::sqrt(vj) / s.sqrt_bc2 + s.eps));
  }
}

void bnb_adam32_scalar(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n) {
  const float eps = s.eps_c2;  // the 32-bit kernel writes eps * correction2: same product
  for (int64_t j = 0; j < n; ++j) {
    const float gj = s.gs * g[j];
    const float mj = m[j] * s.b1 + s.one_minus_b1 * gj;
    const float vj = v[j] * s.b2 + s.one_minus_b2 * (gj * gj);
    m[j] = mj;
    v[j] = vj;
    float pj = p[j] + s.step_size * (mj / (std::sqrt(vj) + eps));
    if (s.decay_on) pj = pj * s.decay;
    p[j] = pj;
  }
}

void adafactor_square_scalar(float scale, float eps, float* g, float* u, int64_t n) {
  const bool scaled = scale != 1.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float gj = scaled ? g[j] * scale : g[j];
    if (scaled) g[j] = gj;
    u[j] = gj * gj + eps;
  }
}

void adafactor_factored_scalar(const float* r, const float* c, const float* g, float* u, int64_t rows,
                               int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) u[i * cols + j] = (r[i] * c[j]) * g[i * cols + j];
}

void adafactor_apply_scalar(float d, float lr, const float* u, float* p, int64_t n) {
  for (int64_t j = 0; j < n; ++j) p[j] = p[j] - (u[j] / d) * lr;
}

#ifdef MEMTUNE_X86

__attribute__((target("avx2"))) void adafactor_square_avx2(float scale, float eps, float* g, float* u, int64_t n) {
  const bool scaled = scale != 1.0f;
  const __m256 sv = _mm256_set1_ps(scale), ev = _mm256_set1_ps(eps);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 gj = _mm256_loadu_ps(g + j);
    if (scaled) {
      gj = _mm256_mul_ps(gj, sv);
      _mm256_storeu_ps(g + j, gj);
    }
    _mm256_storeu_ps(u + j, _mm256_add_ps(_mm256_mul_ps(gj, gj), ev));
  }
  adafactor_square_scalar(scale, eps, g + j, u + j, n - j);
}

__attribute__((target("avx2"))) void adafactor_factored_avx2(const float* r, const float* c, const float* g, float* u,
                                                             int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m256 ri = _mm256_set1_ps(r[i]);
    const float* gi = g + i * cols;
    float* ui = u + i * cols;
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8)
      _mm256_storeu_ps(ui + j, _mm256_mul_ps(_mm256_mul_ps(ri, _mm256_loadu_ps(c + j)), _mm256_loadu_ps(gi + j)));
    for (; j < cols; ++j) ui[j] = (r[i] * c[j]) * gi[j];
  }
}

__attribute__((target("avx2"))) void adafactor_apply_avx2(float d, float lr, const float* u, float* p, int64_t n) {
  const __m256 dv = _mm256_set1_ps(d), lv = _mm256_set1_ps(lr);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(u + j), dv), lv)));
  adafactor_apply_scalar(d, lr, u + j, p + j, n - j);
}

__attribute__((target("avx2"))) void torch_adamw_avx2(const TorchAdamW& s, float* p, float* g, float* m, float* v,
                                                      int64_t n) {
  const bool scaled = s.scale != 1.0f;
  const __m256 scale = _mm256_set1_ps(s.scale), decay = _mm256_set1_ps(s.decay), b1 = _mm256_set1_ps(s.b1),
               c1 = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.b2), c2 = _mm256_set1_ps(s.one_minus_b2),
               sqrt_bc2 = _mm256_set1_ps(s.sqrt_bc2), eps = _mm256_set1_ps(s.eps), step = _mm256_set1_ps(s.step);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gj = _mm256_mul_ps(_mm256_loadu_ps(g + j), scale);
    if (scaled) _mm256_storeu_ps(g + j, gj);
    const __m256 pj = _mm256_mul_ps(_mm256_loadu_ps(p + j), decay);
    const __m256 mj = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + j), b1), _mm256_mul_ps(c1, gj));
    const __m256 vj = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), b2), _mm256_mul_ps(c2, _mm256_mul_ps(gj, gj)));
    _mm256_storeu_ps(m + j, mj);
    _mm256_storeu_ps(v + j, vj);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), sqrt_bc2), eps);
    _mm256_storeu_ps(p + j, _mm256_add_ps(pj, _mm256_mul_ps(step, _mm256_div_ps(mj, denom))));
  }
  torch_adamw_scalar(s, p + j, g + j, m + j, v + j, n - j);
}

__attribute__((target("avx2"))) void bnb_adam32_avx2(const BnbScalars& s, float* p, const float* g, float* m,
                                                     float* v, int64_t n) {
  const __m256 gs = _mm256_set1_ps(s.gs), b1 = _mm256_set1_ps(s.b1), c1 = _mm256_set1_ps(s.one_minus_b1),
               b2 = _mm256_set1_ps(s.b2), c2 = _mm256_set1_ps(s.one_minus_b2), eps = _mm256_set1_ps(s.eps_c2),
               step = _mm256_set1_ps(s.step_size), decay = _mm256_set1_ps(s.decay);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gj = _mm256_mul_ps(gs, _mm256_loadu_ps(g + j));
    const __m256 mj = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + j), b1), _mm256_mul_ps(c1, gj));
    const __m256 vj = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), b2), _mm256_mul_ps(c2, _mm256_mul_ps(gj, gj)));
    _mm256_storeu_ps(m + j, mj);
    _mm256_storeu_ps(v + j, vj);
    __m256 pj = _mm256_add_ps(_mm256_loadu_ps(p + j),
                              _mm256_mul_ps(step, _mm256_div_ps(mj, _mm256_add_ps(_mm256_sqrt_ps(vj), eps))));
    if (s.decay_on) pj = _mm256_mul_ps(pj, decay);
    _mm256_storeu_ps(p + j, pj);
  }
  bnb_adam32_scalar(s, p + j, g + j, m + j, v + j, n - j);
}

// Sums 0-3, 4-7, 8-11 and 12-15 in four registers of four doubles.
__attribute__((target("avx2"))) double square_sum_block_avx2(const float* x, int64_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + kSums <= n; j += kSums) {
    for (int k = 0; k < 4; ++k) {
      const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4 * k));
      acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d, d));
    }
  }
  alignas(32) double sums[kSums];
  for (int k = 0; k < 4; ++k) _mm256_store_pd(sums + 4 * k, acc[k]);
  for (int64_t k = 0; j < n; ++j, ++k) sums[k] += static_cast<double>(x[j]) * x[j];
  return add_in_order(sums);
}

#endif  // MEMTUNE_X86

double square_sum(const float* x, int64_t n) {
  const int64_t blocks = (n + kSquareSumBlock - 1) / kSquareSumBlock;
  std::vector<double> sums(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * kSquareSumBlock;
      const int64_t len = std::min(kSquareSumBlock, n - b * kSquareSumBlock);
#ifdef MEMTUNE_X86
      if (cpu_has_avx2()) {
        sums[static_cast<size_t>(b)] = square_sum_block_avx2(xb, len);
        continue;
      }
#endif
      sums[static_cast<size_t>(b)] = square_sum_block_scalar(xb, len);
    }
  });
  double total = 0;
  for (double s : sums) total += s;
  return total;
}

void torch_adamw(const TorchAdamW& s, float* p, float* g, float* m, float* v, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t j0, int64_t j1) {
#ifdef MEMTUNE_X86
    if (cpu_has_avx2()) return torch_adamw_avx2(s, p + j0, g + j0, m + j0, v + j0, j1 - j0);
#endif
    torch_adamw_scalar(s, p + j0, g + j0, m + j0, v + j0, j1 - j0);
  });
}

void bnb_adam32(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t j0, int64_t j1) {
#ifdef MEMTUNE_X86
    if (cpu_has_avx2()) return bnb_adam32_avx2(s, p + j0, g + j0, m + j0, v + j0, j1 - j0);
#endif
    bnb_adam32_scalar(s, p + j0, g + j0, m + j0, v + j0, j1 - j0);
  });
}

void adafactor_square(float scale, float eps, float* g, float* u, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t j0, int64_t j1) {
#ifdef MEMTUNE_X86
    if (cpu_has_avx2()) return adafactor_square_avx2(scale, eps, g + j0, u + j0, j1 - j0);
#endif
    adafactor_square_scalar(scale, eps, g + j0, u + j0, j1 - j0);
  });
}

void adafactor_factored(const float* r, const float* c, const float* g, float* u, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t i0, int64_t i1) {
    const float *ri = r + i0, *gi = g + i0 * cols;
    float* ui = u + i0 * cols;
#ifdef MEMTUNE_X86
    if (cpu_has_avx2()) return adafactor_factored_avx2(ri, c, gi, ui, i1 - i0, cols);
#endif
    adafactor_factored_scalar(ri, c, gi, ui, i1 - i0, cols);
  });
}

void adafactor_apply(float d, float lr, const float* u, float* p, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t j0, int64_t j1) {
#ifdef MEMTUNE_X86
    if (cpu_has_avx2()) return adafactor_apply_avx2(d, lr, u + j0, p + j0, j1 - j0);
#endif
    adafactor_apply_scalar(d, lr, u + j0, p + j0, j1 - j0);
  });
}

}  // namespace memtune::trainer
