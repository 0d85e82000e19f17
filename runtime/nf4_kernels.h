#pragma once
// NF4's codebook and the CPU kernels runtime/nf4.cpp dispatches to: scalar ones here (also
// the tails of the vector loops), AVX2 ones in nf4_kernels_avx2.cpp, compiled for AVX2 by
// function attributes and called only when the CPU has it. Internal to runtime/nf4.
#include <array>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "runtime/cpu_features.h"

namespace memtune::nf4_kernels {

// bitsandbytes' NF4 values (functional.py, get_4bit_type("nf4")).
inline constexpr std::array<float, 16> kCodebook = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// Midpoints between neighbouring codes, as bitsandbytes' dQuantizeNF4 decision tree has them.
inline constexpr std::array<float, 15> kThresholds = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

inline constexpr uint8_t kZeroCode = 7;  // index of 0.0 in the codebook

// Code of a value already scaled to [-1, 1]: the number of midpoints it exceeds.
inline uint8_t nf4_code(float x) {
  uint8_t c = 0;
  for (float t : kThresholds) c += (x > t) ? 1 : 0;
  return c;
}

// Elements 2k, 2k+1 of `nbytes` packed bytes, times s, into o (2 * nbytes floats).
inline void pairs_scalar(const uint8_t* p, int64_t nbytes, float s, float* o) {
  for (int64_t k = 0; k < nbytes; ++k) {
    o[2 * k] = kCodebook[p[k] >> 4] * s;
    o[2 * k + 1] = kCodebook[p[k] & 15] * s;
  }
}

// codes[i] = nf4_code(x[i] * r) for i < len.
inline void codes_scalar(const float* x, int64_t len, float r, uint8_t* codes) {
  for (int64_t i = 0; i < len; ++i) codes[i] = nf4_code(x[i] * r);
}

// fp32 -> bf16 / fp16, round to nearest even (values are finite).
template <class T>
void convert_scalar(const float* src, int64_t n, T* dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(src[k]);
}

#ifdef MEMTUNE_X86
// The scalar kernels' results, bit for bit (no fused multiply-add), 8 or 16 lanes at a time.
void pairs_avx2(const uint8_t* p, int64_t nbytes, float s, float* o);
void codes_avx2(const float* x, int64_t len, float r, uint8_t* codes);
void convert_bf16_avx2(const float* src, int64_t n, c10::BFloat16* dst);
void convert_half_f16c(const float* src, int64_t n, c10::Half* dst);  // needs F16C too
#endif

}  // namespace memtune::nf4_kernels
