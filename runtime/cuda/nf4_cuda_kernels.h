#pragma once
// The 4-bit (NF4, FP4) CUDA kernels (nf4_cuda_kernels.cu), on raw device pointers so that nvcc compiles no
// LibTorch header; runtime/cuda/nf4_cuda.cpp checks the tensors and calls these. The
// numerics are runtime/nf4.cpp's, operation for operation (no fused multiply-add), so the
// results equal the CPU kernels' bit for bit.
#include <cstdint>

#include <cuda_runtime_api.h>

namespace memtune::nf4_cuda {

enum class OutType { kFloat, kHalf, kBFloat16 };

// The per-block scales, as the quantized state stores them: fp32 absmax per block, or with
// double quantization the uint8 codes over `nested_map` (256 entries) scaled per 256 blocks
// by `nested_absmax`, plus `nested_offset`.
struct Scales {
  const float* absmax = nullptr;         // fp32 [nblocks] (no double quantization)
  const uint8_t* absmax_codes = nullptr; // uint8 [nblocks] (double quantization)
  const float* nested_absmax = nullptr;  // fp32 [ceil(nblocks / 256)]
  const float* nested_map = nullptr;     // fp32 [256]
  float nested_offset = 0.0f;
};

// out[i] = codebook[code_i] * scale(block of i), i < n, cast once (round to nearest even).
// `packed` holds ceil(n / 2) bytes, element 2k in the high nibble; `codebook` is 16 host
// floats; blocksize a power of two >= 32. Launched on `stream`; returns the launch's error.
cudaError_t dequantize(const uint8_t* packed, const Scales& scales, const float* codebook, int64_t n,
                       int64_t blocksize, OutType out_type, void* out, cudaStream_t stream);

enum class InType { kFloat, kHalf, kBFloat16 };

// How a value v scaled into [-1, 1] gets its 4-bit code (bitsandbytes' dQuantizeNF4 and
// dQuantizeFP4). NF4: the number of the 15 `thresholds` (sorted midpoints) v exceeds. FP4
// (sign_magnitude): 8 when v < 0, or-ed with magnitude_codes[the number of the first 7
// thresholds |v| exceeds].
struct CodeRule {
  bool sign_magnitude = false;
  float thresholds[15] = {};
  uint8_t magnitude_codes[8] = {};
};

// absmax[b] = max |x| over block b, then packed codes of x * (1 / absmax[b]) by `rule`; the
// code of 0.0 for a block of zeros and for the padding nibble of an odd n. x (contiguous)
// must be finite.
cudaError_t quantize(const void* x, InType in_type, const CodeRule& rule, int64_t n, int64_t blocksize,
                     uint8_t* packed, float* absmax, cudaStream_t stream);

}  // namespace memtune::nf4_cuda
