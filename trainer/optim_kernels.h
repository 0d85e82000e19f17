#pragma once
// The optimizer step's passes over fp32 CPU tensors: AdamW with fp32 states, torch.optim.AdamW's
// update (adamw_torch) and bitsandbytes' kOptimizer32bit2State<ADAM> (paged_adamw_32bit),
// Adafactor's elementwise passes, and the gradients' sum of squares that gradient clipping reads. Each has a portable scalar kernel
// and an AVX2 one that gives the scalar one's bits several lanes at a time: every operation is a mul,
// add, div or sqrt in the scalar kernel's order, one rounding each (the file builds with
// -ffp-contract=off and the AVX2 target has no FMA). Vectorized, each pass is memory-bound: the
// scalar AdamW loop, whose sqrt and division run a lane at a time, took 3.3 ns per element on a
// Zen 4 (bench/optimizer_step.cpp), the AVX2 one 0.6.
#include <cstdint>

#include "runtime/cpu_features.h"
#include "trainer/bnb_scalars.h"


namespace memtune::trainer {

// torch.optim.AdamW's step for one tensor, as its ATen op chain writes it:
//   g *= scale;  p *= decay;  m = m b1 + (1 - b1) g;  v = v b2 + (1 - b2) (g g);
//   p = p + step (m / (sqrt(v) / sqrt_bc2 + eps))
// decay = 1 - lr wd, step = -lr / (1 - b1^t), sqrt_bc2 = sqrt(1 - b2^t). g is written back
// only when scale is not 1 (the chain's in-place g.mul_), so an unscaled step reads it alone.
struct TorchAdamW {
  float scale, decay, b1, one_minus_b1, b2, one_minus_b2, sqrt_bc2, eps, step;
};

// Elements [0, n) of p, g, m, v, on the threads of ATen's pool; the AVX2 kernel where the CPU
// has AVX2, else the scalar one (the same bits).
void torch_adamw(const TorchAdamW& s, float* p, float* g, float* m, float* v, int64_t n);
// bitsandbytes' 32-bit update: g' = gs g;  m = m b1 + (1 - b1) g';  v = v b2 + (1 - b2) (g' g');
// p = p + step_size (m / (sqrt(v) + eps_c2)), then p *= decay where decay_on. g is read only.
void bnb_adam32(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n);

// Adafactor's elementwise passes (transformers' Adafactor.step, as optimizer.cpp's
// adafactor_step writes it), each giving the bits of the ATen ops it replaces, one rounding per
// operation in their order; the reductions between them (the row and column means, the RMS) stay
// ATen's. The chain's nine passes over a matrix become three of these and three reductions.
//   adafactor_square:   g = g * scale (written back only when scale is not 1), u = g * g + eps
//   adafactor_factored: u[i, j] = (r[i] * c[j]) * g[i, j] over a rows x cols matrix
//   adafactor_apply:    p = p - (u / d) * lr
void adafactor_square(float scale, float eps, float* g, float* u, int64_t n);
void adafactor_factored(const float* r, const float* c, const float* g, float* u, int64_t rows, int64_t cols);
void adafactor_apply(float d, float lr, const float* u, float* p, int64_t n);

// The sum of x[j]^2 over [0, n) in double (each square exact), in an order fixed by n alone:
// blocks of kSquareSumBlock elements, each summed by square_sum_block, on the pool's threads;
// then the blocks' sums added in order. The same bits on any number of threads and on either
// kernel (clip_grad_norm's total does not depend on the machine's thread count).
inline constexpr int64_t kSquareSumBlock = 16384;
double square_sum(const float* x, int64_t n);
// On a GPU (trainer/cuda/optim_cuda.h) the sum of squares writes one double per
// kSquareSumChunkCuda elements of each gradient to the device, then adds those: its only
// allocation, square_sum_cuda_scratch bytes for a gradient of n elements.
inline constexpr int64_t kSquareSumChunkCuda = 4096;
inline int64_t square_sum_cuda_scratch(int64_t n) { return (n + kSquareSumChunkCuda - 1) / kSquareSumChunkCuda * 8; }

// The kernels themselves, on the calling thread (tests compare the two paths).
// square_sum_block: 16 running sums, element j adding to sum j % 16, then the 16 added in
// index order.
double square_sum_block_scalar(const float* x, int64_t n);
void torch_adamw_scalar(const TorchAdamW& s, float* p, float* g, float* m, float* v, int64_t n);
void bnb_adam32_scalar(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n);
void adafactor_square_scalar(float scale, float eps, float* g, float* u, int64_t n);
void adafactor_factored_scalar(const float* r, const float* c, const float* g, float* u, int64_t rows, int64_t cols);
void adafactor_apply_scalar(float d, float lr, const float* u, float* p, int64_t n);
#ifdef MEMTUNE_X86
void torch_adamw_avx2(const TorchAdamW& s, float* p, float* g, float* m, float* v, int64_t n);
void bnb_adam32_avx2(const BnbScalars& s, float* p, const float* g, float* m, float* v, int64_t n);
double square_sum_block_avx2(const float* x, int64_t n);
void adafactor_square_avx2(float scale, float eps, float* g, float* u, int64_t n);
void adafactor_factored_avx2(const float* r, const float* c, const float* g, float* u, int64_t rows, int64_t cols);
void adafactor_apply_avx2(float d, float lr, const float* u, float* p, int64_t n);
#endif

}  // namespace memtune::trainer
