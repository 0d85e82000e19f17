#pragma once
// bitsandbytes' 8-bit AdamW (kOptimizerStatic8bit2StateBlockwise<ADAM, 256>) on the CPU: its
// constants and code maps, and the kernels trainer/optimizer.cpp dispatches to, a portable
// scalar one (adamw8bit_kernels.cpp) and an AVX2 one (adamw8bit_kernels_avx2.cpp, compiled for
// AVX2 by function attributes and called only when the CPU has it). Both give the same bytes:
// every fp32 operation is the kernel's, in its order, one rounding each (both files build with
// -ffp-contract=off; no FMA anywhere). The tests compare the two paths.
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "runtime/cpu_features.h"
#include "trainer/bnb_scalars.h"
#include "trainer/quantize_2d.h"


namespace memtune::trainer {

// States of tensors with at least kMin8bitSize elements are uint8 codes in blocks of
// kBlock8bit, one fp32 absmax per block and state.
inline constexpr int64_t kMin8bitSize = 4096;
inline constexpr int64_t kBlock8bit = 256;
// Paged states on a GPU pass through two device slots of at most this many bytes
// (trainer/cuda/adamw_bnb_cuda.h, PagedStates): a larger tensor passes in runs of blocks.
inline constexpr int64_t kPagedSlotBytes = int64_t{64} << 20;
// create_dynamic_map(signed) of bitsandbytes: 256 sorted fp32 values.
at::Tensor dynamic_map(bool is_signed);
// bitsandbytes' quantize_2D on that map (x is the state over its block's absmax).
uint8_t quantize_dynamic(bool is_signed, float x);


// quantize_2d_search (trainer/quantize_2d.h, included above): bitsandbytes' quantize_2D, the
// definition the fast tables below are built from and checked against.

// The same function without the search. quantize_2D is monotone in x (NaN aside, which ends
// at code 0), so it is the number of its 255 thresholds x lies above: code(x) = #{j : x >
// upper[j]}, upper[j] the largest float whose code is below j. That count comes from a table
// keyed on x's top 16 bits (sign, exponent, 7 mantissa bits; magnitudes at or above 1.0 share
// the top bucket, under 2^-24 the bottom one) whose buckets hold at most one threshold each
// (checked when the table is built): lo[bucket] = the code of the bucket's lowest float, and
// x passes at most the next threshold, upper[lo + 1] (+inf after the last).
struct CodeTable {
  static constexpr uint32_t kBase = 0x3380;  // 2^-24's top 16 bits: the bottom bucket
  static constexpr uint32_t kTop = 0x3F80;   // 1.0's: the top bucket
  static constexpr uint32_t kPerSign = kTop - kBase + 1;
  const float* code;
  int negatives;     // entries with the sign bit set: code[0..negatives) (checked)
  float upper[257];  // upper[j], j = 1..255; upper[256] = +inf
  uint8_t lo[2 * kPerSign];  // positive buckets, then negative
  // The same decision in one 32-bit entry per bucket, for the vector kernels' one gather:
  // lo[bucket] in bits 0-7 and, in bits 16-31, the bucket's threshold as its low 16 bits,
  // flipped for negative buckets (where a larger float has smaller magnitude bits), or 0xFFFF
  // where the bucket holds none. x passes it when its own low 16 bits, flipped likewise, are
  // greater: within a bucket the top 16 bits are equal, so that is x > upper[lo + 1]. The two
  // clamped buckets of each sign (kBase, kTop) hold no threshold (checked).
  uint32_t cut[2 * kPerSign];

  CodeTable(const float* map, bool is_signed);

  static uint32_t bucket(uint32_t bits) {
    uint32_t h = (bits & 0x7FFFFFFFu) >> 16;
    h = h < kBase ? kBase : h > kTop ? kTop : h;
    return h - kBase + (bits >> 31) * kPerSign;
  }
  uint8_t operator()(float x) const;
};

// The tables of dynamic_map(true) and dynamic_map(false), built once.
const CodeTable& code_table(bool is_signed);

// One 8-bit AdamW update of blocks [b0, b1) of an n-element tensor: q1, q2 the signed and
// unsigned dynamic maps (t1, t2 their tables), c1, c2 the uint8 states, absmax1, absmax2 one
// fp32 per block.
struct Adam8Tensors {
  const CodeTable *t1, *t2;
  float* p;
  const float* g;
  uint8_t *c1, *c2;
  float *absmax1, *absmax2;
  int64_t n;
};
void adam8_blocks_scalar(const BnbScalars& s, const Adam8Tensors& t, int64_t b0, int64_t b1);
// The fastest of the above the CPU runs.
void adam8_blocks(const BnbScalars& s, const Adam8Tensors& t, int64_t b0, int64_t b1);

// AdamW's fp32 states (m, v; n elements) in that 8-bit form, as the update above leaves its
// states: per block of kBlock8bit the absmax over the block (lanes past the end count as 0),
// each value over it through the signed (m) or unsigned (v) code table, the first moment's
// code keeping its sign. The memory ladder's optimizer_8bit rung (Optimizer::quantize_states).
void quantize_states_8bit(const float* m, const float* v, int64_t n, uint8_t* c1, uint8_t* c2, float* absmax1,
                          float* absmax2);

#ifdef MEMTUNE_X86
// The scalar kernels' results, bit for bit, 8 lanes at a time.
void adam8_blocks_avx2(const BnbScalars& s, const Adam8Tensors& t, int64_t b0, int64_t b1);
void quantize_avx2(const CodeTable& table, const float* x, int64_t n, uint8_t* out);
#endif

}  // namespace memtune::trainer
