#pragma once
// The chunked loss's softmax pass on CUDA (cross_entropy_cuda_kernels.cu), on raw device
// pointers so that nvcc compiles no LibTorch header; models/layers/cross_entropy.cpp calls
// it for a chunk of fp32 logits on a CUDA device. Two passes over the logits where ATen's
// max, sub, exp and sum make six.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace memtune::models::cross_entropy_cuda {

// For the rows of e (n, V) fp32, contiguous: m[r] = the row's max and first_max[r] the
// first index holding it (a NaN counts as the largest value, as ATen's max), then
// e = exp(e - m) in place (expf, as ATen's exp_) and s[r] = the row's sum of it in fp32.
cudaError_t row_softmax_parts(float* e, int64_t n, int64_t V, float* m, float* s, int64_t* first_max,
                              cudaStream_t stream);

}  // namespace memtune::models::cross_entropy_cuda
