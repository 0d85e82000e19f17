#include "models/layers/product_fp32.h"

#include <climits>

#include <ATen/ATen.h>

#include "runtime/error.h"

#ifdef MEMTUNE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace memtune::models {

void add_product_t_fp32(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, at::Tensor scratch) {
  MEMTUNE_INTERNAL_ASSERT(c.dim() == 2 && a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) &&
                              c.size(0) == a.size(1) && c.size(1) == b.size(1),
                          "add_product_t_fp32: c ", c.sizes(), " += a^T b for a ", a.sizes(), ", b ", b.sizes());
  MEMTUNE_INTERNAL_ASSERT(c.scalar_type() == at::kFloat && a.scalar_type() == b.scalar_type() &&
                              (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
                          "add_product_t_fp32: an fp32 c and 16-bit a and b");
#ifdef MEMTUNE_CUDA
  if (c.is_cuda()) {
    // Row-major c (m,k) is column-major c^T (k,m) = b^T a: b row-major (n,k) is b^T
    // column-major (ld k), a row-major (n,m) is a^T column-major (ld m), taken transposed.
    MEMTUNE_INTERNAL_ASSERT(c.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
                            "add_product_t_fp32: contiguous operands on CUDA");
    const c10::cuda::CUDAGuard guard(c.device());
    const int64_t m = c.size(0), k = c.size(1), n = a.size(0);
    MEMTUNE_INTERNAL_ASSERT(m <= INT32_MAX && k <= INT32_MAX && n <= INT32_MAX, "add_product_t_fp32: sizes over int");
    const cudaDataType_t type = a.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
    const float one = 1.0f;
    TORCH_CUDABLAS_CHECK(cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_N, CUBLAS_OP_T,
                                      static_cast<int>(k), static_cast<int>(m), static_cast<int>(n), &one,
                                      b.data_ptr(), type, static_cast<int>(k), a.data_ptr(), type,
                                      static_cast<int>(m), &one, c.data_ptr(), CUDA_R_32F, static_cast<int>(k),
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
#endif
  at::Tensor a32 = scratch.defined() ? scratch.copy_(a) : a.to(at::kFloat);
  c.addmm_(a32.t(), b.to(at::kFloat));
}

}  // namespace memtune::models
