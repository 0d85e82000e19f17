#include "models/layers/cpu_gemm.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "models/layers/cpu_vec.h"
#include "runtime/cpu_features.h"
#include "runtime/error.h"
#include "runtime/step_profiler.h"

#ifdef MEMTUNE_X86
#include <immintrin.h>
#endif

namespace memtune::models::detail {

namespace {

constexpr int64_t kLanes = kPanelLanes;
constexpr int64_t kNarrow = 64;  // the widest b narrow_mm takes

void gemm_scalar(int64_t M, int64_t N, int64_t K, Left A, Panels B, float* C, int64_t ldc, bool acc) {
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (!acc) std::fill(c, c + N, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = A.at(i, k);
      for (int64_t j = 0; j < N; ++j) c[j] += a * B.at(j / kLanes, k)[j % kLanes];
    }
  }
}

#ifdef MEMTUNE_X86
// f(std::integral_constant<int, mi>{}) for a tile of 1 <= mi <= R rows: the tile kernels
// take their row count as a template argument, so their accumulators stay in registers.
template <int R, typename F>
void with_rows(int64_t mi, F&& f) {
  if constexpr (R > 1) {
    if (mi < R) return with_rows<R - 1>(mi, f);
  }
  f(std::integral_constant<int, R>{});
}

#define MEMTUNE_AVX2 __attribute__((target("avx2,fma")))

// One R x 16 tile of C (R <= 6: 2R accumulators, two registers of B and a broadcast fit the
// sixteen): a K-step is two loads of B, R broadcasts of A and 2R fused multiply-adds. Every
// loop over r is unrolled by pragma: left to itself GCC 12 kept lo and hi as arrays in memory
// and stored all twelve registers on each K-step, which held a 6 x 16 tile to about 55 % of
// one core's AVX2 peak on a Zen 5 (about 95 % unrolled, 2026-11-27).
template <int R>
MEMTUNE_AVX2 void tile_avx2(int64_t K, const float* const* a, int64_t a_col, const float* b, float* c, int64_t ldc,
                            int64_t nj, bool acc) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kLanes), b1 = _mm256_loadu_ps(b + k * kLanes + 8);
    const int64_t o = k * a_col;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a[r] + o);
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(nj, 8))), lanes);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(nj - 8, 0))), lanes);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r, c += ldc) {
    __m256 v0 = lo[r], v1 = hi[r];
    if (nj == kLanes) {
      if (acc) v0 = _mm256_add_ps(v0, _mm256_loadu_ps(c)), v1 = _mm256_add_ps(v1, _mm256_loadu_ps(c + 8));
      _mm256_storeu_ps(c, v0);
      _mm256_storeu_ps(c + 8, v1);
    } else {
      if (acc) {
        v0 = _mm256_add_ps(v0, _mm256_maskload_ps(c, m0));
        v1 = _mm256_add_ps(v1, _mm256_maskload_ps(c + 8, m1));
      }
      _mm256_maskstore_ps(c, m0, v0);
      _mm256_maskstore_ps(c + 8, m1, v1);
    }
  }
}

// Panel by panel (one stays in L1 while the rows of A stream past it), tiles of up to kTile
// rows: tile(rows, ...) runs the kernel's rows() x 16 tile.
template <int kTile, typename Tile>
void gemm_panels(int64_t M, int64_t N, int64_t K, Left A, Panels B, float* C, int64_t ldc, bool acc, Tile tile) {
  for (int64_t q = 0; q * kLanes < N; ++q) {
    const int64_t j0 = q * kLanes, nj = std::min(kLanes, N - j0);
    const float* b = B.at(q, 0);
    for (int64_t i0 = 0; i0 < M; i0 += kTile) {
      const float* a[kTile];
      const int64_t mi = std::min<int64_t>(kTile, M - i0);
      for (int64_t r = 0; r < mi; ++r) a[r] = A.p + (i0 + r) * A.row;
      float* c = C + i0 * ldc + j0;
      with_rows<kTile>(mi, [&](auto rows) { tile(rows, K, a, A.col, b, c, ldc, nj, acc); });
    }
  }
}

void gemm_avx2(int64_t M, int64_t N, int64_t K, Left A, Panels B, float* C, int64_t ldc, bool acc) {
  gemm_panels<6>(M, N, K, A, B, C, ldc, acc, [](auto rows, auto... args) { tile_avx2<rows()>(args...); });
}

#define MEMTUNE_AVX512 __attribute__((target("avx512f")))

// One R x 16 tile of C in R 16-float registers (R <= 12): a K-step is one load of B, R
// broadcasts of A and R fused multiply-adds; twelve chains cover the multiply-add's latency
// at two a cycle.
template <int R>
MEMTUNE_AVX512 void tile_avx512(int64_t K, const float* const* a, int64_t a_col, const float* b, float* c,
                                int64_t ldc, int64_t nj, bool acc) {
  __m512 t[R];
  for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 bk = _mm512_loadu_ps(b + k * kLanes);
    const int64_t o = k * a_col;
    for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][o]), bk, t[r]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << nj) - 1);
  for (int r = 0; r < R; ++r, c += ldc) {
    __m512 v = t[r];
    if (acc) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, c));
    _mm512_mask_storeu_ps(c, mask, v);
  }
}

void gemm_avx512(int64_t M, int64_t N, int64_t K, Left A, Panels B, float* C, int64_t ldc, bool acc) {
  gemm_panels<12>(M, N, K, A, B, C, ldc, acc, [](auto rows, auto... args) { tile_avx512<rows()>(args...); });
}

#endif

}  // namespace

Panels pack_panels(const float* src, int64_t row, int64_t col, int64_t K, int64_t N, int64_t stride, float* dst,
                   float alpha) {
  for (int64_t q = 0; q * kLanes < N; ++q) {
    const int64_t n0 = q * kLanes, nn = std::min(kLanes, N - n0);
    float* d = dst + q * stride * kLanes;
    for (int64_t k = 0; k < K; ++k, d += kLanes) {
      if (col == 1 && nn == kLanes && alpha == 1.0f) {
        std::memcpy(d, src + k * row + n0, kLanes * sizeof(float));
        continue;
      }
      for (int64_t n = 0; n < nn; ++n) d[n] = alpha * src[k * row + (n0 + n) * col];
      std::fill(d + nn, d + kLanes, 0.0f);
    }
  }
  return {dst, stride * kLanes};
}

GemmFn gemm_kernel() {
#ifdef MEMTUNE_X86
  if (avx512_kernels_active()) return gemm_avx512;
  if (avx2_kernels_active()) return gemm_avx2;
#endif
  return gemm_scalar;
}

bool narrow_mm_applies(const at::Tensor& a, const at::Tensor& b) {
  return avx2_kernels_active() && a.dim() == 2 && b.dim() == 2 && a.device().is_cpu() && b.device().is_cpu() &&
         a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.size(1) == b.size(0) &&
         b.size(1) <= kNarrow;
}

at::Tensor narrow_mm(const at::Tensor& a, const at::Tensor& b, double alpha, at::Tensor out, bool accumulate) {
  MEMTUNE_CHECK(narrow_mm_applies(a, b), "narrow_mm: takes CPU fp32 a (M x K) and b (K x N) with N <= 64, got ",
                a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (!out.defined()) out = at::empty({M, N}, a.options());
  // Row-major (rows at least N apart) or column-major (columns at least M apart): no two
  // elements share an address, which the threads would otherwise write at once.
  const bool row_major = out.stride(1) == 1 && (M == 1 || out.stride(0) >= N);
  const bool column_major = out.stride(0) == 1 && (N == 1 || out.stride(1) >= M);
  MEMTUNE_CHECK(out.sizes() == at::IntArrayRef({M, N}) && out.scalar_type() == at::kFloat &&
                    (row_major || column_major),
                "narrow_mm: out ", out.sizes(), " with strides ", out.strides(), " is not a row-major or column-major [",
                M, ", ", N, "] fp32 matrix");
  // Column-major out (a transposed view of an N x M matrix, as a LoRA A's gradient [r, in] is
  // to the [in, r] product h^T gha): each block of rows is formed in a buffer and stored across.
  const bool across = !row_major;
  MEMTUNE_PROFILE_SCOPE("memtune::narrow_mm");
  if (M == 0 || N == 0) return out;
  if (K == 0) return accumulate ? out : out.zero_();
  at::Tensor packed = at::empty({panel_floats(K, N)}, a.options());
  const Panels panels = pack_panels(b.data_ptr<float>(), b.stride(0), b.stride(1), K, N, K,
                                    packed.data_ptr<float>(), static_cast<float>(alpha));
  const GemmFn gemm = gemm_kernel();
  const float* ap = a.data_ptr<float>();
  const int64_t ar = a.stride(0), ac = a.stride(1), ldc = across ? out.stride(1) : out.stride(0);
  float* cp = out.data_ptr<float>();
  // Blocks of 12 rows (a whole number of either kernel's tiles); a task at least ~256k
  // multiply-adds, so a small product stays on the calling thread.
  constexpr int64_t kBlock = 12;
  const int64_t blocks = (M + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (kBlock * K * N));
  at::parallel_for(0, blocks, grain, [&](int64_t t0, int64_t t1) {
    const int64_t begin = t0 * kBlock, end = std::min(M, t1 * kBlock);
    if (!across) {
      gemm(end - begin, N, K, {ap + begin * ar, ar, ac}, panels, cp + begin * ldc, ldc, accumulate);
      return;
    }
    float block[kBlock * kNarrow];
    for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, end - i0);
      gemm(rows, N, K, {ap + i0 * ar, ar, ac}, panels, block, N, /*acc=*/false);
      // The sum, then the old value added: the AVX tiles' order (narrow_mm takes no other), so
      // the row-major form's bits.
      for (int64_t j = 0; j < N; ++j) {
        float* c = cp + j * ldc + i0;
        for (int64_t r = 0; r < rows; ++r) c[r] = accumulate ? block[r * N + j] + c[r] : block[r * N + j];
      }
    }
  });
  return out;
}

}  // namespace memtune::models::detail
