#pragma once
// The 4-bit codebooks (NF4, FP4) and the CPU kernels runtime/nf4.cpp dispatches to: scalar
// ones here (also the tails of the vector loops), AVX2 ones in nf4_kernels_avx2.cpp, compiled
// for AVX2 by function attributes and called only when the CPU has it. Internal to runtime/nf4.
#include <array>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "runtime/cpu_features.h"
#include "runtime/nf4.h"

namespace memtune::nf4_kernels {

// bitsandbytes' NF4 values (functional.py, get_4bit_type("nf4")).
inline constexpr std::array<float, 16> kNf4Codebook = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// Midpoints between neighbouring codes, as bitsandbytes' dQuantizeNF4 decision tree has them.
inline constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

// bitsandbytes' FP4 values: a sign bit over 2 exponent and 1 mantissa bits, in code order
// (0, 0.0625, 8, 12, 4, 6, 2, 3 for codes 0-7, negated for 8-15), divided by 12 as
// get_4bit_type("fp4") does. Code 8 is +0.0 as in get_4bit_type (its list says -0, an int)
// and the CPU kernels; the CUDA kernel's sign multiply makes it -0.0, the same number.
inline constexpr std::array<float, 16> kFp4Codebook = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
    0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f};

// dQuantizeFP4's decision tree: the pivots of |x| (midpoints of the sorted magnitudes, as
// the literals there have them; 0.583333f has one digit fewer) and the 3-bit code of each
// interval, smallest magnitude first.
inline constexpr std::array<float, 7> kFp4MagnitudeThresholds = {
    0.00260417f, 0.0859375f, 0.20833333f, 0.29166667f, 0.4166667f, 0.583333f, 0.8333333f};
inline constexpr std::array<uint8_t, 8> kFp4MagnitudeCodes = {0b000, 0b001, 0b110, 0b111,
                                                              0b100, 0b101, 0b010, 0b011};

// Code of a value already scaled to [-1, 1], NF4: the number of midpoints it exceeds.
inline uint8_t nf4_code(float x) {
  uint8_t c = 0;
  for (float t : kNf4Thresholds) c += (x > t) ? 1 : 0;
  return c;
}

// FP4 (dQuantizeFP4): the sign bit for x < 0, then the code of |x|'s interval.
inline uint8_t fp4_code(float x) {
  const uint8_t sign = x < 0.0f ? 0b1000 : 0;
  const float a = x < 0.0f ? -x : x;
  uint8_t m = 0;
  for (float t : kFp4MagnitudeThresholds) m += (a > t) ? 1 : 0;
  return static_cast<uint8_t>(sign | kFp4MagnitudeCodes[m]);
}

inline const std::array<float, 16>& codebook_of(QuantType t) {
  return t == QuantType::kFP4 ? kFp4Codebook : kNf4Codebook;
}

inline uint8_t code_of(QuantType t, float x) { return t == QuantType::kFP4 ? fp4_code(x) : nf4_code(x); }

// Elements 2k, 2k+1 of `nbytes` packed bytes, codebook[code] times s, into o (2 * nbytes floats).
inline void pairs_scalar(const uint8_t* p, int64_t nbytes, const float* codebook, float s, float* o) {
  for (int64_t k = 0; k < nbytes; ++k) {
    o[2 * k] = codebook[p[k] >> 4] * s;
    o[2 * k + 1] = codebook[p[k] & 15] * s;
  }
}

// codes[i] = code_of(t, x[i] * r) for i < len.
inline void codes_scalar(QuantType t, const float* x, int64_t len, float r, uint8_t* codes) {
  if (t == QuantType::kFP4) {
    for (int64_t i = 0; i < len; ++i) codes[i] = fp4_code(x[i] * r);
  } else {
    for (int64_t i = 0; i < len; ++i) codes[i] = nf4_code(x[i] * r);
  }
}

// fp32 -> bf16 / fp16, round to nearest even (values are finite).
template <class T>
void convert_scalar(const float* src, int64_t n, T* dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(src[k]);
}

#ifdef MEMTUNE_X86
// The scalar kernels' results, bit for bit (no fused multiply-add), 8 or 16 lanes at a time.
void pairs_avx2(const uint8_t* p, int64_t nbytes, const float* codebook, float s, float* o);
void nf4_codes_avx2(const float* x, int64_t len, float r, uint8_t* codes);
void fp4_codes_avx2(const float* x, int64_t len, float r, uint8_t* codes);
void convert_bf16_avx2(const float* src, int64_t n, c10::BFloat16* dst);
void convert_half_f16c(const float* src, int64_t n, c10::Half* dst);  // needs F16C too
#endif

}  // namespace memtune::nf4_kernels
