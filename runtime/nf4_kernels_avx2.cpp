// The AVX2 kernels of runtime/nf4_kernels.h. Each function carries its own target
// attribute, so this file builds with the project's flags and the dispatcher in nf4.cpp calls
// it only on CPUs with AVX2; no fused multiply-add anywhere (bitsandbytes' rounding).
#include "runtime/nf4_kernels.h"

#ifdef MEMTUNE_X86
#include <immintrin.h>

namespace memtune::nf4_kernels {

namespace {

// 8 nibble indices (low 8 bytes of idx) -> 8 codebook values times scale.
__attribute__((target("avx2"), always_inline)) inline __m256 lookup8(__m128i idx, __m256 lut_lo,
                                                                      __m256 lut_hi, __m256 scale) {
  __m256i i = _mm256_cvtepu8_epi32(idx);
  __m256 a = _mm256_permutevar8x32_ps(lut_lo, i);
  __m256 b = _mm256_permutevar8x32_ps(lut_hi, i);
  __m256 use_hi = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));  // bit 3 -> sign bit
  return _mm256_mul_ps(_mm256_blendv_ps(a, b, use_hi), scale);
}

}  // namespace

__attribute__((target("avx2"))) void pairs_avx2(const uint8_t* p, int64_t nbytes, const float* codebook,
                                                float s, float* o) {
  const __m256 lut_lo = _mm256_loadu_ps(codebook);
  const __m256 lut_hi = _mm256_loadu_ps(codebook + 8);
  const __m256 scale = _mm256_set1_ps(s);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  int64_t k = 0;
  for (; k + 16 <= nbytes; k += 16) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    __m128i lo = _mm_and_si128(bytes, low4);
    __m128i e0 = _mm_unpacklo_epi8(hi, lo);  // elements 0..15 of these 32
    __m128i e1 = _mm_unpackhi_epi8(hi, lo);  // elements 16..31
    float* d = o + 2 * k;
    _mm256_storeu_ps(d, lookup8(e0, lut_lo, lut_hi, scale));
    _mm256_storeu_ps(d + 8, lookup8(_mm_srli_si128(e0, 8), lut_lo, lut_hi, scale));
    _mm256_storeu_ps(d + 16, lookup8(e1, lut_lo, lut_hi, scale));
    _mm256_storeu_ps(d + 24, lookup8(_mm_srli_si128(e1, 8), lut_lo, lut_hi, scale));
  }
  pairs_scalar(p + k, nbytes - k, codebook, s, o + 2 * k);
}

namespace {

// Eight int32 codes (0..15) to eight bytes at `codes`.
__attribute__((target("avx2"), always_inline)) inline void store_codes8(__m256i c, uint8_t* codes) {
  __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(w, w));
}

}  // namespace

__attribute__((target("avx2"))) void nf4_codes_avx2(const float* x, int64_t len, float r, uint8_t* codes) {
  __m256 th[15];
  for (int j = 0; j < 15; ++j) th[j] = _mm256_set1_ps(kNf4Thresholds[j]);
  const __m256 scale = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
    __m256i c = _mm256_setzero_si256();
    for (int j = 0; j < 15; ++j)  // each true compare is -1
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v, th[j], _CMP_GT_OQ)));
    store_codes8(c, codes + i);
  }
  codes_scalar(QuantType::kNF4, x + i, len - i, r, codes + i);
}

__attribute__((target("avx2"))) void fp4_codes_avx2(const float* x, int64_t len, float r, uint8_t* codes) {
  __m256 th[7];
  for (int j = 0; j < 7; ++j) th[j] = _mm256_set1_ps(kFp4MagnitudeThresholds[j]);
  alignas(32) int32_t lut[8];
  for (int j = 0; j < 8; ++j) lut[j] = kFp4MagnitudeCodes[j];
  const __m256i magnitude_code = _mm256_load_si256(reinterpret_cast<const __m256i*>(lut));
  const __m256 scale = _mm256_set1_ps(r);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i sign_bit = _mm256_set1_epi32(0b1000);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
    __m256 a = _mm256_and_ps(v, abs_mask);
    __m256i m = _mm256_setzero_si256();
    for (int j = 0; j < 7; ++j)  // each true compare is -1
      m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, th[j], _CMP_GT_OQ)));
    __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    __m256i c = _mm256_or_si256(_mm256_permutevar8x32_epi32(magnitude_code, m), _mm256_and_si256(negative, sign_bit));
    store_codes8(c, codes + i);
  }
  codes_scalar(QuantType::kFP4, x + i, len - i, r, codes + i);
}

__attribute__((target("avx2"))) void convert_bf16_avx2(const float* src, int64_t n, c10::BFloat16* dst) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + k));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, lsb)), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), packed);
  }
  convert_scalar(src + k, n - k, dst + k);
}

__attribute__((target("avx2,f16c"))) void convert_half_f16c(const float* src, int64_t n, c10::Half* dst) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), h);
  }
  convert_scalar(src + k, n - k, dst + k);
}

}  // namespace memtune::nf4_kernels

#endif  // MEMTUNE_X86
