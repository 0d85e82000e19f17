// The AVX2 kernel of trainer/adamw8bit_kernels.h: adam8_blocks_scalar's bytes, 8 lanes at a
// time. Each function carries its own target attribute, so this file builds with the
// project's flags and adam8_blocks calls it only on CPUs with AVX2. Every fp32 operation is
// an explicit mul, add, div or sqrt intrinsic in the scalar kernel's order (no FMA: the target
// is avx2 alone and the file builds with -ffp-contract=off, also under -march=native).
#include "trainer/adamw8bit_kernels.h"

#ifdef MEMTUNE_X86
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstring>


#define MEMTUNE_AVX2 __attribute__((target("avx2"), always_inline)) inline

namespace memtune::trainer {

namespace {

// CodeTable::operator() on 8 lanes, through its cut table: one gather of the bucket's entry,
// its threshold compared with x's low 16 bits (flipped for negative x, as the entry's).
MEMTUNE_AVX2 __m256i codes8(const CodeTable& t, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i h = _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), 16);
  h = _mm256_min_epi32(_mm256_max_epi32(h, _mm256_set1_epi32(CodeTable::kBase)), _mm256_set1_epi32(CodeTable::kTop));
  const __m256i negative = _mm256_srai_epi32(bits, 31);
  const __m256i bucket = _mm256_add_epi32(_mm256_sub_epi32(h, _mm256_set1_epi32(CodeTable::kBase)),
                                          _mm256_and_si256(negative, _mm256_set1_epi32(CodeTable::kPerSign)));
  const __m256i cut = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.cut), bucket, 4);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  const __m256i mine = _mm256_xor_si256(_mm256_and_si256(bits, low16), _mm256_and_si256(negative, low16));
  const __m256i above = _mm256_cmpgt_epi32(mine, _mm256_srli_epi32(cut, 16));  // -1 where x is past it
  const __m256i lo = _mm256_and_si256(cut, _mm256_set1_epi32(0xFF));
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));  // NaN: code 0
  return _mm256_and_si256(_mm256_sub_epi32(lo, above), ordered);
}

// 8 codes (int32 lanes in 0..255) as 8 bytes.
MEMTUNE_AVX2 void store_codes(uint8_t* dst, __m256i c) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(w, w));
}

MEMTUNE_AVX2 float max8(__m256 x) {  // of non-NaN lanes: exact in any order
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// One full block of 256 elements, adam8_blocks_scalar's operations lane by lane.
MEMTUNE_AVX2 void block(const BnbScalars& s, const CodeTable& t1, const CodeTable& t2, float* p, const float* g,
                        uint8_t* c1, uint8_t* c2, float* absmax1, float* absmax2) {
  alignas(32) float s1[kBlock8bit], s2[kBlock8bit];
  const __m256 old1 = _mm256_set1_ps(*absmax1), old2 = _mm256_set1_ps(*absmax2);
  const __m256 gs = _mm256_set1_ps(s.gs), b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 one_minus_b1 = _mm256_set1_ps(s.one_minus_b1), one_minus_b2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 eps = _mm256_set1_ps(s.eps_c2), step = _mm256_set1_ps(s.step_size), decay = _mm256_set1_ps(s.decay);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  __m256 max1 = _mm256_set1_ps(-FLT_MAX), max2 = max1;
  for (int j = 0; j < kBlock8bit; j += 8) {
    const __m256 gj = _mm256_loadu_ps(g + j);
    // non-finite: all exponent bits set
    const __m256 bad = _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(gj), exponent), exponent));
    const __m256i k1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c1 + j)));
    const __m256i k2 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c2 + j)));
    const __m256 gv = _mm256_mul_ps(gj, gs);
    __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(t2.code, k2, 4), old2);
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(one_minus_b2, gv), gv));
    __m256 m = _mm256_mul_ps(_mm256_i32gather_ps(t1.code, k1, 4), old1);
    m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(one_minus_b1, gv));
    m = _mm256_andnot_ps(bad, m);  // +0.0 where the gradient is not finite
    v = _mm256_andnot_ps(bad, v);
    _mm256_store_ps(s1 + j, m);
    _mm256_store_ps(s2 + j, v);
    // a > max ? a : max, as the scalar kernel (a NaN state leaves the maximum)
    max1 = _mm256_max_ps(_mm256_and_ps(m, magnitude), max1);
    max2 = _mm256_max_ps(_mm256_and_ps(v, magnitude), max2);
    // p does not depend on the new absmax: updated in this pass
    const __m256 pj = _mm256_loadu_ps(p + j);
    __m256 pn = _mm256_add_ps(pj, _mm256_mul_ps(step, _mm256_div_ps(m, _mm256_add_ps(_mm256_sqrt_ps(v), eps))));
    if (s.decay_on) pn = _mm256_mul_ps(pn, decay);
    _mm256_storeu_ps(p + j, _mm256_blendv_ps(pn, pj, bad));
  }
  const float new1 = max8(max1), new2 = max8(max2);
  *absmax1 = new1;
  *absmax2 = new2;
  const __m256 d1 = _mm256_set1_ps(new1), d2 = _mm256_set1_ps(new2);
  const __m256i negatives = _mm256_set1_epi32(t1.negatives);
  for (int j = 0; j < kBlock8bit; j += 8) {
    const __m256 m = _mm256_load_ps(s1 + j), v = _mm256_load_ps(s2 + j);
    __m256i k1 = codes8(t1, _mm256_div_ps(m, d1));
    const __m256i k2 = codes8(t2, _mm256_div_ps(v, d2));
    // the first moment's code keeps its sign: where the code's sign bit (entries below
    // `negatives`) differs from m's, one step towards m's side (+1 where m > 0, else -1)
    const __m256i flip = _mm256_xor_si256(_mm256_cmpgt_epi32(negatives, k1), _mm256_srai_epi32(_mm256_castps_si256(m), 31));
    const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256i toward = _mm256_sub_epi32(_mm256_and_si256(positive, _mm256_set1_epi32(2)), _mm256_set1_epi32(1));
    k1 = _mm256_and_si256(_mm256_add_epi32(k1, _mm256_and_si256(flip, toward)), _mm256_set1_epi32(0xFF));
    store_codes(c1 + j, k1);
    store_codes(c2 + j, k2);
  }
}

}  // namespace

__attribute__((target("avx2"))) void adam8_blocks_avx2(const BnbScalars& s, const Adam8Tensors& t, int64_t b0,
                                                       int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kBlock8bit, len = std::min<int64_t>(kBlock8bit, t.n - base);
    if (len == kBlock8bit) {
      block(s, *t.t1, *t.t2, t.p + base, t.g + base, t.c1 + base, t.c2 + base, t.absmax1 + b, t.absmax2 + b);
      continue;
    }
    // The last, partial block: through a padded copy (the kernel's padded lanes: g 0, code1
    // 128, code2 0), of which the first len elements go back.
    alignas(32) float p[kBlock8bit] = {}, g[kBlock8bit] = {};
    uint8_t c1[kBlock8bit], c2[kBlock8bit] = {};
    std::memset(c1, 128, sizeof c1);
    std::memcpy(p, t.p + base, len * sizeof(float));
    std::memcpy(g, t.g + base, len * sizeof(float));
    std::memcpy(c1, t.c1 + base, len);
    std::memcpy(c2, t.c2 + base, len);
    block(s, *t.t1, *t.t2, p, g, c1, c2, t.absmax1 + b, t.absmax2 + b);
    std::memcpy(t.p + base, p, len * sizeof(float));
    std::memcpy(t.c1 + base, c1, len);
    std::memcpy(t.c2 + base, c2, len);
  }
}

__attribute__((target("avx2"))) void quantize_avx2(const CodeTable& table, const float* x, int64_t n, uint8_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_codes(out + i, codes8(table, _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = table(x[i]);
}

}  // namespace memtune::trainer

#endif  // MEMTUNE_X86
