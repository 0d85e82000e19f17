#pragma once
// 4-bit weights, byte for byte as bitsandbytes stores them (quantize_4bit with quant_type
// "nf4" or "fp4", optional double quantization of the absmax values); the serialized form of
// its checkpoints ("-bnb-4bit" models) is models/io/bnb_nf4.h. NF4 (QLoRA's normal-float
// code) is what recipes use and what names here say; FP4 differs only in its codebook and in
// how a scaled value picks its code.
//
// The codes are those of bitsandbytes' kernels evaluated in IEEE fp32 (1 / absmax correctly
// rounded, denormals kept). bitsandbytes' release builds compile them with --use_fast_math:
// an approximate reciprocal (a helper measured it one fp32 step off for 13 % of absmax
// values on an H200) and denormals flushed to zero. So a value within a step of a pivot can
// take the neighbouring code there, and a negative value that scales below FLT_MIN takes
// FP4's +0 code (0) where memtune gives -0 (8). Dequantizing FP4's code 8 gives +0.0 here
// and -0.0 in bitsandbytes' CUDA kernel (0 * -1): the same number. Layout, codebooks, state
// and every other byte are bitsandbytes'.
//
// Layout of a tensor of n elements, flattened row-major, in blocks of `blocksize`:
//   packed  uint8 [ceil(n/2)]: code of element 2k in the HIGH nibble, 2k+1 in the low one
//   absmax  per block max|x|: fp32 [nblocks], or with double quantization uint8 codes of
//           (absmax - nested_offset) in blocks of 256 over the signed dynamic map, each
//           256-block scaled by nested_absmax (fp32 [ceil(nblocks/256)]).
// Dequantized value: codebook_4bit(quant_type)[code] * absmax (fp32), cast to the output dtype.
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace memtune {

// bitsandbytes' two 4-bit codes (BitsAndBytesConfig.bnb_4bit_quant_type).
enum class QuantType : uint8_t { kNF4, kFP4 };

const char* quant_type_name(QuantType t);   // "nf4", "fp4": the config's and bitsandbytes' spelling
const char* quant_type_label(QuantType t);  // "NF4", "FP4": for logs and reports

// The quant type of a name quant_type_name gives; throws UserError for another.
QuantType quant_type_from_name(const std::string& name);

// bitsandbytes' codebook of a quant type (get_4bit_type); index = 4-bit code.
const std::array<float, 16>& codebook_4bit(QuantType t);

// bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
// 256 sorted fp32 values, the map double quantization uses.
at::Tensor nf4_dynamic_map();

constexpr int64_t kNf4NestedBlocksize = 256;  // bitsandbytes' fixed double-quant block

struct NF4Tensor {
  at::Tensor packed;            // uint8 [ceil(n/2)], first element in the HIGH nibble
  at::Tensor absmax;            // fp32 [nblocks] when !double_quant, else uint8 [nblocks]
  at::Tensor nested_absmax;     // fp32 [ceil(nblocks/256)] (double_quant only)
  at::Tensor nested_quant_map;  // fp32 [256] dynamic map (double_quant only)
  float nested_offset = 0.0f;   // mean of the fp32 absmax values (double_quant only)
  std::vector<int64_t> shape;   // original shape
  int64_t blocksize = 64;
  bool double_quant = true;
  QuantType quant_type = QuantType::kNF4;
  at::ScalarType dtype = at::kFloat;  // original dtype

  int64_t numel() const;
  int64_t nblocks() const;
  // Bytes of every tensor held (packed, absmax, nested_absmax, nested_quant_map).
  int64_t storage_bytes() const;
  at::Device device() const { return packed.device(); }
};

// The form nf4_quantize gives a tensor of this shape and dtype, as meta tensors (shapes and
// dtypes, no memory; nested_offset 0): a placeholder for a weight another process holds.
NF4Tensor nf4_meta(const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t blocksize, bool double_quant,
                   QuantType quant_type = QuantType::kNF4);

// Quantizes a float32/float16/bfloat16 tensor with the codebook of `quant_type`. `name` only
// labels error messages. Throws UserError on inf/nan (count and first flat index) and on a
// blocksize that is not a power of two in [32, 4096]. A CUDA tensor's blocks are quantized
// on its device (runtime/cuda/nf4_cuda.h), their double quantization on the CPU: the bytes
// are the CPU's. An all-zero block gets the code of 0.0 for every element.
NF4Tensor nf4_quantize(const at::Tensor& w, int64_t blocksize = 64, bool double_quant = true,
                       const std::string& name = "", QuantType quant_type = QuantType::kNF4);

// Dequantizes to shape q.shape in out_dtype (fp32 math, then one cast). The CPU kernel is
// vectorized (AVX2 when the CPU has it) and parallel; on CUDA one kernel gives the same
// bits (runtime/cuda/nf4_cuda.h); other devices use tensor ops.
at::Tensor nf4_dequantize(const NF4Tensor& q, at::ScalarType out_dtype);

// Elements [begin, begin + count) of the flattened tensor into `out` (contiguous CPU
// tensor of `count` elements, fp32/bf16/fp16). For fused use: a panel of rows at a time.
void nf4_dequantize_range_into(const NF4Tensor& q, int64_t begin, int64_t count, at::Tensor& out);

// The device-generic path (tensor ops only; runs wherever q lives). Exposed for tests.
at::Tensor nf4_dequantize_generic(const NF4Tensor& q, at::ScalarType out_dtype);

// The fp32 absmax per block ([nblocks]), undoing double quantization when present.
at::Tensor nf4_absmax_fp32(const NF4Tensor& q);

// Bytes nf4_quantize makes for n elements, before quantizing (storage_bytes() of the result):
// n/2 codes and fp32 absmax per block, or with double quantization uint8 absmax codes, fp32
// per 256 blocks and the 256-entry fp32 map.
int64_t nf4_storage_bytes(int64_t numel, int64_t blocksize, bool double_quant);

// Storage in bits per parameter: 8 * storage_bytes() / numel() (about 4.127 with double
// quantization at blocksize 64 for large tensors, 4.5 without).
double nf4_bits_per_parameter(const NF4Tensor& q);

// The name of a dense dtype NF4 works from and back to, as bitsandbytes' state writes it
// (float32, float16, bfloat16); nullptr for any other.
const char* nf4_dtype_name(at::ScalarType t);

// Throws when q's fields disagree with each other (sizes, dtypes): an invariant of memtune's
// own code, checked before a kernel or a writer trusts them.
void check_nf4_state(const NF4Tensor& q);

}  // namespace memtune
