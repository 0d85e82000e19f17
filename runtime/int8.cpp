#include "runtime/int8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace memtune {

namespace {

// Rows of a 2-D tensor quantized at once: bounds the fp32 copy a slice makes.
constexpr int64_t kSliceElements = int64_t{1} << 24;
// Elements of k per fp32 product in int8_matmul_i32: 127 * 127 * 1024 < 2^24.
constexpr int64_t kExactK = 1024;

// round(x * scale) half to even, as int8, with scale = reciprocal(absmax) * 127: the default
// ops' `127.0 / row_stats` (torch's __rtruediv__ multiplies by the reciprocal), and the CUDA
// kernel's __fdividef(127, absmax), PTX's div.approx.f32, "computed as a * (1/b)" with an
// approximate reciprocal, taken here as correctly rounded (one a GPU rounds otherwise moves a
// code only at an exact tie). A row whose absmax is 0 (or, in the CUDA kernel, holds only
// outliers) gets zeros, as __float2int_rn gives 0 for the NaN of 0 * inf.
at::Tensor row_codes(const at::Tensor& x32, const at::Tensor& absmax) {
  const at::Tensor scale = at::reciprocal(absmax) * 127.0f;
  at::Tensor q = at::round(x32 * scale.unsqueeze(1));
  q = at::where(at::isfinite(q), q, at::zeros({}, q.options()));
  return q.to(at::kChar);
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "other";
}

}  // namespace

at::Tensor int8_addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  // LibTorch's CPU kernels have no float16 GEMM: fp32 sums rounded once, as cuBLAS's.
  if (c.device().is_cpu() && c.scalar_type() == at::kHalf)
    return at::addmm(c.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat)).to(at::kHalf);
  return at::addmm(c, a, b);
}

Int8Rows int8_quantize_rows(const at::Tensor& w, const std::string& name) {
  MEMTUNE_CHECK(w.dim() == 2, name, ": an 8-bit weight is a matrix [out, in], got ", w.dim(), " dimensions");
  MEMTUNE_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
                name, ": 8-bit quantization reads float32, bfloat16 or float16 weights, got ", w.scalar_type());
  const int64_t out = w.size(0), in = w.size(1);
  Int8Rows r;
  r.codes = at::empty({out, in}, w.options().dtype(at::kChar));
  r.absmax = at::empty({out}, w.options().dtype(at::kFloat));
  const int64_t rows = std::max<int64_t>(1, kSliceElements / std::max<int64_t>(in, 1));
  for (int64_t r0 = 0; r0 < out; r0 += rows) {
    const int64_t n = std::min(rows, out - r0);
    // bitsandbytes quantizes the float16 cast of the weight (Int8Params._quantize).
    const at::Tensor w32 = w.narrow(0, r0, n).to(at::kHalf).to(at::kFloat);
    const at::Tensor bad = at::logical_not(at::isfinite(w32));
    if (bad.any().item<bool>()) {
      const int64_t flat = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
      const int64_t row = r0 + flat / in, col = flat % in;
      fail(name, ": element [", row, ", ", col, "] is ", w[row][col].item<double>(), " (", dtype_name(w.scalar_type()),
           "), not finite in float16, which LLM.int8 quantizes from (bitsandbytes casts the weight to float16 "
           "first; float16's largest value is 65504). Hint: load_in_4bit, or a dense model");
    }
    const at::Tensor absmax = w32.abs().amax(1);
    r.absmax.narrow(0, r0, n).copy_(absmax);
    r.codes.narrow(0, r0, n).copy_(row_codes(w32, absmax));
  }
  return r;
}

namespace {

template <typename T>
void dequantize_rows(const int8_t* codes, const float* absmax, int64_t r0, int64_t n, int64_t in, T* out) {
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(in, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      // SCB * (1/127) rounded to fp32 as the tensor op rounds it, then one product per element.
      const float s = absmax[r0 + r] * static_cast<float>(1.0 / 127.0);
      const int8_t* c = codes + (r0 + r) * in;
      T* o = out + r * in;
      for (int64_t j = 0; j < in; ++j) o[j] = static_cast<T>(static_cast<float>(c[j]) * s);
    }
  });
}

}  // namespace

void int8_dequantize_rows_into(const at::Tensor& codes, const at::Tensor& absmax, int64_t r0, int64_t n,
                               at::Tensor& out) {
  MEMTUNE_CHECK(codes.is_cpu() && codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.dim() == 2 &&
                    absmax.is_cpu() && absmax.scalar_type() == at::kFloat && absmax.is_contiguous(),
                "int8_dequantize_rows_into: needs contiguous CPU int8 codes and fp32 absmax");
  const int64_t in = codes.size(1);
  MEMTUNE_CHECK(r0 >= 0 && n >= 0 && r0 + n <= codes.size(0) && out.is_cpu() && out.is_contiguous() &&
                    out.numel() == n * in,
                "int8_dequantize_rows_into: rows [", r0, ", ", r0 + n, ") of ", codes.sizes(), " into ", out.sizes());
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* a = absmax.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: return dequantize_rows(c, a, r0, n, in, out.data_ptr<float>());
    case at::kBFloat16: return dequantize_rows(c, a, r0, n, in, out.data_ptr<c10::BFloat16>());
    case at::kHalf: return dequantize_rows(c, a, r0, n, in, out.data_ptr<c10::Half>());
    default: fail("int8_dequantize_rows_into: output dtype ", out.scalar_type(), " (float32, bfloat16, float16)");
  }
}

at::Tensor int8_dequantize(const at::Tensor& codes, const at::Tensor& absmax, at::ScalarType dtype) {
  // CB.to(dtype).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0)): the scale in fp32, the product in
  // fp32 (the int8 code is exact in any dtype), one rounding to dtype.
  if (codes.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf)) {
    at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(dtype));
    int8_dequantize_rows_into(codes.contiguous(), absmax.contiguous(), 0, codes.size(0), out);
    return out;
  }
  const at::Tensor scale = absmax.to(at::kFloat) * static_cast<float>(1.0 / 127.0);
  return (codes.to(at::kFloat) * scale.unsqueeze(1)).to(dtype);
}

at::Tensor int8_matmul_i32(const at::Tensor& a, const at::Tensor& b) {
  MEMTUNE_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.scalar_type() == at::kChar &&
                    b.scalar_type() == at::kChar,
                "int8_matmul_i32: needs int8 [m, k] and [n, k], got ", a.scalar_type(), " ", a.sizes(), " and ",
                b.scalar_type(), " ", b.sizes());
  const int64_t k = a.size(1);
  at::Tensor acc = at::zeros({a.size(0), b.size(0)}, a.options().dtype(at::kInt));
  for (int64_t k0 = 0; k0 < k; k0 += kExactK) {
    const int64_t n = std::min(kExactK, k - k0);
    const at::Tensor part = at::mm(a.narrow(1, k0, n).to(at::kFloat), b.narrow(1, k0, n).to(at::kFloat).t());
    acc.add_(part.to(at::kInt));
  }
  return acc;
}

at::Tensor int8_mixed_matmul(const at::Tensor& a, const at::Tensor& codes, const at::Tensor& absmax,
                             const at::Tensor& bias, double threshold, Int8Flavour flavour, at::ScalarType autocast,
                             Int8MixedParts* parts) {
  MEMTUNE_CHECK(a.dim() == 2 && codes.dim() == 2 && a.size(1) == codes.size(1), "int8_mixed_matmul: input ",
                a.sizes(), " and 8-bit weight ", codes.sizes(), " do not multiply");
  MEMTUNE_CHECK(threshold >= 0, "int8_mixed_matmul: the outlier threshold is ", threshold, ", not >= 0");
  const at::ScalarType D = a.scalar_type();
  const int64_t rows = a.size(0);
  // The float16 input, in fp32 (exact) for the arithmetic below.
  const at::Tensor a32 = a.to(at::kHalf).to(at::kFloat);
  const at::Tensor mag = a32.abs();
  // Outlier columns: any |a| >= t, compared in float16 (the scalar cast to the tensor's dtype).
  const float t32 = static_cast<float>(threshold);
  const float t16 = static_cast<float>(c10::Half(t32));
  at::Tensor cols = at::empty({0}, a.options().dtype(at::kLong));
  if (threshold > 0) cols = at::nonzero((mag >= t16).any(0)).reshape(-1);

  at::Tensor sca, ca;
  if (flavour == Int8Flavour::kCuda) {
    // kInt8VectorQuant: the absmax of the values below the threshold (in float16; its start,
    // -FLT_MIN, is -0 there, what a row of outliers keeps), and outliers coded 0.
    at::Tensor kept = threshold > 0 ? mag < t16 : at::ones_like(mag, mag.options().dtype(at::kBool));
    sca = at::where(kept, mag, at::zeros({}, mag.options())).amax(1);
    sca = at::where(kept.any(1), sca, at::full({}, -0.0f, sca.options()));
    ca = row_codes(a32, sca);
    if (threshold > 0) ca.masked_fill_(at::logical_not(mag < t32), 0);
  } else {
    // The default op zeroes the outliers, then quantizes every row as a weight row.
    const at::Tensor zeroed = threshold > 0 ? a32.masked_fill(mag >= t16, 0.0f) : a32;
    sca = zeroed.abs().amax(1);
    ca = row_codes(zeroed, sca);
  }
  if (rows > 1 && cols.numel() > 0) ca.index_fill_(1, cols, 0);

  const at::Tensor i32 = int8_matmul_i32(ca, codes);
  at::Tensor base;
  if (flavour == Int8Flavour::kCuda) {
    // kdequant_mm_int32_fp16: fmaf(v * SCA[i] * SCB[j], 1/127^2 as 6.200012e-05f, b), the
    // bias fused when float16 (an fp64 sum then one rounding to fp32 stands for fmaf: a
    // double rounding can differ from it only at a tie, in 1 of about 2^29 values), else
    // added to the float16 result; then a's dtype.
    // In place, one rounding an op as the kernel's (its memory: the int32 result and one fp32
    // or fp64 copy beside it).
    at::Tensor v = i32.to(at::kFloat);
    v.mul_(sca.unsqueeze(1)).mul_(absmax.unsqueeze(0));
    constexpr float kConst = 6.200012e-05f;
    at::Tensor out16;
    if (bias.defined() && bias.scalar_type() == at::kHalf) {
      at::Tensor fused = v.to(at::kDouble);
      v = at::Tensor();
      fused.mul_(static_cast<double>(kConst)).add_(bias.to(at::kDouble).unsqueeze(0));
      out16 = fused.to(at::kFloat).to(at::kHalf);
    } else {
      v.mul_(kConst).add_(0.0f);  // + 0.0: fmaf's sum with b = +0 (a -0 becomes +0)
      out16 = v.to(at::kHalf);
      v = at::Tensor();
      if (bias.defined()) out16 = (out16.to(at::kFloat) + bias.to(at::kFloat).unsqueeze(0)).to(at::kHalf);
    }
    base = out16.to(D);
  } else {
    // int8_mm_dequant's default: A * (row_stats * col_stats) * 6.200124e-05, + bias, in fp32.
    at::Tensor out = i32.to(at::kFloat);
    out.mul_(sca.unsqueeze(1) * absmax.unsqueeze(0)).mul_(6.200124e-05f);
    if (bias.defined()) out.add_(bias.to(at::kFloat).unsqueeze(0));
    base = out.to(D);
  }
  at::Tensor y = base;
  if (cols.numel() > 0) {
    // The outlier columns in a's dtype: int8_vectorwise_dequant (CB * SCB * 1/127, left to
    // right in fp32), then addmm, which a torch.autocast region takes into its dtype.
    const at::Tensor sub_a = a.index_select(1, cols);
    const at::Tensor sub_b =
        ((codes.index_select(1, cols).to(at::kFloat) * absmax.unsqueeze(1)) * static_cast<float>(7.874015718698502e-3))
            .to(D);
    if (autocast != at::ScalarType::Undefined && autocast != D)
      y = int8_addmm(base.to(autocast), sub_a.to(autocast), sub_b.to(autocast).t());
    else
      y = int8_addmm(base, sub_a, sub_b.t());
  }
  if (parts) *parts = Int8MixedParts{ca, sca, cols, i32, base};
  return y;
}

}  // namespace memtune
