// A LoRA adapter's output added into a 16-bit projection output (lora_cuda_kernels.h).
// A CTA owns a tile of 16 rows by 256 columns of y; a thread, 2 rows by 8 adjacent columns
// (16 bytes of y per row: one load and one store where the row allows). The thread loads its
// part of y first, so that the loads are in flight while the products are summed. The rank
// is taken in chunks of 16: the chunk's columns of a (as fp32) and rows of b (as T, 16 bytes
// per thread and step, which a quarter warp reads from 32 different banks) are staged in
// shared memory, and every thread carries its 16 sums across the chunks, so each sum runs
// over k in order whatever r is.
#include "models/layers/cuda/lora_cuda_kernels.h"

#include <algorithm>
#include <climits>

#include "runtime/cuda/device_math.cuh"

namespace memtune::models::lora_cuda {
namespace {

using cuda_math::Convert;
using cuda_math::round_to;

constexpr int kThreads = 256;
constexpr int kLanes = 32;                                       // threads across a tile's columns
constexpr int kCols = 8;                                         // adjacent columns per thread
constexpr int kRowsPerThread = 2;
constexpr int kTileCols = kLanes * kCols;                        // 256
constexpr int kTileRows = (kThreads / kLanes) * kRowsPerThread;  // 16
constexpr int kChunk = 16;                                       // rank taken per stage

template <class T>
__global__ void __launch_bounds__(kThreads) add_scaled_product_kernel(T* __restrict__ y, int64_t ldy,
                                                                      const T* __restrict__ a, int64_t lda,
                                                                      const T* __restrict__ b, int64_t ldb, int64_t m,
                                                                      int64_t n, int r, float scaling, bool vector_y,
                                                                      bool vector_b) {
  // as[k][i] (padded: the staging's stores spread over the banks); a warp's threads read
  // one address at a time (their rows are the same). bs[k][j] as b holds it.
  __shared__ float as[kChunk][kTileRows + 1];
  __shared__ __align__(16) T bs[kChunk][kTileCols];
  const int lane = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t first = col0 + lane * kCols;  // this thread's first column
  const bool whole_cols = col0 + kTileCols <= n;
  const bool vector_row = vector_y && first + kCols <= n;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileRows; row0 < m;
       row0 += static_cast<int64_t>(gridDim.y) * kTileRows) {
    // This thread's rows of y, read before the sums (what lies past m or n is not read).
    alignas(16) T yv[kRowsPerThread][kCols];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = row0 + ty * kRowsPerThread + i;
      if (row >= m || first >= n) continue;
      const T* yr = y + row * ldy + first;
      if (vector_row) {
        *reinterpret_cast<uint4*>(yv[i]) = *reinterpret_cast<const uint4*>(yr);
      } else {
        for (int c = 0; c < kCols && first + c < n; ++c) yv[i][c] = yr[c];
      }
    }
    float acc[kRowsPerThread][kCols];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] = 0.0f;

    for (int k0 = 0; k0 < r; k0 += kChunk) {
      const int kn = min(kChunk, r - k0);
      // Stage a's rows [row0, row0 + 16) and b's columns [col0, col0 + 256) of this chunk;
      // what lies past m, n or r is staged as 0 and never stored.
      for (int e = threadIdx.x; e < kChunk * kTileRows; e += kThreads) {
        const int k = e % kChunk, i = e / kChunk;  // adjacent threads: adjacent k, one row of a
        const int64_t row = row0 + i;
        as[k][i] = row < m && k < kn ? Convert<T>::from(a[row * lda + k0 + k]) : 0.0f;
      }
      if (vector_b && whole_cols) {
        constexpr int kVectors = kChunk * kTileCols / kCols;  // 16-byte pieces of the chunk
        for (int e = threadIdx.x; e < kVectors; e += kThreads) {
          const int k = e / (kTileCols / kCols), j = (e % (kTileCols / kCols)) * kCols;
          uint4 v = make_uint4(0, 0, 0, 0);
          if (k < kn) v = *reinterpret_cast<const uint4*>(b + (k0 + k) * ldb + col0 + j);
          *reinterpret_cast<uint4*>(&bs[k][j]) = v;
        }
      } else {
        for (int e = threadIdx.x; e < kChunk * kTileCols; e += kThreads) {
          const int k = e / kTileCols, j = e % kTileCols;
          bs[k][j] = col0 + j < n && k < kn ? b[(k0 + k) * ldb + col0 + j] : Convert<T>::to(0.0f);
        }
      }
      __syncthreads();
      for (int k = 0; k < kn; ++k) {
        alignas(16) T bt[kCols];
        *reinterpret_cast<uint4*>(bt) = *reinterpret_cast<const uint4*>(&bs[k][lane * kCols]);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const float av = as[k][ty * kRowsPerThread + i];
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[i][c] = __fmaf_rn(av, Convert<T>::from(bt[c]), acc[i][c]);
        }
      }
      __syncthreads();
    }

    // PEFT's ops, each rounded to T: the product, its scaling, the sum with y.
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = row0 + ty * kRowsPerThread + i;
      if (row >= m || first >= n) continue;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        yv[i][c] = Convert<T>::to(
            __fadd_rn(Convert<T>::from(yv[i][c]), round_to<T>(__fmul_rn(round_to<T>(acc[i][c]), scaling))));
      T* yr = y + row * ldy + first;
      if (vector_row) {
        *reinterpret_cast<uint4*>(yr) = *reinterpret_cast<const uint4*>(yv[i]);
      } else {
        for (int c = 0; c < kCols && first + c < n; ++c) yr[c] = yv[i][c];
      }
    }
  }
}

template <class T>
cudaError_t launch(void* y, int64_t ldy, const void* a, int64_t lda, const void* b, int64_t ldb, int64_t m, int64_t n,
                   int64_t r, float scaling, cudaStream_t stream) {
  // 16-byte pieces of a row: the address and the row stride whole multiples of 8 elements.
  const bool vector_y = reinterpret_cast<uintptr_t>(y) % 16 == 0 && ldy % kCols == 0;
  const bool vector_b = reinterpret_cast<uintptr_t>(b) % 16 == 0 && ldb % kCols == 0;
  const dim3 grid(static_cast<unsigned>((n + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>(std::min<int64_t>((m + kTileRows - 1) / kTileRows, 65535)));
  add_scaled_product_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(y), ldy, static_cast<const T*>(a), lda,
                                                              static_cast<const T*>(b), ldb, m, n,
                                                              static_cast<int>(r), scaling, vector_y, vector_b);
  return cudaGetLastError();
}

}  // namespace

cudaError_t add_scaled_product(void* y, int64_t ldy, const void* a, int64_t lda, const void* b, int64_t ldb, DType t,
                               int64_t m, int64_t n, int64_t r, float scaling, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  // The rank fits an int; the column tiles fill grid.x (at most 2^31 - 1 of them).
  if (r <= 0 || r > INT_MAX || (n + kTileCols - 1) / kTileCols > INT_MAX) return cudaErrorInvalidValue;
  switch (t) {
    case DType::kHalf: return launch<__half>(y, ldy, a, lda, b, ldb, m, n, r, scaling, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(y, ldy, a, lda, b, ldb, m, n, r, scaling, stream);
    case DType::kFloat: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace memtune::models::lora_cuda
