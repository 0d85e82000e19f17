// memtune's blocked attention against the textbook one written with ATen ops (scores,
// explicit mask, softmax, weighted sum) under autograd: outputs and gradients for every
// query-block size, sliding windows, grouped-query heads and packed segments; and the row
// maximum the fused kernel and the loss share (cpu_vec.h).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "models/layers/attention.h"
#include "models/layers/attention_cpu.h"
#include "models/layers/cpu_vec.h"
#include "runtime/compat.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/cuda_info.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "test_util.h"

namespace {

using memtune::models::causal_segment_attention;
using memtune::testing::expect_close;

// q (B,Hkv,G,T,D), k/v (B,Hkv,T,D): every query against every key, then the mask; with a
// dropout mask `z` (B,Hkv,G,T,T, 0 or 1/(1-p)) the probabilities are multiplied by it; with
// `softcap` c > 0 the scaled scores are c tanh(s / c) (transformers' Gemma 2 eager attention).
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg,
                           double scale, int64_t window, const at::Tensor& z = {}, double softcap = 0) {
  const int64_t T = q.size(3);
  at::Tensor s = at::matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale;  // (B,Hkv,G,T,T)
  if (softcap > 0) s = at::tanh(s / softcap) * softcap;
  at::Tensor pos = at::arange(T, at::kLong);
  at::Tensor qp = pos.view({T, 1}), kp = pos.view({1, T});
  at::Tensor allowed = (kp <= qp).unsqueeze(0) & (seg.unsqueeze(2) == seg.unsqueeze(1));  // (B,T,T)
  if (window > 0) allowed = allowed & (qp - kp < window).unsqueeze(0);
  s = s.masked_fill(allowed.logical_not().view({seg.size(0), 1, 1, T, T}), -std::numeric_limits<float>::infinity());
  at::Tensor p = at::softmax(s, -1);
  return at::matmul(z.defined() ? p * z : p, v.unsqueeze(2));
}

using memtune::models::AttentionOptions;
using memtune::models::uses_fused_cpu_attention;

// memtune's attention (on `device`) and the textbook one (on the CPU) on the same inputs:
// output and the three gradients for a random output gradient.
void expect_textbook(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seg,
                     int64_t window, const AttentionOptions& options, const at::Device& device = at::kCPU) {
  at::Tensor qa = q.detach().to(device, false, true).requires_grad_(true),
             ka = k.detach().to(device, false, true).requires_grad_(true),
             va = v.detach().to(device, false, true).requires_grad_(true);
  at::Tensor out = causal_segment_attention(qa, ka, va, seg.to(device), 0.35, window, options);
  at::Tensor qr = q.detach().clone().requires_grad_(true), kr = k.detach().clone().requires_grad_(true),
             vr = v.detach().clone().requires_grad_(true);
  at::Tensor z;  // the dropout mask, as attention_keep_mask draws it for every (row, head, query, key)
  if (options.dropout.active()) {
    const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), T = q.size(3);
    z = memtune::attention_keep_mask(options.dropout.seeds, Hkv * G, 0, T, 0, T, options.dropout.p)
            .to(at::kFloat)
            .div(1.0 - options.dropout.p)
            .view({B, Hkv, G, T, T});
  }
  at::Tensor ref = naive_attention(qr, kr, vr, seg, 0.35, window, z, options.softcap);
  expect_close(out.cpu(), ref, 2e-5, "output", 1.0);
  at::Tensor g = at::randn(out.sizes(), at::kFloat);
  auto grads = torch::autograd::grad({out}, {qa, ka, va}, {g.to(device)});
  ref.backward(g);
  expect_close(grads[0].cpu(), qr.grad(), 2e-5, "grad q", 1.0);
  expect_close(grads[1].cpu(), kr.grad(), 2e-5, "grad k", 1.0);
  expect_close(grads[2].cpu(), vr.grad(), 2e-5, "grad v", 1.0);
}

// Row 0: two documents (10 + 13 tokens); row 1: one document then padding (segment -1).
at::Tensor two_rows_of_segments(int64_t T) {
  at::Tensor seg = at::zeros({2, T}, at::kLong);
  seg[0].slice(0, 10) = 1;
  seg[1].slice(0, T - 4) = -1;
  return seg;
}

TEST(Attention, BlockedKernelMatchesTheTextbookAttention) {
  torch::manual_seed(9);
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  const at::Tensor seg = two_rows_of_segments(T);
  for (int64_t window : {0, 1, 3, 10}) {
    for (int64_t block : {4, 7, 64}) {
      for (int64_t keep_bytes : {int64_t{64} << 20, int64_t{0}}) {  // probabilities kept / recomputed
        SCOPED_TRACE("window " + std::to_string(window) + ", block " + std::to_string(block) + ", keep " +
                     std::to_string(keep_bytes));
        AttentionOptions options;
        options.kernel = AttentionOptions::Kernel::kEager;
        options.query_block = block;
        options.keep_probs_bytes = keep_bytes;
        expect_textbook(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}), seg,
                        window, options);
      }
    }
  }
}

// Random 32-bit seeds, one per batch row (attention_dropout_seeds' values).
at::Tensor row_seeds(int64_t B) { return at::randint(int64_t{1} << 32, {B}, at::kLong); }

// Dropout on the probabilities: the blocked kernel draws attention_keep_mask's bits per block,
// in forward and again in backward, and equals the textbook attention with that mask.
TEST(Attention, BlockedKernelWithDropoutMatchesTheTextbookAttention) {
  torch::manual_seed(19);
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  const at::Tensor seg = two_rows_of_segments(T);
  for (double p : {0.1, 0.5}) {
    for (int64_t window : {0, 3}) {
      for (int64_t block : {4, 7, 64}) {
        for (int64_t keep_bytes : {int64_t{64} << 20, int64_t{0}}) {
          SCOPED_TRACE("p " + std::to_string(p) + ", window " + std::to_string(window) + ", block " +
                       std::to_string(block) + ", keep " + std::to_string(keep_bytes));
          AttentionOptions options;
          options.kernel = AttentionOptions::Kernel::kEager;
          options.query_block = block;
          options.keep_probs_bytes = keep_bytes;
          options.dropout = {p, row_seeds(B)};
          expect_textbook(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}), seg,
                          window, options);
        }
      }
    }
  }
}

// Gemma 2's soft-capped scores (c tanh(s / c)): the blocked kernel forms the capped scores
// again in backward for tanh's derivative (and so keeps no probabilities, whatever the
// limit). Caps of 0.7 and 2 bend scores of about 1 hard; with dropout too.
TEST(Attention, BlockedKernelWithSoftcapMatchesTheTextbookAttention) {
  torch::manual_seed(29);
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  const at::Tensor seg = two_rows_of_segments(T);
  for (double cap : {0.7, 2.0}) {
    for (int64_t window : {0, 3}) {
      for (int64_t block : {4, 64}) {
        for (double p : {0.0, 0.3}) {
          SCOPED_TRACE("cap " + std::to_string(cap) + ", window " + std::to_string(window) + ", block " +
                       std::to_string(block) + ", dropout " + std::to_string(p));
          AttentionOptions options;
          options.kernel = AttentionOptions::Kernel::kEager;
          options.query_block = block;
          options.softcap = cap;
          if (p > 0) options.dropout = {p, row_seeds(B)};
          expect_textbook(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}), seg,
                          window, options);
        }
      }
    }
  }
}

// SDPA cannot soft-cap (transformers' sdpa path for Gemma 2 drops the cap and so computes
// another model): asked for by name it is refused, not run without the cap.
TEST(Attention, SdpaIsRefusedForSoftcappedScores) {
  const int64_t B = 1, Hkv = 1, G = 1, T = 4, D = 8;
  AttentionOptions options;
  options.kernel = AttentionOptions::Kernel::kSdpa;
  options.softcap = 50.0;
  try {
    causal_segment_attention(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}),
                             at::zeros({B, T}, at::kLong), 0.35, 0, options);
    ADD_FAILURE() << "sdpa ran with soft-capped scores";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("sdpa cannot soft-cap attention scores"), std::string::npos) << e.what();
  }
}

// The same on a GPU: the keyed mask drawn there by int64 tensor ops must be the CPU's bits
// (the textbook's mask is drawn on the CPU), and the blocked kernel's products CUDA's.
TEST(Attention, OnCudaTheBlockedKernelWithDropoutMatchesTheTextbookAttention_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  torch::manual_seed(23);
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  const at::Tensor seg = two_rows_of_segments(T);
  for (double p : {0.1, 0.5}) {
    for (int64_t window : {0, 3}) {
      for (int64_t block : {4, 64}) {
        SCOPED_TRACE("p " + std::to_string(p) + ", window " + std::to_string(window) + ", block " +
                     std::to_string(block));
        AttentionOptions options;
        options.kernel = AttentionOptions::Kernel::kEager;
        options.query_block = block;
        options.dropout = {p, row_seeds(B)};
        expect_textbook(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}), seg,
                        window, options, at::Device(at::kCUDA, 0));
      }
    }
  }
}

// SDPA on a GPU with grouped key/value heads (G query heads per key/value head) under causal
// masking alone: in bf16 the fused kernels run (on LibTorch >= 2.5 with k and v at their own
// heads, enable_gqa); fp32 too. Against the textbook attention in fp32 on the CPU of the same
// values, outputs and the three gradients, within bf16's rounding of the inputs.
TEST(Attention, SdpaOnCudaWithGroupedHeadsMatchesTheTextbookAttention_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  torch::manual_seed(29);
  const int64_t B = 2, Hkv = 2, G = 4, T = 70, D = 64;
  AttentionOptions options;
  options.kernel = AttentionOptions::Kernel::kSdpa;
  options.one_segment_per_row = true;
  const at::Tensor seg = at::zeros({B, T}, at::kLong);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    // The inputs as the device's dtype holds them; the reference computes on those values.
    const at::Tensor q = at::randn({B, Hkv, G, T, D}).to(dtype).to(at::kFloat);
    const at::Tensor k = at::randn({B, Hkv, T, D}).to(dtype).to(at::kFloat);
    const at::Tensor v = at::randn({B, Hkv, T, D}).to(dtype).to(at::kFloat);
    const auto cuda = at::TensorOptions(dtype).device(at::kCUDA, 0);
    at::Tensor qa = q.to(cuda).requires_grad_(true), ka = k.to(cuda).requires_grad_(true),
               va = v.to(cuda).requires_grad_(true);
    const at::Tensor out = causal_segment_attention(qa, ka, va, seg.to(qa.device()), 0.125, 0, options);
    at::Tensor qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true),
               vr = v.clone().requires_grad_(true);
    const at::Tensor ref = naive_attention(qr, kr, vr, seg, 0.125, 0, at::Tensor());
    const double tol = dtype == at::kFloat ? 2e-5 : 3e-2;
    expect_close(out.cpu().to(at::kFloat), ref, tol, "output", 1.0);
    const at::Tensor g = at::randn(out.sizes(), at::kFloat).to(dtype).to(at::kFloat);
    auto grads = torch::autograd::grad({out}, {qa, ka, va}, {g.to(cuda)});
    ref.backward(g);
    expect_close(grads[0].cpu().to(at::kFloat), qr.grad(), tol, "grad q", 1.0);
    expect_close(grads[1].cpu().to(at::kFloat), kr.grad(), tol, "grad k", 1.0);
    expect_close(grads[2].cpu().to(at::kFloat), vr.grad(), tol, "grad v", 1.0);
  }
}

// Grouped key/value heads under causal masking alone through SDPA: the bytes a forward keeps
// and the peak of forward and backward together, over what was allocated before, with q, k
// and v (B,Hkv,G,T,D) and (B,Hkv,T,D) needing gradients.
struct SdpaBytes {
  int64_t kept = 0, peak = 0;
};
SdpaBytes sdpa_bytes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  AttentionOptions options;
  options.kernel = AttentionOptions::Kernel::kSdpa;
  options.one_segment_per_row = true;
  const at::Tensor seg = at::zeros({q.size(0), q.size(3)}, at::TensorOptions(at::kLong).device(q.device()));
  memtune::MemoryBackend& memory = memtune::memory_backend(q.device());
  auto wait = [&] {
    if (q.is_cuda()) torch::cuda::synchronize();
  };
  at::Tensor qa = q.clone().requires_grad_(true), ka = k.clone().requires_grad_(true),
             va = v.clone().requires_grad_(true);
  const at::Tensor g = at::randn_like(q);
  auto forward = [&] { return causal_segment_attention(qa, ka, va, seg, 0.125, 0, options); };
  torch::autograd::grad({forward()}, {qa, ka, va}, {g});  // workspaces and the like, before measuring
  wait();
  SdpaBytes bytes;
  memory.reset_peak();
  const int64_t before = memory.stats().allocated;
  {
    const at::Tensor out = forward();
    wait();
    bytes.kept = memory.stats().allocated - before;
    torch::autograd::grad({out}, {qa, ka, va}, {g});
    wait();
  }
  bytes.peak = memory.stats().peak - before;
  return bytes;
}

// SDPA never takes grouped heads to its math kernel, which forms (B,H,T,T) scores and keeps
// their softmax for backward (128 MiB each here): where the fused kernel would not take
// grouped heads (the CPU's flash; on LibTorch >= 2.5 enable_gqa would pick the math kernel)
// they are repeated to the query heads first, and the CPU's flash runs them in memory linear
// in T (repeated k and v and the output kept, 4 MiB each).
TEST(Attention, SdpaWithGroupedHeadsNeverFormsTheScoresOnTheCpu) {
  if (!memtune::models::sdpa_available()) GTEST_SKIP() << "at::scaled_dot_product_attention needs LibTorch 2.0";
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(31);
  const int64_t B = 1, Hkv = 2, G = 4, T = 2048, D = 64;
  const int64_t scores = B * Hkv * G * T * T * 4;  // 128 MiB of fp32
  const SdpaBytes bytes = sdpa_bytes(at::randn({B, Hkv, G, T, D}), at::randn({B, Hkv, T, D}), at::randn({B, Hkv, T, D}));
  EXPECT_LT(bytes.kept, scores / 4) << "kept " << bytes.kept << " bytes";
  EXPECT_LT(bytes.peak, scores / 2) << "peak " << bytes.peak << " bytes";
}

// On a GPU: fp32 never reaches the math kernel either (the memory-efficient kernel, which does
// not take grouped heads, runs them repeated); in bf16 on sm80 and newer flash takes k and v
// at their own heads (enable_gqa), so the forward keeps no copies repeated to the query heads:
// the output and its row sums, not the output and two repeated copies as large as it.
TEST(Attention, SdpaWithGroupedHeadsOnCudaNeverFormsTheScoresAndInBf16KeepsNoRepeatedHeads_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  torch::manual_seed(37);
  const int64_t B = 2, Hkv = 2, G = 4, T = 2048, D = 64;
  const int64_t scores = B * Hkv * G * T * T * 4;  // 256 MiB of fp32
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto cuda = at::TensorOptions(dtype).device(at::kCUDA, 0);
    const SdpaBytes bytes = sdpa_bytes(at::randn({B, Hkv, G, T, D}, cuda), at::randn({B, Hkv, T, D}, cuda),
                                       at::randn({B, Hkv, T, D}, cuda));
    EXPECT_LT(bytes.kept, scores / 4) << "kept " << bytes.kept << " bytes";
    EXPECT_LT(bytes.peak, scores / 2) << "peak " << bytes.peak << " bytes";
#if MEMTUNE_SDPA_HAS_GQA
    const int64_t out = B * Hkv * G * T * D * static_cast<int64_t>(at::elementSize(dtype));
    if (dtype == at::kBFloat16 && memtune::cuda_compute_capability(0) >= 80) {
      EXPECT_LT(bytes.kept, 2 * out) << "kept " << bytes.kept << " bytes, the output " << out;
    }
#endif
  }
}

// The mask: about 1 - p of the entries kept, each row's bits from its own seed only (a row
// draws the same mask in any batch), heads and queries drawn apart.
TEST(Attention, DropoutMaskKeepsOneMinusPAndFollowsTheRowsSeed) {
  const at::Tensor seeds = at::tensor(std::vector<int64_t>{12345, 4000000000LL, 7}, at::kLong);
  for (double p : {0.1, 0.5, 0.9}) {
    const at::Tensor keep = memtune::attention_keep_mask(seeds, 4, 0, 256, 0, 256, p);  // (3,4,256,256)
    const double kept = keep.to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(kept, 1.0 - p, 0.005) << p;  // 786432 draws: the standard error is under 0.0006
    const at::Tensor alone = memtune::attention_keep_mask(seeds.slice(0, 1, 2), 4, 0, 256, 0, 256, p);
    EXPECT_TRUE(at::equal(alone[0], keep[1]));
    EXPECT_FALSE(at::equal(keep[0], keep[1]));
    EXPECT_FALSE(at::equal(keep[0][0], keep[0][1]));           // heads
    EXPECT_FALSE(at::equal(keep[0][0][5], keep[0][0][6]));     // queries
    // A block of queries and keys is the same draw as the whole matrix's block.
    const at::Tensor block = memtune::attention_keep_mask(seeds, 4, 100, 140, 30, 90, p);
    EXPECT_TRUE(at::equal(block, keep.slice(2, 100, 140).slice(3, 30, 90)));
  }
  EXPECT_TRUE(memtune::attention_keep_mask(seeds, 2, 0, 64, 0, 64, 0.0).all().item<bool>());
}

// The fused CPU kernel: lengths across its 32-row blocks, head sizes off its 8- and
// 16-column tiles, grouped-query heads, windows, packed documents and padding, and q, k, v
// as the strided views the models pass (heads split out of (B,T,H*D) projections).
// The kernels this CPU runs best (AVX-512 or AVX2), AVX2 at most, and the portable C++ ones.
enum class Kernels { kBest, kAvx2AtMost, kPortable };
class FusedCpuAttention : public ::testing::TestWithParam<Kernels> {
 protected:
  void SetUp() override {
    memtune::models::detail::use_portable_cpu_kernels(GetParam() == Kernels::kPortable);
    memtune::models::detail::use_avx2_cpu_kernels_at_most(GetParam() == Kernels::kAvx2AtMost);
  }
  void TearDown() override {
    memtune::models::detail::use_portable_cpu_kernels(false);
    memtune::models::detail::use_avx2_cpu_kernels_at_most(false);
  }
};

struct Shape { int64_t Hkv, G, T, D; };
struct Qkv { at::Tensor q, k, v; };

// Random q, k, v of B rows as llama.cpp builds them: q (B,T,H,D) seen as (B,Hkv,G,T,D), k and
// v halves of one (B,T,2*Hkv*D) projection seen as (B,Hkv,T,D).
Qkv strided_qkv(int64_t B, const Shape& s) {
  const int64_t H = s.Hkv * s.G;
  at::Tensor q = at::randn({B, s.T, H * s.D}).view({B, s.T, s.Hkv, s.G, s.D}).permute({0, 2, 3, 1, 4});
  at::Tensor kv = at::randn({B, s.T, 2 * s.Hkv * s.D});
  return {q, kv.slice(2, 0, s.Hkv * s.D).view({B, s.T, s.Hkv, s.D}).permute({0, 2, 1, 3}),
          kv.slice(2, s.Hkv * s.D).view({B, s.T, s.Hkv, s.D}).permute({0, 2, 1, 3})};
}

TEST_P(FusedCpuAttention, MatchesTheTextbookAttention) {
  torch::manual_seed(11);
  for (const Shape& s : {Shape{2, 2, 23, 8}, Shape{1, 3, 70, 12}, Shape{2, 1, 33, 64}, Shape{1, 1, 1, 5}}) {
    const at::Tensor seg = s.T > 10 ? two_rows_of_segments(s.T) : at::zeros({2, s.T}, at::kLong);
    for (int64_t window : {0, 1, 3, 40}) {
      SCOPED_TRACE("Hkv " + std::to_string(s.Hkv) + " G " + std::to_string(s.G) + " T " + std::to_string(s.T) +
                   " D " + std::to_string(s.D) + " window " + std::to_string(window));
      const Qkv t = strided_qkv(2, s);
      ASSERT_TRUE(uses_fused_cpu_attention(t.q, t.k, t.v, seg));
      expect_textbook(t.q, t.k, t.v, seg, window, {});
    }
  }
}

// With dropout the fused kernel draws the same bits as attention_keep_mask, from the same
// hash written for one element at a time, and keeps no mask: backward draws it again.
TEST_P(FusedCpuAttention, DropoutMatchesTheTextbookAttention) {
  torch::manual_seed(23);
  for (const Shape& s : {Shape{2, 2, 23, 8}, Shape{1, 3, 70, 12}, Shape{2, 1, 33, 64}}) {
    const at::Tensor seg = two_rows_of_segments(s.T);
    for (double p : {0.1, 0.6}) {
      for (int64_t window : {0, 5}) {
        SCOPED_TRACE("Hkv " + std::to_string(s.Hkv) + " G " + std::to_string(s.G) + " T " + std::to_string(s.T) +
                     " p " + std::to_string(p) + " window " + std::to_string(window));
        const Qkv t = strided_qkv(2, s);
        ASSERT_TRUE(uses_fused_cpu_attention(t.q, t.k, t.v, seg));
        AttentionOptions options;
        options.dropout = {p, row_seeds(2)};
        expect_textbook(t.q, t.k, t.v, seg, window, options);
      }
    }
  }
}

// Soft-capping in the fused kernel: the capped scores' tanh recomputed per block in backward
// (a third block of scratch), with and without dropout, across windows and packed rows.
TEST_P(FusedCpuAttention, SoftcapMatchesTheTextbookAttention) {
  torch::manual_seed(31);
  for (const Shape& s : {Shape{2, 2, 23, 8}, Shape{1, 3, 70, 12}, Shape{2, 1, 33, 64}}) {
    const at::Tensor seg = two_rows_of_segments(s.T);
    for (double cap : {0.7, 3.0}) {
      for (int64_t window : {0, 5}) {
        for (double p : {0.0, 0.3}) {
          SCOPED_TRACE("Hkv " + std::to_string(s.Hkv) + " G " + std::to_string(s.G) + " T " + std::to_string(s.T) +
                       " cap " + std::to_string(cap) + " window " + std::to_string(window) + " p " + std::to_string(p));
          const Qkv t = strided_qkv(2, s);
          ASSERT_TRUE(uses_fused_cpu_attention(t.q, t.k, t.v, seg));
          AttentionOptions options;
          options.softcap = cap;
          if (p > 0) options.dropout = {p, row_seeds(2)};
          expect_textbook(t.q, t.k, t.v, seg, window, options);
        }
      }
    }
  }
}

// A packed row holds any number of documents: three here, then padding; the other row
// one document. Every query still sees one range of keys, so the fused kernel takes it.
TEST_P(FusedCpuAttention, ManyDocumentsPerRow) {
  torch::manual_seed(14);
  const int64_t B = 2, Hkv = 2, G = 2, T = 40, D = 8;
  at::Tensor seg = at::zeros({B, T}, at::kLong);
  seg[0].slice(0, 8) = 1;
  seg[0].slice(0, 15) = 2;
  seg[0].slice(0, 36) = -1;
  at::Tensor q = at::randn({B, Hkv, G, T, D}), k = at::randn({B, Hkv, T, D}), v = at::randn({B, Hkv, T, D});
  ASSERT_TRUE(uses_fused_cpu_attention(q, k, v, seg));
  for (int64_t window : {0, 5}) {
    SCOPED_TRACE("window " + std::to_string(window));
    expect_textbook(q, k, v, seg, window, {});
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, FusedCpuAttention,
                         ::testing::Values(Kernels::kBest, Kernels::kAvx2AtMost, Kernels::kPortable),
                         [](const auto& info) {
                           return info.param == Kernels::kPortable     ? "Portable"
                                  : info.param == Kernels::kAvx2AtMost ? "Avx2AtMost"
                                                                       : "BestWhereAvailable";
                         });

// The fused kernel's soft-capping (cpu_vec.h soft_cap) against std::tanh in double, in its
// AVX2 form (where the CPU has it) and its portable one, for every length from 1 to 41 (the
// 8-wide loop and its masked tail), over scores from 0 to past the cap's saturation: tanh
// within 2e-7 absolute everywhere and 1e-6 relative where |u| < 1/4 (the odd series' range),
// the capped score cap * tanh.
TEST(SoftCap, TanhIsStdTanhsForEveryLengthInBothForms) {
  using memtune::models::detail::soft_cap;
  torch::manual_seed(37);
  for (bool portable : {false, true}) {
    memtune::models::detail::use_portable_cpu_kernels(portable);
    for (int64_t n = 1; n <= 41; ++n) {
      for (double spread : {0.02, 0.5, 3.0, 200.0}) {
        const float scale = 0.125f, cap = 5.0f;
        at::Tensor x = at::randn({n}).mul_(spread / scale * cap);
        at::Tensor th = at::full({n + 1}, 7.0f);  // one past the row: must stay untouched
        const at::Tensor x0 = x.clone();
        soft_cap(x.data_ptr<float>(), n, scale, cap, th.data_ptr<float>());
        const float* in = x0.data_ptr<float>();
        for (int64_t j = 0; j < n; ++j) {
          const double u = static_cast<double>(in[j] * scale / cap), want = std::tanh(u);
          const double got = th[j].item<float>();
          ASSERT_NEAR(got, want, 2e-7) << "u " << u << " n " << n << (portable ? " portable" : "");
          if (std::abs(u) < 0.25 && u != 0) {
            ASSERT_NEAR(got / want, 1.0, 1e-6) << "u " << u << " n " << n;
          }
          ASSERT_NEAR(x[j].item<float>(), got * cap, 1e-6 * cap) << "u " << u;
        }
        ASSERT_EQ(th[n].item<float>(), 7.0f) << "written past the row, n " << n;
      }
    }
  }
  memtune::models::detail::use_portable_cpu_kernels(false);
}

// The fused kernel's row maximum (cpu_vec.h's row_max) against the value placed as the
// maximum, for every length from 1 to 41 (its 16-wide loop, its 8-wide step and its scalar
// tail in each combination) and every place, in its AVX2 form and its portable one, with
// +inf just past the row (read there, it would win); -inf and all-equal rows included.
TEST(RowMax, IsTheLargestValueForEveryLengthAndPlace) {
  using memtune::models::detail::row_max;
  using memtune::models::detail::use_portable_cpu_kernels;
  const float inf = std::numeric_limits<float>::infinity();
  for (bool portable : {false, true}) {
    use_portable_cpu_kernels(portable);
    for (int64_t n = 1; n <= 41; ++n) {
      for (int64_t place = 0; place < n; ++place) {
        std::vector<float> x(n + 16, inf);
        for (int64_t j = 0; j < n; ++j) x[j] = static_cast<float>((j * 37 + n * 11) % 23) - 30.0f;  // -30 to -8
        const float top = 5.5f + static_cast<float>(place % 3);
        x[place] = top;
        if (n > 2) x[(place + 1) % n] = -inf;
        EXPECT_EQ(row_max(x.data(), n), top) << (portable ? "portable" : "AVX2") << ", n " << n << " at " << place;
      }
      std::vector<float> same(n + 16, inf), low(n + 16, inf);
      std::fill(same.begin(), same.begin() + n, -2.25f);
      std::fill(low.begin(), low.begin() + n, -inf);
      EXPECT_EQ(row_max(same.data(), n), -2.25f) << n;
      EXPECT_EQ(row_max(low.data(), n), -inf) << n;
    }
  }
  use_portable_cpu_kernels(false);
}

// at::scaled_dot_product_attention (LibTorch 2.x; this runs on the CPU in the 2.x build):
// the same answers with an explicit mask (packed documents, padding, windows), and with
// causal masking alone when every row is one document. 1.13 refuses it by name.
TEST(Attention, SdpaMatchesTheTextbookAttention) {
  torch::manual_seed(13);
  AttentionOptions options;
  options.kernel = AttentionOptions::Kernel::kSdpa;
  const int64_t B = 2, Hkv = 2, G = 2, T = 23, D = 8;
  at::Tensor q = at::randn({B, Hkv, G, T, D}), k = at::randn({B, Hkv, T, D}), v = at::randn({B, Hkv, T, D});
  {
    // With attention dropout sdpa is refused on any LibTorch: it draws masks of its own.
    AttentionOptions dropping = options;
    dropping.dropout = {0.1, row_seeds(B)};
    try {
      causal_segment_attention(q, k, v, at::zeros({B, T}, at::kLong), 0.35, 0, dropping);
      ADD_FAILURE() << "sdpa ran with attention dropout";
    } catch (const memtune::UserError& e) {
      EXPECT_NE(std::string(e.what()).find("sdpa draws its own dropout masks"), std::string::npos) << e.what();
    }
  }
  if (!memtune::models::sdpa_available()) {
    try {
      causal_segment_attention(q, k, v, at::zeros({B, T}, at::kLong), 0.35, 0, options);
      ADD_FAILURE() << "sdpa ran on a LibTorch without it";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("sdpa needs LibTorch 2.0"), std::string::npos) << e.what();
    }
    GTEST_SKIP() << "at::scaled_dot_product_attention needs LibTorch 2.0 (this build: 1.x)";
  }
  for (int64_t window : {0, 3}) {
    SCOPED_TRACE("window " + std::to_string(window));
    expect_textbook(q, k, v, two_rows_of_segments(T), window, options);
  }
  // Packed documents and padding with their runs known: gathered into width buckets.
  const at::Tensor seg = two_rows_of_segments(T);
  options.segment_lengths = memtune::models::segment_run_lengths(seg);
  ASSERT_TRUE(options.segment_lengths);
  expect_textbook(q, k, v, seg, 0, options);
  expect_textbook(q, k, v, seg, 3, options);  // a window: the mask again, the runs unused
  {
    // Documents of 1, 5 and 40 tokens and padding in one row (widths 32 and 64), one long
    // document in the other (width 128 > T).
    const int64_t T2 = 70;
    at::Tensor seg2 = at::full({2, T2}, 3, at::kLong);
    seg2[0].slice(0, 0, 1) = 0;
    seg2[0].slice(0, 1, 6) = 1;
    seg2[0].slice(0, 6, 46) = 2;
    seg2[0].slice(0, 46) = -1;
    at::Tensor q2 = at::randn({B, Hkv, G, T2, D}), k2 = at::randn({B, Hkv, T2, D}), v2 = at::randn({B, Hkv, T2, D});
    AttentionOptions o2 = options;
    o2.segment_lengths = memtune::models::segment_run_lengths(seg2);
    expect_textbook(q2, k2, v2, seg2, 0, o2);
    o2.document_buckets = memtune::models::document_buckets(*o2.segment_lengths, T2, c10::kCPU);  // made once
    expect_textbook(q2, k2, v2, seg2, 0, o2);
  }
  options.segment_lengths.reset();
  options.one_segment_per_row = true;
  expect_textbook(q, k, v, at::zeros({B, T}, at::kLong), 0, options);
}

// The buckets' gathers and `order` are a round trip: rows gathered by every bucket, their
// real positions kept and concatenated, then put in order, are the rows again; padding
// gathers the zero row; widths are the powers of two >= 32 that hold each document.
TEST(Attention, DocumentBucketsGatherEveryPositionOnceAndPutItBack) {
  const int64_t T = 42;
  const std::vector<std::vector<int64_t>> lengths = {{40, 2}, {10, 32}};
  auto db = memtune::models::document_buckets(lengths, T, c10::kCPU);
  ASSERT_EQ(db->buckets.size(), 2u);
  EXPECT_EQ(db->buckets[0].width, 32);
  EXPECT_EQ(db->buckets[0].documents, 3);  // 2, 10 and 32 tokens
  EXPECT_EQ(db->buckets[1].width, 64);
  EXPECT_EQ(db->buckets[1].documents, 1);  // 40 tokens
  const at::Tensor x = at::cat({at::randn({2 * T, 3}), at::zeros({1, 3})}, 0);  // the zero row last
  std::vector<at::Tensor> parts;
  for (const auto& b : db->buckets) {
    const at::Tensor rows = x.index_select(0, b.gather);
    EXPECT_EQ(rows.size(0), b.documents * b.width);
    EXPECT_EQ((b.gather == 2 * T).sum().item<int64_t>(), b.documents * b.width - b.real.numel()) << "padding";
    parts.push_back(rows.index_select(0, b.real));
  }
  EXPECT_TRUE(at::equal(at::cat(parts, 0).index_select(0, db->order), x.narrow(0, 0, 2 * T)));
  // Row 0's 2-token document (positions 40, 41) is the first in the first bucket.
  EXPECT_EQ(db->order[40].item<int64_t>(), 0);
  EXPECT_EQ(db->order[0].item<int64_t>(), 44);  // the 40-token document comes after the 44 of width 32
}

// The runs attention by documents splits rows by: lengths of equal segment ids in order,
// padding (-1) a run of its own; none when a row's document resumes after another.
TEST(Attention, SegmentRunLengthsAreTheRowsDocumentsInOrder) {
  at::Tensor seg = at::tensor({0, 0, 0, 1, 1, 2, -1, -1, 5, 5, 5, 5, 5, 5, 5, 5}, at::kLong).view({2, 8});
  auto runs = memtune::models::segment_run_lengths(seg);
  ASSERT_TRUE(runs);
  EXPECT_EQ(*runs, (std::vector<std::vector<int64_t>>{{3, 2, 1, 2}, {8}}));
  seg[1][4] = 7;  // 5 5 5 5 7 5 5 5: document 5 resumes
  EXPECT_FALSE(memtune::models::segment_run_lengths(seg));
}

// Inputs the fused kernel does not take run the blocked kernel, still exactly: a segment id
// that comes back after another one (not a run), and float64.
TEST(Attention, InputsOutsideTheFusedKernelUseTheBlockedOne) {
  torch::manual_seed(12);
  const int64_t B = 2, T = 12, D = 8;
  at::Tensor seg = at::zeros({B, T}, at::kLong);
  seg[0].slice(0, 4, 8) = 1;  // 0 0 0 0 1 1 1 1 0 0 0 0: document 0 resumes
  at::Tensor q = at::randn({B, 1, 2, T, D}), k = at::randn({B, 1, T, D}), v = at::randn({B, 1, T, D});
  EXPECT_FALSE(uses_fused_cpu_attention(q, k, v, seg));
  expect_textbook(q, k, v, seg, 0, {});
  EXPECT_FALSE(
      uses_fused_cpu_attention(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), at::zeros({B, T}, at::kLong)));
}

}  // namespace
