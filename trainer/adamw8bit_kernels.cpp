// bitsandbytes' 8-bit AdamW maps and scalars, the portable kernel and the code tables (see
// adamw8bit_kernels.h), and the dispatch to the AVX2 kernel. Built with -ffp-contract=off.
#include "trainer/adamw8bit_kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

namespace memtune::trainer {

namespace {

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Floats in their numeric order as integers (-0.0 and 0.0 both at 0), and back.
int64_t order_key(float x) {
  const uint32_t b = bits_of(x);
  return b >> 31 ? -static_cast<int64_t>(b & 0x7FFFFFFFu) : static_cast<int64_t>(b);
}

float from_order_key(int64_t k) {
  return k < 0 ? float_of(static_cast<uint32_t>(-k) | 0x80000000u) : float_of(static_cast<uint32_t>(k));
}

}  // namespace

uint8_t quantize_dynamic(bool is_signed, float x) { return code_table(is_signed)(x); }

at::Tensor dynamic_map(bool is_signed) {
  // create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for i in 0..6, the means
  // of linspace(0.1, 1, 2^i + 1) (signed) or linspace(0.1, 1, 2^(i+1) + 1) (unsigned), fp32,
  // times 10^(i-6) (and its negative when signed); then 0 and 1.0; sorted.
  auto build = [](bool sg) {
    static const double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
    std::vector<float> data;
    for (int i = 0; i < 7; ++i) {
      at::Tensor b = at::linspace(0.1, 1.0, (int64_t{1} << (sg ? i : i + 1)) + 1, at::TensorOptions(at::kFloat));
      const float* bp = b.data_ptr<float>();
      const float sc = static_cast<float>(kScale[i]);
      for (int64_t k = 0; k + 1 < b.numel(); ++k) data.push_back(sc * ((bp[k] + bp[k + 1]) / 2.0f));
      if (sg)
        for (int64_t k = 0; k + 1 < b.numel(); ++k) data.push_back(-sc * ((bp[k] + bp[k + 1]) / 2.0f));
    }
    data.push_back(0.0f);
    data.push_back(1.0f);
    TORCH_CHECK(data.size() == 256, "dynamic map has ", data.size(), " values");
    std::sort(data.begin(), data.end());
    return at::tensor(data, at::TensorOptions(at::kFloat));
  };
  static const at::Tensor kSigned = build(true), kUnsigned = build(false);
  return is_signed ? kSigned : kUnsigned;
}

CodeTable::CodeTable(const float* map, bool is_signed) : code(map) {
  auto search = [&](float x) { return quantize_2d_search(code, is_signed, x); };
  negatives = 0;
  while (negatives < 256 && std::signbit(code[negatives])) ++negatives;
  for (int k = negatives; k < 256; ++k) TORCH_CHECK(!std::signbit(code[k]), "code table: signs out of order at ", k);
  // Every entry is its own code, so threshold j lies in [code[j-1], code[j]): bisect there for
  // the last float whose code is below j, then check the step at it.
  for (int j = 1; j < 256; ++j) {
    int64_t below = order_key(code[j - 1]), above = order_key(code[j]);
    TORCH_CHECK(search(code[j - 1]) == j - 1 && search(code[j]) == j, "code table: entry ", j, " is not its own code");
    while (above - below > 1) {
      const int64_t mid = below + (above - below) / 2;
      (search(from_order_key(mid)) < j ? below : above) = mid;
    }
    upper[j] = from_order_key(below);
    TORCH_CHECK(search(upper[j]) == j - 1 && search(from_order_key(below + 1)) == j, "code table: threshold ", j);
  }
  upper[0] = -std::numeric_limits<float>::infinity();  // unused
  upper[256] = std::numeric_limits<float>::infinity();
  for (int j = 2; j < 256; ++j) TORCH_CHECK(upper[j - 1] < upper[j], "code table: thresholds out of order at ", j);
  std::memset(lo, 0, sizeof lo);
  // Each bucket's floats, lowest to highest (the top buckets run to +-inf; NaN is masked).
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t h = kBase; h <= kTop; ++h) {
      const uint32_t first = h == kBase ? 0 : h << 16;
      const uint32_t last = h == kTop ? 0x7F800000u : (h << 16) | 0xFFFFu;
      const float a = sign ? -float_of(last) : float_of(first), z = sign ? -float_of(first) : float_of(last);
      const uint32_t at = bucket(bits_of(a));
      TORCH_CHECK(at == bucket(bits_of(z)) && at == h - kBase + sign * kPerSign, "code table: bucket ", h);
      const int ca = search(a), cz = search(z);
      // At most one threshold inside: the table's one comparison decides the rest.
      TORCH_CHECK(cz - ca <= 1, "code table: bucket ", sign ? "-" : "+", h, " spans codes ", ca, "..", cz);
      lo[at] = static_cast<uint8_t>(ca);
      TORCH_CHECK((*this)(a) == ca && (*this)(z) == cz, "code table: bucket ", h, " edges");
      uint32_t t = 0xFFFFu;  // no threshold inside: nothing passes
      if (cz > ca) {
        TORCH_CHECK(h != kBase && h != kTop, "code table: a threshold inside the clamped bucket ", h);
        const uint32_t u = bits_of(upper[ca + 1]);
        TORCH_CHECK(bucket(u) == at, "code table: bucket ", h, "'s threshold lies outside it");
        t = (u & 0xFFFFu) ^ (sign ? 0xFFFFu : 0u);
      }
      cut[at] = static_cast<uint32_t>(ca) | t << 16;
    }
}

uint8_t CodeTable::operator()(float x) const {
  const int l = lo[bucket(bits_of(x))];
  const int c = l + (x > upper[l + 1]);
  return static_cast<uint8_t>(x == x ? c : 0);  // NaN: the search's code 0
}

const CodeTable& code_table(bool is_signed) {
  static const CodeTable kSigned(dynamic_map(true).data_ptr<float>(), true);
  static const CodeTable kUnsigned(dynamic_map(false).data_ptr<float>(), false);
  return is_signed ? kSigned : kUnsigned;
}

// bitsandbytes' kOptimizerStatic8bit2StateBlockwise<ADAM, 256>, one block of 256 lanes per
// iteration: dequantize with the old absmax, update the fp32 states, take the new absmax
// over the block (lanes past the tensor's end count with g 0, code1 128, code2 0, as the
// kernel's padded loads), update p from the unquantized states, requantize. A non-finite
// gradient zeroes that element's states and leaves its parameter.
void adam8_blocks_scalar(const BnbScalars& s, const Adam8Tensors& t, int64_t b0, int64_t b1) {
  const float *q1 = t.t1->code, *q2 = t.t2->code;
  float s1[kBlock8bit], s2[kBlock8bit];
  bool finite[kBlock8bit];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kBlock8bit, len = std::min<int64_t>(kBlock8bit, t.n - base);
    const float old1 = t.absmax1[b], old2 = t.absmax2[b];
    float max1 = -FLT_MAX, max2 = -FLT_MAX;
    for (int64_t j = 0; j < kBlock8bit; ++j) {
      const bool in = j < len;
      const float gj = in ? t.g[base + j] : 0.0f;
      const uint8_t k1 = in ? t.c1[base + j] : 128, k2 = in ? t.c2[base + j] : 0;
      finite[j] = std::isfinite(gj);
      const float gv = gj * s.gs;
      float v = q2[k2] * old2;
      v = v * s.b2 + (s.one_minus_b2 * gv) * gv;
      float m = q1[k1] * old1;
      m = m * s.b1 + s.one_minus_b1 * gv;
      s1[j] = finite[j] ? m : 0.0f;
      s2[j] = finite[j] ? v : 0.0f;
      // fmax(max, |s|): a NaN state leaves the maximum
      const float a1 = std::fabs(s1[j]), a2 = std::fabs(s2[j]);
      max1 = a1 > max1 ? a1 : max1;
      max2 = a2 > max2 ? a2 : max2;
    }
    t.absmax1[b] = max1;
    t.absmax2[b] = max2;
    for (int64_t j = 0; j < len; ++j) {
      float pj = t.p[base + j] + s.step_size * (s1[j] / (std::sqrt(s2[j]) + s.eps_c2));
      if (s.decay_on) pj = pj * s.decay;
      t.p[base + j] = finite[j] ? pj : t.p[base + j];
    }
    for (int64_t j = 0; j < len; ++j) {
      int k1 = (*t.t1)(s1[j] / max1);
      // the first moment's code keeps its sign (bitsandbytes moves it one step)
      if (std::signbit(q1[k1]) != std::signbit(s1[j])) k1 = s1[j] > 0.0f ? k1 + 1 : k1 - 1;
      t.c1[base + j] = static_cast<uint8_t>(k1);
      t.c2[base + j] = (*t.t2)(s2[j] / max2);
    }
  }
}

void quantize_states_8bit(const float* m, const float* v, int64_t n, uint8_t* c1, uint8_t* c2, float* absmax1,
                          float* absmax2) {
  const CodeTable &t1 = code_table(true), &t2 = code_table(false);
  const float* q1 = t1.code;
  for (int64_t b = 0; b * kBlock8bit < n; ++b) {
    const int64_t base = b * kBlock8bit, len = std::min<int64_t>(kBlock8bit, n - base);
    float max1 = -FLT_MAX, max2 = -FLT_MAX;  // as the kernel's: fmax, a NaN leaves it
    for (int64_t j = 0; j < kBlock8bit; ++j) {
      const float a1 = j < len ? std::fabs(m[base + j]) : 0.0f, a2 = j < len ? std::fabs(v[base + j]) : 0.0f;
      max1 = a1 > max1 ? a1 : max1;
      max2 = a2 > max2 ? a2 : max2;
    }
    absmax1[b] = max1;
    absmax2[b] = max2;
    for (int64_t j = 0; j < len; ++j) {
      const float s1 = m[base + j];
      int k1 = t1(s1 / max1);
      if (std::signbit(q1[k1]) != std::signbit(s1)) k1 = s1 > 0.0f ? k1 + 1 : k1 - 1;
      c1[base + j] = static_cast<uint8_t>(k1);
      c2[base + j] = t2(v[base + j] / max2);
    }
  }
}

void adam8_blocks(const BnbScalars& s, const Adam8Tensors& t, int64_t b0, int64_t b1) {
#ifdef MEMTUNE_X86
  if (cpu_has_avx2()) return adam8_blocks_avx2(s, t, b0, b1);
#endif
  adam8_blocks_scalar(s, t, b0, b1);
}

}  // namespace memtune::trainer
