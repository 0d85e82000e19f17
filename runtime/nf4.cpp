#include "runtime/nf4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "runtime/error.h"
#include "runtime/nf4_kernels.h"
#ifdef MEMTUNE_CUDA
#include "runtime/cuda/nf4_cuda.h"
#endif

// Numerics follow bitsandbytes' CUDA kernels (csrc: kQuantizeBlockwise, dQuantizeNF4,
// dQuantizeFP4, dQuantize, kDequantizeBlockwise): x * (1.0f / absmax) in fp32, codes by
// strict ">" against fp32 midpoints (FP4: of |x|, with the sign bit for x < 0), dequantized
// value codebook[code] * absmax in fp32 (no fused multiply-add: this file is built without
// -mfma and the AVX2 path does not enable it).

namespace memtune {
namespace {

using namespace nf4_kernels;  // the codebook, its midpoints and the per-CPU kernels

// bitsandbytes' dQuantize<0>: binary search over the sorted 256-entry map, then the nearer
// neighbour by an fp32 midpoint. Ported step for step so ties resolve as there.
uint8_t dynamic_code(const float* code, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float val = code[pivot];
  for (int i = 64; i > 0; i >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += i;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= i;
    }
    val = code[pivot];
  }
  if (upper_pivot == 255) upper = code[upper_pivot];
  if (lower_pivot == 0) lower = code[lower_pivot];
  if (x > val) {
    float midpoint = (upper + val) * 0.5f;
    return static_cast<uint8_t>(x > midpoint ? upper_pivot : pivot);
  }
  float midpoint = (lower + val) * 0.5f;
  return static_cast<uint8_t>(x < midpoint ? lower_pivot : pivot);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool supported_float(at::ScalarType t) { return nf4_dtype_name(t) != nullptr; }

// fp32 absmax of blocks [b0, b1) into out.
void absmax_range(const NF4Tensor& q, int64_t b0, int64_t b1, float* out) {
  if (!q.double_quant) {
    std::memcpy(out, q.absmax.data_ptr<float>() + b0, sizeof(float) * (b1 - b0));
    return;
  }
  const uint8_t* codes = q.absmax.data_ptr<uint8_t>();
  const float* map = q.nested_quant_map.data_ptr<float>();
  const float* nested = q.nested_absmax.data_ptr<float>();
  const float offset = q.nested_offset;
  for (int64_t b = b0; b < b1; ++b) {
    float v = map[codes[b]] * nested[b / kNf4NestedBlocksize];
    out[b - b0] = v + offset;  // two roundings, as bitsandbytes (dequantize, then += offset)
  }
}

// ---- CPU dequantization kernels -------------------------------------------------------

// Dispatch: the AVX2 kernels (runtime/nf4_kernels_avx2.cpp) on CPUs that have AVX2.
void pairs(const uint8_t* p, int64_t nbytes, const float* codebook, float s, float* o) {
#ifdef MEMTUNE_X86
  if (cpu_has_avx2()) return pairs_avx2(p, nbytes, codebook, s, o);
#endif
  pairs_scalar(p, nbytes, codebook, s, o);
}

void block_codes(QuantType t, const float* x, int64_t len, float r, uint8_t* codes) {
#ifdef MEMTUNE_X86
  if (cpu_has_avx2()) return t == QuantType::kFP4 ? fp4_codes_avx2(x, len, r, codes) : nf4_codes_avx2(x, len, r, codes);
#endif
  codes_scalar(t, x, len, r, codes);
}

// Elements [a, z) of the flattened tensor, all in one block with scale s, into o (fp32).
void segment_fp32(const uint8_t* packed, const float* codebook, int64_t a, int64_t z, float s, float* o) {
  int64_t i = a;
  if (i < z && (i & 1)) {
    *o++ = codebook[packed[i >> 1] & 15] * s;
    ++i;
  }
  int64_t npairs = (z - i) / 2;
  pairs(packed + (i >> 1), npairs, codebook, s, o);
  o += 2 * npairs;
  i += 2 * npairs;
  if (i < z) *o = codebook[packed[i >> 1] >> 4] * s;
}

void convert(const float* src, int64_t n, c10::BFloat16* dst) {
#ifdef MEMTUNE_X86
  if (cpu_has_avx2()) return convert_bf16_avx2(src, n, dst);
#endif
  convert_scalar(src, n, dst);
}

void convert(const float* src, int64_t n, c10::Half* dst) {
#ifdef MEMTUNE_X86
  if (cpu_has_avx2() && cpu_has_f16c()) return convert_half_f16c(src, n, dst);
#endif
  convert_scalar(src, n, dst);
}

template <class T>
void dequantize_range_cpu(const NF4Tensor& q, int64_t begin, int64_t count, T* out) {
  if (count <= 0) return;
  const int64_t bs = q.blocksize;
  const uint8_t* packed = q.packed.data_ptr<uint8_t>();
  const float* codebook = codebook_of(q.quant_type).data();
  const int64_t end = begin + count;
  const int64_t b_first = begin / bs, b_last = (end - 1) / bs + 1;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / bs);
  at::parallel_for(b_first, b_last, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> scales(b1 - b0);
    absmax_range(q, b0, b1, scales.data());
    std::vector<float> tmp;
    if (!std::is_same<T, float>::value) tmp.resize(bs);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t a = std::max(begin, b * bs), z = std::min(end, (b + 1) * bs);
      T* dst = out + (a - begin);
      if constexpr (std::is_same<T, float>::value) {
        segment_fp32(packed, codebook, a, z, scales[b - b0], dst);
      } else {
        segment_fp32(packed, codebook, a, z, scales[b - b0], tmp.data());
        convert(tmp.data(), z - a, dst);
      }
    }
  });
}

// The 4-bit half of nf4_quantize on the CPU (any device's tensor is copied here first):
// checks that every value is finite, then packed codes and fp32 absmax per block.
void quantize_blocks_cpu(const at::Tensor& w, int64_t blocksize, QuantType type, const std::string& what,
                         at::Tensor& packed, at::Tensor& absmax) {
  at::Tensor x = w.detach().to(at::kCPU).to(at::kFloat).contiguous();
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  int64_t bad = 0, first_bad = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(xp[i])) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  MEMTUNE_CHECK(bad == 0, "nf4_quantize: ", what, " holds ", bad, " non-finite value(s) (inf/nan), first at flat index ",
                first_bad, " (value ", first_bad >= 0 ? xp[first_bad] : 0.0f,
                "); fix the checkpoint or the training run that produced it before quantizing");
  const int64_t nb = ceil_div(n, blocksize);
  packed = at::empty({ceil_div(n, 2)}, at::TensorOptions(at::kByte));
  absmax = at::empty({nb}, at::TensorOptions(at::kFloat));
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
  const uint8_t zero_code = code_of(type, 0.0f);
  at::parallel_for(0, nb, std::max<int64_t>(1, 16384 / blocksize), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t a = b * blocksize, z = std::min(n, a + blocksize);
      float m = -FLT_MAX;
      for (int64_t i = a; i < z; ++i) m = std::max(m, std::fabs(xp[i]));  // finite: no nan rules needed
      ap[b] = m;
      const int64_t len = z - a;
      uint8_t codes[4096 + 1];
      if (m == 0.0f) {
        std::memset(codes, zero_code, len);
      } else {
        block_codes(type, xp + a, len, 1.0f / m, codes);
      }
      codes[len] = zero_code;  // padding nibble of an odd-length tensor
      for (int64_t i = 0; i < len; i += 2) pp[(a + i) >> 1] = static_cast<uint8_t>((codes[i] << 4) | codes[i + 1]);
    }
  });
}

}  // namespace

void check_nf4_state(const NF4Tensor& q) {
  TORCH_CHECK(q.packed.defined() && q.packed.scalar_type() == at::kByte && q.packed.is_contiguous(),
              "NF4Tensor: packed must be a contiguous uint8 tensor");
  TORCH_CHECK(q.packed.numel() == ceil_div(q.numel(), 2), "NF4Tensor: packed has ", q.packed.numel(),
              " bytes, expected ", ceil_div(q.numel(), 2));
  TORCH_CHECK(q.absmax.defined() && q.absmax.numel() == q.nblocks() && q.absmax.is_contiguous(),
              "NF4Tensor: absmax must hold one entry per block");
  if (q.double_quant) {
    TORCH_CHECK(q.absmax.scalar_type() == at::kByte, "NF4Tensor: double-quantized absmax must be uint8");
    TORCH_CHECK(q.nested_absmax.defined() && q.nested_absmax.scalar_type() == at::kFloat &&
                    q.nested_absmax.numel() == ceil_div(q.nblocks(), kNf4NestedBlocksize),
                "NF4Tensor: nested_absmax must be fp32 [ceil(nblocks/256)]");
    TORCH_CHECK(q.nested_quant_map.defined() && q.nested_quant_map.scalar_type() == at::kFloat &&
                    q.nested_quant_map.numel() == 256,
                "NF4Tensor: nested_quant_map must be fp32 [256]");
  } else {
    TORCH_CHECK(q.absmax.scalar_type() == at::kFloat, "NF4Tensor: absmax must be fp32");
  }
}

const char* nf4_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return nullptr;
  }
}

const char* quant_type_name(QuantType t) { return t == QuantType::kFP4 ? "fp4" : "nf4"; }

const char* quant_type_label(QuantType t) { return t == QuantType::kFP4 ? "FP4" : "NF4"; }

QuantType quant_type_from_name(const std::string& name) {
  if (name == "nf4") return QuantType::kNF4;
  if (name == "fp4") return QuantType::kFP4;
  fail("4-bit quant type '", name, "' is not nf4 or fp4 (bitsandbytes' two 4-bit codes)");
}

const std::array<float, 16>& codebook_4bit(QuantType t) { return codebook_of(t); }

at::Tensor nf4_dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for i in 0..6,
  // 2^i means of linspace(0.1, 1, 2^i + 1) (fp32), times +-10^(i-6); then 0 and 1.0; sorted.
  static const at::Tensor map = [] {
    static const double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
    std::vector<float> data;
    for (int i = 0; i < 7; ++i) {
      at::Tensor b = at::linspace(0.1, 1.0, (int64_t{1} << i) + 1, at::TensorOptions(at::kFloat));
      const float* bp = b.data_ptr<float>();
      const float s = static_cast<float>(kScale[i]);
      std::vector<float> means;
      for (int64_t k = 0; k + 1 < b.numel(); ++k) means.push_back((bp[k] + bp[k + 1]) / 2.0f);
      for (float m : means) data.push_back(s * m);
      for (float m : means) data.push_back(-s * m);
    }
    data.push_back(0.0f);
    data.push_back(1.0f);
    TORCH_CHECK(data.size() == 256, "dynamic map has ", data.size(), " values");
    std::sort(data.begin(), data.end());
    return at::tensor(data, at::TensorOptions(at::kFloat));
  }();
  return map;
}

int64_t NF4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t NF4Tensor::nblocks() const { return ceil_div(numel(), blocksize); }

int64_t NF4Tensor::storage_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  return bytes(packed) + bytes(absmax) + bytes(nested_absmax) + bytes(nested_quant_map);
}

int64_t nf4_storage_bytes(int64_t numel, int64_t blocksize, bool double_quant) {
  const int64_t nblocks = (numel + blocksize - 1) / blocksize;
  const int64_t packed = (numel + 1) / 2;
  if (!double_quant) return packed + nblocks * 4;
  const int64_t nested = (nblocks + 255) / 256;
  return packed + nblocks + nested * 4 + 256 * 4;
}

double nf4_bits_per_parameter(const NF4Tensor& q) {
  const int64_t n = q.numel();
  return n == 0 ? 0.0 : 8.0 * static_cast<double>(q.storage_bytes()) / static_cast<double>(n);
}

NF4Tensor nf4_meta(const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t blocksize, bool double_quant,
                   QuantType quant_type) {
  NF4Tensor q;
  q.shape = shape;
  q.blocksize = blocksize;
  q.double_quant = double_quant;
  q.quant_type = quant_type;
  q.dtype = dtype;
  const int64_t nb = q.nblocks();
  auto meta = [](int64_t n, at::ScalarType t) { return at::empty({n}, at::TensorOptions(t).device(at::kMeta)); };
  q.packed = meta(ceil_div(q.numel(), 2), at::kByte);
  if (!double_quant) {
    q.absmax = meta(nb, at::kFloat);
  } else {
    q.absmax = meta(nb, at::kByte);
    q.nested_absmax = meta(ceil_div(nb, kNf4NestedBlocksize), at::kFloat);
    q.nested_quant_map = meta(256, at::kFloat);
  }
  return q;
}

NF4Tensor nf4_quantize(const at::Tensor& w, int64_t blocksize, bool double_quant, const std::string& name,
                       QuantType quant_type) {
  const std::string what = name.empty() ? std::string("tensor") : "tensor '" + name + "'";
  MEMTUNE_CHECK(w.defined(), "nf4_quantize: ", what, " is undefined");
  MEMTUNE_CHECK(supported_float(w.scalar_type()), "nf4_quantize: ", what, " has dtype ",
                w.scalar_type(), "; NF4 quantizes float32, float16 or bfloat16 weights");
  MEMTUNE_CHECK(blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0,
                "nf4_quantize: blocksize ", blocksize, " for ", what,
                " is not a power of two in [32, 4096]; bitsandbytes uses 64");

  NF4Tensor q;
  q.shape = w.sizes().vec();
  q.blocksize = blocksize;
  q.double_quant = double_quant;
  q.quant_type = quant_type;
  q.dtype = w.scalar_type();
  at::Tensor absmax;  // fp32 [nblocks]
#ifdef MEMTUNE_CUDA
  // On its device when the tensor is finite; otherwise the CPU's check names what is wrong.
  if (w.is_cuda() && at::isfinite(w.detach()).all().item<bool>())
    nf4_quantize_blocks_cuda(w.detach(), blocksize, quant_type, q.packed, absmax);
  else
#endif
    quantize_blocks_cpu(w, blocksize, quant_type, what, q.packed, absmax);

  if (!double_quant) {
    q.absmax = absmax;
  } else {
    // offset = absmax.mean(); (absmax - offset) quantized in blocks of 256 over the map. On
    // the CPU wherever the blocks were quantized (n / 64 values), so every device's bytes
    // are the CPU's, the mean's summation order included.
    const at::Tensor am = absmax.to(at::kCPU);
    const float* ap = am.data_ptr<float>();
    const int64_t nb = q.nblocks();
    const float offset = am.mean().item<float>();
    q.nested_offset = offset;
    q.nested_quant_map = nf4_dynamic_map().clone();
    const float* map = q.nested_quant_map.data_ptr<float>();
    const int64_t nb2 = ceil_div(nb, kNf4NestedBlocksize);
    q.nested_absmax = at::empty({nb2}, at::TensorOptions(at::kFloat));
    q.absmax = at::empty({nb}, at::TensorOptions(at::kByte));
    float* np = q.nested_absmax.data_ptr<float>();
    uint8_t* cp = q.absmax.data_ptr<uint8_t>();
    for (int64_t c = 0; c < nb2; ++c) {
      const int64_t a = c * kNf4NestedBlocksize, z = std::min(nb, a + kNf4NestedBlocksize);
      float m = -FLT_MAX;
      for (int64_t i = a; i < z; ++i) m = std::fmax(m, std::fabs(ap[i] - offset));
      np[c] = m;
      const float r = 1.0f / m;  // m == 0: x is nan and dQuantize returns 0; code[0] * 0 == 0
      for (int64_t i = a; i < z; ++i) cp[i] = dynamic_code(map, (ap[i] - offset) * r);
    }
  }

  if (!w.device().is_cpu()) {
    const auto dev = w.device();
    q.packed = q.packed.to(dev);
    q.absmax = q.absmax.to(dev);
    if (double_quant) {
      q.nested_absmax = q.nested_absmax.to(dev);
      q.nested_quant_map = q.nested_quant_map.to(dev);
    }
  }
  return q;
}

at::Tensor nf4_absmax_fp32(const NF4Tensor& q) {
  check_nf4_state(q);
  if (!q.double_quant) return q.absmax;
  if (q.device().is_cpu()) {
    at::Tensor out = at::empty({q.nblocks()}, at::TensorOptions(at::kFloat));
    absmax_range(q, 0, q.nblocks(), out.data_ptr<float>());
    return out;
  }
  at::Tensor scale = q.nested_absmax.repeat_interleave(kNf4NestedBlocksize).narrow(0, 0, q.nblocks());
  at::Tensor v = q.nested_quant_map.index_select(0, q.absmax.to(at::kLong)) * scale;
  return v + q.nested_offset;
}

void nf4_dequantize_range_into(const NF4Tensor& q, int64_t begin, int64_t count, at::Tensor& out) {
  check_nf4_state(q);
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu(), "nf4_dequantize_range_into: CPU only");
  TORCH_CHECK(begin >= 0 && count >= 0 && begin + count <= q.numel(), "nf4_dequantize_range_into: range [",
              begin, ", ", begin + count, ") outside ", q.numel(), " elements");
  TORCH_CHECK(out.is_contiguous() && out.numel() == count, "nf4_dequantize_range_into: out must be contiguous with ",
              count, " elements");
  switch (out.scalar_type()) {
    case at::kFloat: return dequantize_range_cpu(q, begin, count, out.data_ptr<float>());
    case at::kBFloat16: return dequantize_range_cpu(q, begin, count, out.data_ptr<c10::BFloat16>());
    case at::kHalf: return dequantize_range_cpu(q, begin, count, out.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, "nf4_dequantize_range_into: unsupported out dtype ", out.scalar_type());
  }
}

at::Tensor nf4_dequantize_generic(const NF4Tensor& q, at::ScalarType out_dtype) {
  check_nf4_state(q);
  const int64_t n = q.numel(), bs = q.blocksize, nb = q.nblocks();
  const auto opts = q.packed.options();
  at::Tensor hi = at::bitwise_right_shift(q.packed, 4);
  at::Tensor lo = at::bitwise_and(q.packed, 15);
  at::Tensor idx = at::stack({hi, lo}, 1).reshape({-1}).to(at::kLong);  // [2 * ceil(n/2)]
  const auto& cb = codebook_of(q.quant_type);
  at::Tensor codebook = at::tensor(std::vector<float>(cb.begin(), cb.end()), opts.dtype(at::kFloat));
  at::Tensor values = codebook.index_select(0, idx);
  const int64_t padded = nb * bs;
  if (values.numel() < padded) values = at::constant_pad_nd(values, {0, padded - values.numel()});
  values = values.narrow(0, 0, padded).view({nb, bs});
  at::Tensor out = (values * nf4_absmax_fp32(q).unsqueeze(1)).view({-1}).narrow(0, 0, n);
  return out.to(out_dtype).view(q.shape);
}

at::Tensor nf4_dequantize(const NF4Tensor& q, at::ScalarType out_dtype) {
  MEMTUNE_CHECK(supported_float(out_dtype), "nf4_dequantize: output dtype ", out_dtype,
                " is not float32, float16 or bfloat16 (bnb_4bit_compute_dtype)");
#ifdef MEMTUNE_CUDA
  if (q.device().is_cuda()) return nf4_dequantize_cuda(q, out_dtype);
#endif
  if (!q.device().is_cpu()) return nf4_dequantize_generic(q, out_dtype);
  at::Tensor out = at::empty({q.numel()}, at::TensorOptions(out_dtype));
  nf4_dequantize_range_into(q, 0, q.numel(), out);
  return out.view(q.shape);
}

}  // namespace memtune
