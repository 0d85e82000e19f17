#pragma once
// The chunked loss's softmax pass on CUDA (cross_entropy_cuda_kernels.cu), on raw device
// pointers so that nvcc compiles no LibTorch header; models/layers/cross_entropy.cpp calls
// them for a chunk of logits on a CUDA device.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace memtune::models::cross_entropy_cuda {

// For the rows of e (n, V) fp32, contiguous: m[r] = the row's max and first_max[r] the
// first index holding it (a NaN counts as the largest value, as ATen's max), then
// e = exp(e - m) in place (expf, as ATen's exp_) and s[r] = the row's sum of it in fp32.
cudaError_t row_softmax_parts(float* e, int64_t n, int64_t V, float* m, float* s, int64_t* first_max,
                              cudaStream_t stream);

// For bf16 logits (n, V), contiguous: m, s and first_max as row_softmax_parts gives for the
// same logits taken to fp32, bit for bit (the same sums in the same order), without that fp32
// copy. Both read four elements at a time where V % 4 == 0 and the base is aligned to four
// elements (fresh tensors are), else one at a time; the bits agree where both read alike. With `targets` (n entries, each in [0, V)) the logits are then overwritten by
// d loss / d logits rounded to bf16, bit for bit what ATen's ops make of row_softmax_parts'
// output: `e.mul_(s.reciprocal()).scatter_add_(1, t, -1).to(bf16)`. Four passes over the
// bf16 logits (three reads and a write), where the copy to fp32, row_softmax_parts, the
// scaling and the rounding back made nine, seven of them over the fp32 copy, and kept the
// logits beside it (6 bytes per logit). Without targets only the first two passes run.
cudaError_t bf16_softmax_grad(void* logits, int64_t n, int64_t V, const int64_t* targets, float* m, float* s,
                              int64_t* first_max, cudaStream_t stream);

}  // namespace memtune::models::cross_entropy_cuda
